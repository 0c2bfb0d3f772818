"""What a process inside the group, or one that can only reach it, can do to the other ranks (issue 37 items 10
and 11): the proofs of concept, one test each, run on two gloo workers on this machine.

* A rank that sends a pickle into an object collective (``dist.all_gather_object``, ``dist.broadcast_object``)
  does not run code on the rank that receives it: that rank refuses it with one line, and nothing of it is built
  (torch's object collectives, which detrain called before, unpickle whatever a peer sent). The hostile rank
  speaks the collective's own protocol with torch's tensor collectives (lengths, then the bytes), which is the
  same for torch's object collectives and detrain's, so the test also shows the old code running the payload.
* A process that reaches a live run's rendezvous store (``master_port`` on 127.0.0.1) without the run's secret
  lists its keys and reads every value: none is readable (each is sealed), where it read the run id, the
  arguments, the agents' records and the ranks' addresses before.
* Such a process cannot join: on a master waiting for its second node it writes a node's arrival with what it
  read, which the master ignores (before, it took it for the node and told the group to go); a node given
  another secret ends with one line; the real node then joins and the run completes.
* A node of a run of several nodes without the secret ends with one line, exit 2, before it reaches the master.
* torch's c10d rendezvous (``nnodes=MIN:MAX``) keeps its state as a pickle in the store, which every launcher
  unpickles: one written there by a process without the secret, or even by one with it, runs nothing (before,
  every launcher ran it).

The workers live here, at the top level of this module, which spawned workers import by name.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import _pickle_forge as pf
import pytest
import torch
import torch.distributed as tdist
from _processes import REPO, RUN_SECRET, child_env, free_port

from detrain.data.synthetic import generate_shapes
from detrain.distributed import dist
from detrain.distributed.launch import run_identity
from detrain.distributed.launch.launcher import launch, parse_device
from detrain.distributed.world import World
from detrain.errors import DistributedError

HERE = Path(__file__).resolve().parent


def _payload(marker: str) -> bytes:
    """A pickle that creates ``marker`` when it is loaded: ``open(marker, "w")``."""
    return pf.proto() + pf.reduce_(pf.global_("builtins", "open"), pf.str_(marker), pf.str_("w")) + b"."


def _send_raw_gather(data: bytes) -> None:
    """One all-gather of ``data`` as the object collectives send theirs: every rank's length, then every rank's
    bytes padded to the longest."""
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(tdist.get_world_size())]
    tdist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64))
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    tdist.all_gather([torch.empty(longest, dtype=torch.uint8) for _ in sizes], mine)


def _send_raw_broadcast(data: bytes) -> None:
    """One broadcast of ``data`` from this rank as the object collectives send theirs: the length, then the bytes."""
    tdist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=tdist.get_rank())
    tdist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=tdist.get_rank())


def pickle_into_collective(args: dict[str, Any], world: World) -> str:
    """Rank 1 (``gather``) or rank 0 (``broadcast``) sends a pickle; the other calls detrain's collective."""
    dist.setup(world, timeout_s=30.0)
    hostile = 1 if args["how"] == "gather" else 0
    if dist.rank() == hostile:
        payload = _payload(args["marker"])
        _send_raw_gather(payload) if args["how"] == "gather" else _send_raw_broadcast(payload)
        return "sent"
    try:
        got = dist.all_gather_object({"rank": 0}) if args["how"] == "gather" else dist.broadcast_object(None, src=0)
    except DistributedError as e:
        return f"refused: {e}"
    return f"received {type(got).__name__}"  # the old code: the file the pickle opened, or a list holding it


@pytest.mark.parametrize("how", ["gather", "broadcast"])
def test_a_pickle_sent_into_an_object_collective_runs_nothing(tmp_path: Path, how: str) -> None:
    marker = tmp_path / "the-payload-ran"
    rank_of_receiver = 0 if how == "gather" else 1
    results = launch(
        _receiver_result, {"how": how, "marker": str(marker), "receiver": rank_of_receiver}, parse_device("cpu,cpu")
    )
    assert not marker.exists(), "the receiving rank ran the pickle a peer sent"
    assert results is not None
    line = results
    assert line.startswith("refused: "), line
    assert "\n" not in line
    sender = 1 if how == "gather" else 0
    assert f"refused what rank {sender} sent: not a detrain message" in line and "a pickle?" in line, line


