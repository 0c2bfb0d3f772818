"""launch: device strings, pre-flight errors, and real launches through torch's elastic launcher.

Workers are tiny functions in ``_dist_workers.py`` on gloo over 127.0.0.1. Where a test needs a launcher
process of its own (torchrun, two nodes, Ctrl-C) it runs ``_dist_workers.py`` in a subprocess.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import _dist_workers as workers
import pytest
import torch
from _processes import RUN_SECRET

from detrain.data.synthetic import generate_shapes
from detrain.distributed.launch.devices import cpu_threads_per_worker
from detrain.distributed.launch.launcher import (
    DevicePlan,
    launch,
    parse_device,
    parse_nnodes,
    rendezvous_address,
)
from detrain.distributed.world import World
from detrain.engine.build import set_cpu_threads
from detrain.errors import DistributedError

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).resolve().parents[1] / "_dist_workers.py")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    """A child environment outside any launcher, with detrain importable."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["DETRAIN_RUN_SECRET"] = RUN_SECRET  # the nodes of one run share its secret
    return env


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


# ------------------------------------------------------------------------------- parse_device


@pytest.mark.parametrize(
    ("device", "kind", "ids", "nprocs"),
    [
        ("cpu", "cpu", (), 1),
        ("CPU", "cpu", (), 1),
        ("cpu,cpu", "cpu", (), 2),
        (["cpu", "cpu", "cpu"], "cpu", (), 3),
        (0, "cuda", (0,), 1),
        ("0", "cuda", (0,), 1),
        ("cuda:1", "cuda", (1,), 1),
        ("cuda", "cuda", (0,), 1),
        ("0,1", "cuda", (0, 1), 2),
        ("1, 0", "cuda", (1, 0), 2),
        ("[0,1]", "cuda", (0, 1), 2),
        ([0, 1], "cuda", (0, 1), 2),
        ("cuda:0,cuda:1", "cuda", (0, 1), 2),
    ],
)
def test_parse_device(monkeypatch: pytest.MonkeyPatch, device, kind, ids, nprocs) -> None:
    _fake_gpus(monkeypatch, 2)
    plan = parse_device(device)
    assert (plan.kind, plan.ids, plan.nprocs, plan.auto) == (kind, ids, nprocs, False)


def test_parse_device_default(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, 0)
    assert parse_device(None) == DevicePlan("cpu", (), 1, auto=True)
    assert parse_device("") == DevicePlan("cpu", (), 1, auto=True)
    _fake_gpus(monkeypatch, 2)
    assert parse_device("") == DevicePlan("cuda", (0,), 1, auto=True)


@pytest.mark.parametrize(
    ("device", "gpus", "words"),
    [
        ("2", 2, ["cuda:2 does not exist", "2 CUDA GPU(s) are visible"]),
        ("0,5", 2, ["cuda:5 does not exist"]),
        ("0,0", 2, ["cuda:0 twice"]),
        ("0", 0, ["no CUDA GPU", "device=cpu"]),
        ("cpu,0", 2, ["mixes cpu and cuda"]),
        ("-1", 2, ["negative"]),
        ("gpu", 2, ["'gpu' is not a device"]),
        ("mps,mps", 0, ["only one mps"]),
    ],
)
def test_parse_device_errors(monkeypatch: pytest.MonkeyPatch, device: str, gpus: int, words: list[str]) -> None:
    _fake_gpus(monkeypatch, gpus)
    with pytest.raises(DistributedError) as err:
        parse_device(device)
    msg = str(err.value)
    assert "\n" not in msg
    for word in words:
        assert word in msg


def test_device_for_each_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, 4)
    assert DevicePlan("cuda", (2, 3), 2).device_for(1, 2) == "cuda:3"
    assert DevicePlan("cuda", (0,), 1, auto=True).device_for(3, 4) == "cuda:3"
    assert DevicePlan("cpu", (), 2).device_for(1, 2) == "cpu"
    with pytest.raises(DistributedError, match="lists 1 GPU"):
        DevicePlan("cuda", (0,), 1).device_for(1, 2)  # torchrun started 2 processes but device=0


def _srun_task(local_id: int, tasks: int = 4) -> World:
    """Task ``local_id`` of ``srun --ntasks-per-node TASKS`` on one node, as its environment describes it."""
    env = {"SLURM_PROCID": str(local_id), "SLURM_NTASKS": str(tasks), "SLURM_LOCALID": str(local_id)}
    env |= {"SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": str(tasks), "SLURM_NODELIST": "gpu01", "MASTER_PORT": "1"}
    return World.from_env(env)


