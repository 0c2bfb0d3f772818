"""Every node ends when the run ends (detrain.distributed.launch.job_watch) and a rank that waited in vain names the
rank whose heartbeat stopped (detrain.distributed.heartbeat, dist.silent_peers_error): in one process, on a real
TCPStore on 127.0.0.1, with intervals of a few hundredths of a second. The whole story, with processes, is
tests/integration/test_chaos.py's stopped rank."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as tdist

from detrain.distributed import dist, heartbeat
from detrain.distributed.launch.job_watch import END_KEY, JobWatch
from detrain.distributed.launch.master_store import host_store
from detrain.errors import DistributedError

LIMIT_S = 30  # a hang guard, not a timing


@pytest.fixture
def server():
    store = host_store("127.0.0.1", 0, bind="127.0.0.1", timeout=timedelta(seconds=5))
    yield store
    del store


def _client(server) -> tdist.TCPStore:
    return tdist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=5))


def _interrupted() -> bool:
    """Wait (at most LIMIT_S) for the KeyboardInterrupt a watch sends to this, the main thread."""
    deadline = time.monotonic() + LIMIT_S
    try:
        while time.monotonic() < deadline:
            time.sleep(0.01)
    except KeyboardInterrupt:
        return True
    return False


# ------------------------------------------------------------------ heartbeats


def test_a_rank_whose_heartbeat_stopped_is_named_and_a_beating_one_is_not(server) -> None:
    beats = [
        heartbeat.Heartbeat(tdist.PrefixStore("hb", _client(server)), r, 3, every_s=0.02).start() for r in range(3)
    ]
    try:
        assert beats[0].silent(watch_s=0.3) == []
        beats[2].stop()  # as a SIGSTOPped or dead process: its counter stands still
        assert beats[0].silent(watch_s=0.3) == [2]
        assert beats[1].silent(watch_s=0.3) == [2]
    finally:
        for b in beats:
            b.stop()


def test_without_a_store_nobody_is_named(server) -> None:
    beat = heartbeat.Heartbeat(tdist.PrefixStore("hb", _client(server)), 0, 2, every_s=0.02)
    beat.store = None  # what a store whose host ended gives: errors
    assert beat.counts() is None and beat.silent(watch_s=0.01) == []


class _Blip:
    """A store client that fails while ``faults[0]`` > 0 (each call uses one up), as one cut off by a network drop
    does (its calls time out and raise), then works; ``faults`` is shared with the clients made after it."""

    def __init__(self, store, faults: list[int]) -> None:
        self.store, self.faults = store, faults

    def add(self, key: str, n: int) -> int:
        if self.faults[0] > 0:
            self.faults[0] -= 1
            raise RuntimeError("Socket Timeout")
        return self.store.add(key, n)


def test_a_heartbeat_outlives_a_store_blip_with_a_new_client_and_nobody_is_named(server) -> None:
    """Rank 1's client fails (its link dropped); its heartbeat makes a new client and beats on, so once the store
    answers again rank 0 names nobody. Without a new client (the old behaviour) the thread ended at the first
    error and rank 1 was named although it was alive."""
    faults, fresh = [1], []

    def reconnect() -> _Blip:
        fresh.append(1)
        return _Blip(tdist.PrefixStore("hb", _client(server)), faults)

    beats = [
        heartbeat.Heartbeat(tdist.PrefixStore("hb", _client(server)), 0, 2, every_s=0.02).start(),
        heartbeat.Heartbeat(_Blip(tdist.PrefixStore("hb", _client(server)), faults), 1, 2, 0.02, reconnect).start(),
    ]
    try:
        deadline = time.monotonic() + LIMIT_S
        while not fresh and time.monotonic() < deadline:  # the blip happened and a new client was made
            time.sleep(0.01)
        assert fresh and beats[1].failures == 1
        assert beats[0].silent(watch_s=0.3) == []
        faults[0] = 5  # five more failed beats, each followed by a new client
        while faults[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert beats[0].silent(watch_s=0.3) == [] and beats[1].failures == 6 and len(fresh) == 6
    finally:
        for b in beats:
            b.stop()


def test_a_heartbeat_without_a_way_to_reconnect_stops_at_the_first_error(server) -> None:
    beat = heartbeat.Heartbeat(_Blip(tdist.PrefixStore("hb", _client(server)), [1]), 1, 2, every_s=0.02).start()
    beat._thread.join(LIMIT_S)
    assert not beat._thread.is_alive() and beat.failures == 1


@pytest.mark.parametrize(
    ("message", "waited"),
    [
        (
            "RuntimeError: [/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 10000ms for send operation",
            True,
        ),
        ("RuntimeError: [/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:50379", True),
        (
            (
                "DistributedError: all_reduce_sum failed on rank 0 of 2: timed out after 5s waiting for the "
                f"other ranks {dist.PEER_LOST_MARK} [x]"
            ),
            True,
        ),
        ("RuntimeError: Application timeout caused pair closure", True),
        ("DistBackendError: [/gloo/pair.cc:1] Connection reset by peer", True),
        ("DistributedError: batch=6 does not split evenly", False),
        ("RuntimeError: CUDA out of memory", False),
        ("ValueError: timed out reading a label file", False),  # not gloo's words: this rank's own failure
    ],
)
def test_only_a_wait_for_a_peer_asks_the_heartbeats(message: str, waited: bool) -> None:
    assert dist.waited_for_a_peer(message) is waited


def test_the_silent_rank_is_named_in_one_line(server, monkeypatch) -> None:
    monkeypatch.setattr(heartbeat, "silent_ranks", lambda watch_s=None: [1])
    error = dist.silent_peers_error(RuntimeError("[/gloo/tcp/pair.cc:1] Timed out waiting 10000ms for recv\nmore"))
    assert isinstance(error, DistributedError)
    assert str(error) == (
        f"rank 1 stopped responding: no heartbeat for 3s {dist.PEER_LOST_MARK} [Timed out waiting 10000ms for recv]"
    )
    assert dist.silent_peers_error(ValueError("Timed out")) is None  # not a wait for a peer
    monkeypatch.setattr(heartbeat, "silent_ranks", lambda watch_s=None: [])
    assert dist.silent_peers_error(RuntimeError("gloo: Connection reset by peer")) is None  # all alive: keep it


def test_the_launcher_report_leads_with_the_silent_rank() -> None:
    from types import SimpleNamespace

    from detrain.distributed.launch.failures import describe_failure, explained

    text = str(DistributedError(f"rank 1 stopped responding: no heartbeat for 3s {dist.PEER_LOST_MARK} [Timed out]"))
    message = f"DistributedError: {text}"
    failure = SimpleNamespace(
        message={"message": message}, timestamp=1, exitcode=1, error_file_data={"message": {"message": message}}
    )
    error = SimpleNamespace(failures={0: failure})
    assert describe_failure(error, 0) == "rank 1 stopped responding (no heartbeat for 3s, seen by worker rank 0)"
    assert explained(error)  # one of detrain's own errors: elastic's traceback adds nothing


# ------------------------------------------------------------------ the end of the run reaches every node


def test_a_reason_published_by_one_node_stops_the_others(server) -> None:
    watch = JobWatch("127.0.0.1", server.port, node_rank=1, poll_s=0.02).start()
    node0 = JobWatch("127.0.0.1", server.port, node_rank=0)
    # node 0 publishes from another thread: the interrupt goes to the main thread, as in node 1's launcher
    publisher = threading.Thread(
        target=node0.publish, args=("node 0: worker rank 0 failed:\nrank 1 stopped",), kwargs={"wait_s": LIMIT_S}
    )
    try:
        publisher.start()
        assert _interrupted()
        publisher.join(LIMIT_S)
    finally:
        watch.stop()
    assert not publisher.is_alive()  # node 0 went as soon as the other node had read it (nnodes=2)
    assert watch.reason == "the run ended on node 0: worker rank 0 failed: rank 1 stopped"
    assert int(_client(server).add("detrain/job/seen", 0)) == 1


def test_a_completed_run_stops_nobody(server) -> None:
    watch = JobWatch("127.0.0.1", server.port, node_rank=1, poll_s=0.02).start()
    JobWatch("127.0.0.1", server.port, node_rank=0).publish("")
    deadline = time.monotonic() + LIMIT_S
    while watch._thread.is_alive() and time.monotonic() < deadline:  # it reads "" and stops watching
        time.sleep(0.01)
    assert not watch._thread.is_alive() and watch.reason is None


def test_a_forged_reason_is_one_short_line(server) -> None:
    """A hostile peer on the store's port writes the key: escapes, newlines, bad UTF-8, megabytes."""
    _client(server).set(END_KEY, b"node 9: \x1b[2J\nerror: forged\r\n" + b"\xff\xfe" + b"A" * 2_000_000)
    watch = JobWatch("127.0.0.1", server.port, node_rank=1, poll_s=0.02).start()
    try:
        assert _interrupted()
    finally:
        watch.stop()
    assert "\n" not in watch.reason and "\r" not in watch.reason and len(watch.reason) < 350
    assert watch.reason.startswith("the run ended on node 9: \x1b[2J error: forged \ufffd\ufffdAAA")