def _receiver_result(args: dict[str, Any], world: World) -> str:
    """Each rank runs :func:`pickle_into_collective`; rank 0 returns the receiver's line (rank 0 is what launch
    returns): the receiver's own, or, where rank 1 receives, what rank 1 said, broadcast as a tensor of text."""
    mine = pickle_into_collective(args, world)
    if args["receiver"] == 0:
        return mine
    text = torch.zeros(400, dtype=torch.uint8)
    if dist.rank() == 1:
        raw = mine.encode()[:400]
        text[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    tdist.broadcast(text, src=1)
    return bytes(text.tolist()).rstrip(b"\0").decode()


# ------------------------------------------------------------------------------------------- the store


def read_the_store(args: dict[str, Any], world: World) -> dict[str, str]:
    """Every rank joins; then rank 0, as a stranger would, opens a plain client of the run's rendezvous store (no
    secret), lists its keys and reads every value: what it read, by key (a counter as ``count``)."""
    dist.setup(world, timeout_s=30.0)
    seen: dict[str, str] = {}
    if dist.rank() == 0:
        stranger = tdist.TCPStore(world.master_addr, int(world.master_port or 0), None, False, timedelta(seconds=10))
        for key in stranger.list_keys():
            value = bytes(stranger.get(key))
            seen[key] = "count" if value.isdigit() else value.hex()
    dist.barrier("read")
    return seen


def test_a_stranger_reads_nothing_of_a_live_run_from_its_store() -> None:
    seen = launch(read_the_store, {}, parse_device("cpu,cpu"), run_id="peer-attack-job-7")
    assert seen, "the store holds no keys at all"
    values = {k: bytes.fromhex(v) for k, v in seen.items() if v != "count"}
    assert any("attempt_0" in k for k in values), sorted(seen)  # the ranks' own keys (their addresses) are there
    readable = {k: v[:60] for k, v in values.items() if not v.startswith(b"DTS1")}
    assert readable == {}, "values a process without the secret can read"
    assert not any(b"peer-attack-job-7" in v for v in values.values())


def _node0(port: int, extra: dict[str, Any], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Node 0 of a run of two on 127.0.0.1, in a process of its own: its launcher with one worker of
    :func:`hold_then_report`."""
    code = (
        "import json, sys; from detrain.distributed.launch.launcher import launch, parse_device; "
        "from detrain.errors import DetrainError; import test_peer_attacks as t\n"
        "try: print(json.dumps(launch(t.hold_then_report, {}, parse_device('cpu'), node_rank=0, "
        "**json.loads(sys.argv[1]))))\n"
        "except DetrainError as e: sys.exit(f'error: {e}')"  # as the command line says it: one line, exit 2
    )
    kwargs = {"master_port": port, **extra}
    env = {**env, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])}
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(kwargs)], env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        )


def hold_then_report(args: dict[str, Any], world: World) -> dict[str, Any]:
    """Join, hold a few seconds (while a stranger works on the store), report the world."""
    dist.setup(world, timeout_s=60.0)
    time.sleep(float(os.environ.get("TEST_HOLD_S", "0")))
    dist.barrier("held")
    return {"rank": dist.rank(), "world": dist.world_size()}


def _stranger(port: int) -> Any:
    return tdist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))


def _wait_for_key(store: Any, key: str, proc: subprocess.Popen[bytes], log: Path, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while not store.check([key]):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{key} never appeared\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def test_a_process_without_the_secret_cannot_join_a_run_that_waits_for_a_node(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "node0.txt"
    node0 = _node0(port, {"nnodes": 2, "run_id": "job-x"}, child_env(), log)
    try:
        stranger = _stranger(port)
        _wait_for_key(stranger, "detrain/run/id", node0, log)
        seen = bytes(stranger.get("detrain/run/id"))
        assert b"job-x" not in seen  # before: the run id, in the clear
        # it joins as run_identity.join does, with the id it read
        index = int(stranger.add("detrain/run/arrivals", 1)) - 1
        arrival = {"run_id": seen.decode(errors="replace"), "node_rank": 1, "args": None}
        stranger.set(f"detrain/run/arrival/{index}", json.dumps(arrival))
        time.sleep(3)  # the master reads arrivals every 0.2 s
        assert not stranger.check(["detrain/run/verdict"]), "the master took the stranger for its second node"
        # a node given another secret is told so, in one line, and does not join either
        with pytest.raises(DistributedError, match="seals its rendezvous with another secret") as other:
            run_identity.join(
                "127.0.0.1",
                port,
                "job-x",
                1,
                None,
                wait_go=True,
                connect_timeout_s=10,
                start_timeout_s=10,
                secret="another-secret-0123456789",
            )
        assert "\n" not in str(other.value)
        # the real node joins, and the run completes
        assert (
            launch(
                hold_then_report,
                {},
                parse_device("cpu"),
                nnodes=2,
                node_rank=1,
                master_port=port,
                run_id="job-x",
                world=World.from_env({"DETRAIN_RUN_SECRET": RUN_SECRET}),
            )
            is None
        )  # (rank 0's result is node 0's)
        assert node0.wait(timeout=120) == 0, log.read_text()[-3000:]
        text = log.read_text()
        assert json.loads(text.strip().splitlines()[-1]) == {"rank": 0, "world": 2}, text[-3000:]
        assert "a process without this run's secret tried to join" in text
    finally:
        node0.kill()
        node0.wait()


def test_a_node_without_the_secret_is_told_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(
        DistributedError,
        match=r"node_rank=1 of a run of several nodes needs the run's secret: set "
        r"DETRAIN_RUN_SECRET",
    ):
        launch(
            hold_then_report,
            {},
            parse_device("cpu"),
            nnodes=2,
            node_rank=1,
            master_port=free_port(),
            world=World.from_env({}),
            connect_timeout=1.0,
        )
    data = generate_shapes(tmp_path / "shapes", n_train=2, n_val=1, imgsz=64) / "data.yaml"
    env = child_env()
    del env["DETRAIN_RUN_SECRET"]
    cmd = [
        sys.executable,
        "-m",
        "detrain.cli",
        "train",
        f"data={data}",
        "nnodes=2",
        "node_rank=1",
        f"master_port={free_port()}",
        "epochs=1",
    ]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = [line for line in (proc.stdout + proc.stderr).strip().splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert lines[-1].startswith("error: node_rank=1 of a run of several nodes needs the run's secret"), lines[-3:]
    env["DETRAIN_RUN_SECRET"] = "short"
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert (
        proc.returncode == 2
        and "DETRAIN_RUN_SECRET must be 16 to 256 printable characters" in proc.stderr + proc.stdout
    )


# ------------------------------------------------------------------------------ torch's c10d rendezvous


@pytest.mark.parametrize("with_secret", [False, True], ids=["stranger", "a node with the secret"])
def test_a_pickle_written_into_the_c10d_rendezvous_state_runs_nothing(tmp_path: Path, with_secret: bool) -> None:
    port, log, marker = free_port(), tmp_path / "node0.txt", tmp_path / "the-payload-ran"
    node0 = _node0(port, {"nnodes": "1:2", "run_id": "job-c"}, child_env(TEST_HOLD_S="60"), log)
    try:
        key = "torch.rendezvous.job-c"
        plain = _stranger(port)
        _wait_for_key(plain, key, node0, log)
        writer: Any = plain
        if with_secret:
            from detrain.distributed.launch.master_store import SealedStore  # here: the code before this test had none

            writer = SealedStore(plain, RUN_SECRET)
        writer.set(key, base64.b64encode(_payload(str(marker))))
        deadline = time.monotonic() + 60
        while node0.poll() is None and not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not marker.exists(), "a launcher ran the pickle written into its rendezvous state"
        assert node0.wait(timeout=60) != 0
        last = log.read_text().strip().splitlines()[-1]
        reason = "is not torch's" if with_secret else "is not sealed with this run's secret"
        assert last.startswith("error: ") and reason in last, log.read_text()[-3000:]
    finally:
        node0.kill()
        node0.wait()


def test_srun_tasks_on_several_nodes_need_the_secret() -> None:
    """srun starts every rank itself, so no launcher can make the secret: the job script gives it, or each task
    ends with one line before it joins."""
    tasks = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0"}
    tasks |= {"SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "1234"}
    with pytest.raises(DistributedError, match="srun's tasks on several nodes need the run's secret: export "):
        dist._check_world(World.from_env(tasks))
    dist._check_world(World.from_env({**tasks, "DETRAIN_RUN_SECRET": RUN_SECRET}))
    one_node = {**tasks, "SLURM_TASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": "gpu07"}
    dist._check_world(World.from_env(one_node))  # one machine: no secret needed (and none sealed: security.md)