def test_srun_with_a_gpu_per_task_gives_every_task_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """README's ``srun --ntasks-per-node 4 --gpus-per-task 1``: SLURM sets CUDA_VISIBLE_DEVICES per task, so each
    task sees one GPU (its own) as cuda:0; every task runs there instead of local ranks 1-3 finding no GPU."""
    _fake_gpus(monkeypatch, 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    device = lambda args, world: world.device  # noqa: E731 - the entry: which device the task was given
    for task in range(4):
        world = _srun_task(task)
        assert world.launcher == "slurm" and world.local_rank == task
        assert launch(device, {}, parse_device(""), world=world) == "cuda:0"
        assert launch(device, {}, parse_device("0"), world=world) == "cuda:0"  # device=0: each task's own first
    _fake_gpus(monkeypatch, 4)  # no binding (--gres=gpu:4): every task sees the node's four, and takes its own
    seen = [launch(device, {}, parse_device(""), world=_srun_task(t)) for t in range(4)]
    assert seen == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    _fake_gpus(monkeypatch, 1)  # torchrun's processes share what they see: a second one has no GPU of its own
    torchrun = World.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(DistributedError, match="local rank 1 has no GPU: 1 CUDA GPU"):
        launch(device, {}, parse_device(""), world=torchrun)


def test_one_cpu_thread_rule_for_spawned_and_in_process_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's spawned workers and a worker in this process (set_cpu_threads) share the cores alike."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)  # 8 cores allowed
    assert [cpu_threads_per_worker(n) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]
    seen: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    two_on_node = World(local_world_size=2)
    set_cpu_threads(torch.device("cpu"), two_on_node)
    set_cpu_threads(torch.device("cuda", 0), two_on_node)  # a GPU worker keeps torch's own count
    assert seen == [4]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's count wins everywhere
    assert cpu_threads_per_worker(2) is None
    set_cpu_threads(torch.device("cpu"), World(local_world_size=2, omp_threads="3"))
    assert seen == [4]


def test_parse_nnodes() -> None:
    assert parse_nnodes("2") == (2, 2)
    assert parse_nnodes(3) == (3, 3)
    assert parse_nnodes("1:4") == (1, 4)
    for bad in ("0", "3:2", "x", "1:2:3"):
        with pytest.raises(DistributedError, match="nnodes"):
            parse_nnodes(bad)


# ------------------------------------------------------------------------- pre-flight errors


def test_single_device_is_a_plain_call() -> None:
    marker = object()
    got = launch(lambda args, world: (args["x"], world.device, marker), {"x": 1}, parse_device("cpu"))
    assert got == (1, "cpu", marker)  # the caller's World, with the plan's device


def test_a_rank_of_torchrun_gets_its_world_with_the_device_of_its_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process (torchrun's rank): the caller's World, completed with the plan's device for its local rank;
    the device is handed over, never written into the environment."""
    _fake_gpus(monkeypatch, 4)
    world = World.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    seen = launch(
        lambda args, w: (w, sorted(k for k in os.environ if k.startswith("DETRAIN_DEVICE"))),
        {},
        parse_device("2,3"),
        world=world,
    )
    assert seen == (world.on("cuda:3"), [])
    with pytest.raises(DistributedError, match="lists 2 GPU"):  # three processes on the node for two GPUs
        launch(lambda args, w: w, {}, parse_device("2,3"), world=dataclasses.replace(world, local_world_size=3))


def test_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(DistributedError, match=f"master_port={port} is already in use"):
            launch(workers.report, {}, parse_device("cpu,cpu"), master_port=port)


def test_unreachable_master_is_a_clear_error() -> None:
    port = _free_port()  # nothing listens there
    t0 = time.monotonic()
    node = World.from_env({"DETRAIN_RUN_SECRET": RUN_SECRET})  # a node of several is given the run's secret
    with pytest.raises(DistributedError, match=f"cannot reach the master at 127.0.0.1:{port}"):
        launch(
            workers.report,
            {},
            parse_device("cpu"),
            nnodes=2,
            node_rank=1,
            master_port=port,
            connect_timeout=1.0,
            world=node,
        )
    assert time.monotonic() - t0 < 20


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"nnodes": 2}, "master_port=PORT"),
        ({"nnodes": 2, "node_rank": 2, "master_port": 29400}, "node_rank=2 must be in 0..1"),
        ({"nnodes": "1:2", "master_port": 29400, "rdzv_backend": "static"}, "needs rdzv_backend=c10d"),
        ({"master_port": 70000}, "not a TCP port"),
    ],
)
def test_bad_multi_node_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(DistributedError, match=match):
        launch(workers.report, {}, parse_device("cpu,cpu"), **kwargs)


def test_local_function_cannot_be_spawned() -> None:
    def local(args: dict) -> None:
        return None

    with pytest.raises(DistributedError, match="top-level function"):
        launch(local, {}, parse_device("cpu,cpu"))


# ---------------------------------------------------------------------------- real launches


def test_workers_get_their_device_and_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # tests/conftest.py sets it under xdist: the launcher's share
    before = signal.getsignal(signal.SIGINT)
    result = launch(workers.device_env, {}, parse_device("cpu,cpu"))
    assert result is not None
    assert (result["world_device"], result["launcher"]) == ("cpu", "detrain")  # handed over in the worker's World
    assert result["device_vars"] == []  # no device travels through the environment
    cores = len(os.sched_getaffinity(0))
    assert result["omp"] == result["world_omp"] == str(max(1, cores // 2))
    assert signal.getsignal(signal.SIGINT) is before  # elastic's handler does not outlive the launch


def test_joins_a_torchrun_world_instead_of_spawning(tmp_path: Path) -> None:
    out = str(tmp_path / "rank")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", SCRIPT, "torchrun", out]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world"], r["sum"]) for r in results] == [(0, 2, 2.0), (1, 2, 2.0)]
    for r in results:  # the entry ran inside the process torchrun started: nothing was spawned again
        assert r["pid"] == r["launcher_pid"]


def _run_two_nodes(out: Path, nnodes: str, *entry: str) -> tuple[list[str], list[int], list]:
    """Two single-worker "nodes" on 127.0.0.1 running ``report`` (or ``entry``: a worker name and its json
    arguments): their output, exit codes and results (None where a node wrote none)."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, SCRIPT, "node", str(node), str(port), str(out), nnodes, *entry],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    results = [json.loads(Path(f"{out}.{n}").read_text()) if Path(f"{out}.{n}").exists() else None for n in (0, 1)]
    return logs, [p.returncode for p in procs], results


def _two_nodes(tmp_path: Path, nnodes: str) -> list:
    logs, codes, results = _run_two_nodes(tmp_path / "node", nnodes)
    assert codes == [0, 0], "\n".join(log[-2000:] for log in logs)
    return results


def test_two_nodes_form_one_world(tmp_path: Path) -> None:
    node0, node1 = _two_nodes(tmp_path, "2")
    assert (node0["rank"], node0["world"], node0["sum"]) == (0, 2, 2.0)
    assert node1 is None  # static rendezvous: node_rank 0 holds rank 0, and only its caller gets a value


@pytest.mark.parametrize("node0", ["10.0.0.9", "255.255.255.255", "fe80::1%eth0", "zz-host.example", None])
def test_c10d_numbers_node_0_first_and_the_others_by_node_rank(node0: str | None) -> None:
    """torch's c10d rendezvous numbers nodes in the order of the addresses they give as text (10.0.0.12 before
    10.0.0.9): the address each node gives puts node 0 first whatever the real addresses, then node_rank's order."""
    real = ["0.0.0.1", "10.0.0.10", "::1", "a-host", "~"]
    given = [rendezvous_address(node0, 0, 12)] + [rendezvous_address(real[r % 5], r, 12) for r in range(1, 12)]
    assert sorted(range(12), key=lambda r: given[r]) == list(range(12))
    assert given[0] == (node0 or socket.getfqdn())  # rank 0's workers' store listens at node 0's real address


def test_elastic_nodes_form_one_world(tmp_path: Path) -> None:
    node0, node1 = _two_nodes(tmp_path, "1:2")  # c10d rendezvous: ranks follow node_rank (launch.rendezvous_address)
    assert (node0["rank"], node0["world"], node0["sum"]) == (0, 2, 2.0)
    assert node1 is None


def test_dataset_preparation_waits_for_prepare_timeout_not_the_training_timeout(tmp_path: Path) -> None:
    """Two nodes: rank 0's node has its dataset ready while rank 1's first process still prepares it (4 s, twice
    the 2 s training timeout). The wait is bounded by prepare_timeout; when that is too short, the error names
    what was waited for."""
    data = str(generate_shapes(tmp_path / "shapes", n_train=4, n_val=2, imgsz=64) / "data.yaml")
    logs, codes, results = _two_slow_nodes(tmp_path / "ok", {"data": data, "prepare_timeout": 60, "slow_rank": 1})
    assert codes == [0, 0], "\n".join(log[-2000:] for log in logs)
    assert results[0] == 4
    logs, codes, _ = _two_slow_nodes(tmp_path / "short", {"data": data, "prepare_timeout": 1, "slow_rank": 1})
    assert codes[0] != 0
    assert "barrier 'dataset" in logs[0] and "prepared by the first process of this node'" in logs[0], logs[0][-2000:]


def _two_slow_nodes(out: Path, args: dict) -> tuple[list[str], list[int], list]:
    return _run_two_nodes(out, "2", "slow_prepare", json.dumps(args))


def test_missing_node_ends_the_rendezvous() -> None:
    port = _free_port()
    with pytest.raises(DistributedError, match=f"could not form the group at 127.0.0.1:{port}"):
        launch(workers.report, {}, parse_device("cpu"), nnodes=2, master_port=port, start_timeout=2)


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(entry))
    return pids


def test_ctrl_c_stops_every_worker(tmp_path: Path) -> None:
    pidfile = str(tmp_path / "pid")
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, "sleep", pidfile],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not all(Path(f"{pidfile}.{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-2000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C: the whole foreground group
        log = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, log[-2000:]
    assert "interrupted" in log
    deadline = time.monotonic() + 30  # the multiprocessing helpers exit once their parent is gone
    while _session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _session_pids(proc.pid) == []