def test_losing_node_0_stops_a_node_and_kills_its_stopped_worker() -> None:
    server = host_store("127.0.0.1", 0, bind="127.0.0.1", timeout=timedelta(seconds=5))
    worker = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(LIMIT_S,), daemon=True)
    worker.start()
    os.kill(worker.pid, signal.SIGSTOP)  # a stopped worker never acts on the agent's SIGTERM
    watch = JobWatch("127.0.0.1", server.port, node_rank=1, poll_s=0.02, lost_after_s=0.3, kill_after_s=0.1)
    watch.start()
    try:
        time.sleep(0.1)
        del server  # node 0's launcher ends: its store with it
        assert _interrupted()
        worker.join(LIMIT_S)
    finally:
        watch.stop()
        if worker.is_alive():
            worker.kill()
    assert watch.reason is not None and watch.reason.startswith("lost node 0's launcher at 127.0.0.1:")
    assert worker.exitcode == -signal.SIGKILL


STUCK_LAUNCHER = """
import time
from datetime import timedelta
from detrain.distributed.launch.job_watch import JobWatch
from detrain.distributed.launch.master_store import host_store
server = host_store("127.0.0.1", 0, bind="127.0.0.1", timeout=timedelta(seconds=5))
watch = JobWatch("127.0.0.1", server.port, 1, poll_s=0.02, lost_after_s=0.3, kill_after_s=0.1, exit_after_s=0.5)
watch.start()
time.sleep(0.1)
del server
deadline = time.monotonic() + 30
while time.monotonic() < deadline:  # a main thread that never comes out (a call over a dead link): ignores the
    try:                            # interrupt, as a C++ call that does not return would
        time.sleep(0.01)
    except KeyboardInterrupt:
        pass
print("still here")
"""


