"""NCCL's own words, read where a failure is worded: the watchdog's lines on a worker's stderr (several torch
versions' forms), an NCCL collective's Python error that lost its peer, the relay that reads them, the launcher's
one line, and the heartbeat counters that name the rank that froze. (The whole path, a worker that logs the
watchdog's line and aborts under the real launcher: tests/integration/test_dist.py.)"""

from __future__ import annotations

import os
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as tdist

from detrain.distributed import dist, heartbeat
from detrain.distributed.launch.failures import describe_failure, is_consequence
from detrain.distributed.launch.nccl_watch import WatchdogFinding, peer_gone, relayed_stderr, watchdog_finding

# the watchdog's line as torch 2.4 (no [rankN]: prefix) and 2.14 log it, and its monitor's when the watchdog hangs
OLD = (
    "[E ProcessGroupNCCL.cpp:563] [Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, "
    "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=120000) ran for 120822 milliseconds before timing out."
)
NEW = (
    "[rank0]:[E1126 10:00:00.000000000 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=808, OpType=_REDUCE_SCATTER_BASE, NumelIn=9801523, NumelOut=9801523, "
    "Timeout(ms)=600000) ran for 600020 milliseconds before timing out."
)
STUCK = (
    "[rank3]:[F1126 10:08:00.000000000 ProcessGroupNCCL.cpp:1169] [PG 0 Rank 3] ProcessGroupNCCL's watchdog got "
    "stuck for 480 seconds without making progress in monitoring enqueued collectives."
)
REMOTE = (
    "DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356, remote process exited or there was a network "
    "error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error or a remote process "
    "exiting prematurely."
)


def test_the_watchdogs_lines_are_read_whichever_torch_wrote_them() -> None:
    old = WatchdogFinding(2, "NCCL's watchdog: ALLREDUCE #1 waited 121s for the other ranks", True)
    assert watchdog_finding(OLD) == old
    assert watchdog_finding(NEW) == WatchdogFinding(
        0, "NCCL's watchdog: _REDUCE_SCATTER_BASE #808 waited 600s for the other ranks", True
    )
    assert watchdog_finding(STUCK) == WatchdogFinding(
        3, "NCCL's watchdog was stuck for 480s (a CUDA or NCCL call hung)", False
    )
    assert watchdog_finding("[rank0]:[W ProcessGroupNCCL.cpp:1] Warning: a destroyed process group") is None


def test_an_nccl_collective_that_lost_its_peer_is_a_consequence_on_either_side() -> None:
    assert peer_gone(REMOTE) and is_consequence(REMOTE) and dist.waited_for_a_peer(REMOTE)
    aborted = "DistBackendError: NCCL communicator was aborted on rank 1."
    assert peer_gone(aborted) and is_consequence(aborted)
    assert not is_consequence("RuntimeError: CUDA error: an illegal memory access was encountered")
    assert not is_consequence("RuntimeError: an upload: remote process exited")  # without NCCL: not its words


def _failure(exitcode: int, timestamp: int, message: str = "") -> SimpleNamespace:
    signal_name = {-6: "SIGABRT", -9: "SIGKILL"}.get(exitcode, "")
    return SimpleNamespace(
        message=message, timestamp=timestamp, exitcode=exitcode, error_file_data=None, signal_name=lambda: signal_name
    )


def test_the_launchers_line_for_ranks_the_watchdog_ended() -> None:
    finding = watchdog_finding(NEW.replace("[Rank 0]", "[Rank 1]"))
    assert finding is not None
    error = SimpleNamespace(failures={1: _failure(-6, 100)})
    plain = describe_failure(error, 0)
    assert plain == "worker rank 1 was killed by SIGABRT (exit code -6)"  # the line without the watchdog's words
    line = describe_failure(error, 0, {1: finding})
    assert line == (
        "worker rank 1 was ended (SIGABRT) by NCCL's watchdog: _REDUCE_SCATTER_BASE #808 waited 600s for the other "
        f"ranks {dist.PEER_LOST_MARK}"
    )
    line = describe_failure(error, 0, {1: finding}, {3: 597.0})
    assert line == (
        "rank 3 stopped responding (its heartbeat stopped 597s before the others'; NCCL's watchdog: "
        "_REDUCE_SCATTER_BASE #808 waited 600s for the other ranks, seen by worker rank 1)"
    )
    # a rank that died on its own (SIGKILL, later) is the cause; the one the watchdog ended only noticed
    error = SimpleNamespace(failures={1: _failure(-6, 100), 2: _failure(-9, 101)})
    assert describe_failure(error, 0, {1: finding}).startswith("worker rank 2 was killed by SIGKILL")


def test_the_relay_passes_stderr_on_and_keeps_the_watchdogs_finding(capfd: pytest.CaptureFixture[str]) -> None:
    with relayed_stderr(True) as watch:
        os.write(2, b"a warning\n" + NEW[:50].encode())
        os.write(2, NEW[50:].encode() + b"\nthe end\n")  # a line in two writes, as a pipe may hand it over
    assert capfd.readouterr().err == f"a warning\n{NEW}\nthe end\n"
    assert list(watch.findings) == [0] and watch.findings[0].waited
    with relayed_stderr(False) as watch:
        os.write(2, (NEW + "\n").encode())
    assert not watch.findings and NEW in capfd.readouterr().err


def test_the_rank_whose_heartbeat_stopped_first_is_read_from_the_store() -> None:
    store = tdist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10))
    assert heartbeat.stopped_early(store, 2) == {}  # no counters here
    for attempt, counts in ((0, [50, 50, 50]), (1, [130, 12, 128, 126])):  # the restart is the one that failed
        for rank, count in enumerate(counts):
            store.add(f"detrain/heartbeat/attempt_{attempt}/{rank}", count)
    assert heartbeat.stopped_early(store, 2) == {1: 118.0}  # 2 and 3 ended a beat or four after rank 0: no story