def test_a_launcher_stuck_past_the_watchs_verdict_ends_itself_with_the_line() -> None:
    """Over a link that drops every packet, torch's agent can sit in a store call that never returns, so the
    interrupt never lands: the watch then prints the reason and ends the process itself (exit code 2)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", STUCK_LAUNCHER], capture_output=True, text=True, timeout=LIMIT_S)
    assert proc.returncode == 2 and "still here" not in proc.stdout
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("error: lost node 0's launcher at 127.0.0.1:") and "for 0.3s" in last


@pytest.mark.parametrize("timeout", [37.0, 120.0])
def test_the_node_0_watch_waits_exactly_dist_timeout(timeout: float, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README promises that a node cut off from node 0 ends once node 0 has been silent for ``dist_timeout``:
    the launcher's watch is given that very number (a collective may wait as long; a shorter watch would end nodes
    whose collectives were still in time, a longer one leaves them hanging past it)."""
    import detrain.distributed.launch.launcher
    import detrain.run.task
    from detrain.config.cfg import make_cfg

    monkeypatch.chdir(tmp_path)
    given: list[dict] = []
    monkeypatch.setattr(
        detrain.distributed.launch.launcher, "launch", lambda entry, args, devices, **kw: given.append(kw)
    )
    cfg = make_cfg({"device": "cpu", "nnodes": 2, "node_rank": 1, "master_addr": "127.0.0.1", "dist_timeout": timeout})
    detrain.run.task.run_task("train", cfg)
    assert given[0]["lost_after_s"] == timeout
