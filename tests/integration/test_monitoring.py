"""Monitoring across nodes: each epoch's results.csv row and TensorBoard carry every node's CPU and memory, the
slowest rank and its share of data wait; stragglers are flagged with their cause.

A real 2-node gloo run on 127.0.0.1 (one CPU worker per node, 16 images of 64 px, one epoch) with rank 1's loader
slowed down by a test helper (``_observe_workers.py``) shows rank 1 as the slowest, waiting for data. Resource
readings are checked against work whose cost is known (CPU time a child process measured itself, bytes it holds),
never against the clock.
"""

from __future__ import annotations

import csv
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
from _processes import RUN_SECRET, one_thread, run_together  # noqa: F401 (a fixture)
from torch import nn

from detrain.config.cfg import make_cfg
from detrain.data.synthetic import generate_shapes
from detrain.distributed.world_layout import number_nodes
from detrain.engine.telemetry import epoch_stats
from detrain.engine.telemetry.proc_usage import ProcessUsage, child_pids, cpu_ticks, rss_bytes
from detrain.engine.telemetry.step_clock import StepClock
from detrain.system.procfs import status_value

REPO = Path(__file__).resolve().parents[2]
HELPER = Path(__file__).resolve().parents[1] / "_observe_workers.py"
LIMIT_S = 300  # a 2-node run that has not ended by then hangs (~20 s on an idle 2-core machine)
SLEEP_S = 2.0  # rank 1's loader: this long per batch


pytestmark = pytest.mark.usefixtures("one_thread")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "GROUP_RANK",
            "TORCHELASTIC_RESTART_COUNT",
        )
        and not k.startswith("SLURM_")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env["DETRAIN_RUN_SECRET"] = RUN_SECRET  # the nodes of one run share its secret
    return env


def _rows(run: Path) -> list[dict[str, str]]:
    with open(run / "results.csv") as f:
        return list(csv.DictReader(f))


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ two nodes, rank 1 waits for its data


def test_two_nodes_row_shows_each_node_and_the_slow_rank_waiting_for_data(tmp_path: Path) -> None:
    data = generate_shapes(tmp_path / "shapes", n_train=16, n_val=2, imgsz=64, seed=0) / "data.yaml"
    run = tmp_path / "runs" / "run"
    port = _free_port()
    cfg = make_cfg(
        {
            "data": str(data),
            "epochs": 1,
            "imgsz": 64,
            "batch": 8,
            "workers": 0,
            "warmup_epochs": 0,
            "close_mosaic": 0,
            "val": False,
            "plots": False,
            "verbose": False,
            "device": "cpu",
            "nnodes": 2,
            "master_addr": "127.0.0.1",
            "master_port": port,
            "project": str(tmp_path / "runs"),
            "name": "run",
            "exist_ok": True,
        }
    )
    args = json.dumps({"cfg": cfg.to_dict(), "save_dir": str(run), "slow_rank": 1, "sleep_s": SLEEP_S})
    ends = run_together(
        [[sys.executable, str(HELPER), "node", str(r), str(port), args] for r in (0, 1)], _env(), REPO, LIMIT_S
    )
    for r, (code, out) in enumerate(ends):
        assert code == 0, f"node {r} exit {code}\n{out[-3000:]}"
    outs = [out for _, out in ends]

    (row,) = _rows(run)
    for node in (0, 1):
        assert float(row[f"node{node}/cpu_pct"]) > 0, row
        assert float(row[f"node{node}/rss_gb"]) > 0.05, row  # a process that imported torch holds far more
    assert "node2/cpu_pct" not in row and "node0/gpu_mem_gb" not in row  # two nodes, no GPU
    assert row["slowest_rank"] == "1"
    assert 0 < float(row["data_wait_share_slowest_rank"]) <= 1
    header = (run / "results.csv").read_text().splitlines()[0].split(",")
    assert header[header.index("step_ms_slowest_rank") + 1 :] == [
        "slowest_rank",
        "data_wait_share_slowest_rank",
        "node0/cpu_pct",
        "node0/rss_gb",
        "node1/cpu_pct",
        "node1/rss_gb",
    ]

    events = _events(run)
    start = next(e for e in events if e["kind"] == "start")
    assert [(w["rank"], w["node"], w["device"]) for w in start["world"]] == [(0, 0, "cpu"), (1, 1, "cpu")]
    stragglers = [e for e in events if e["kind"] == "straggler"]
    assert [(e["rank"], e["node"], e["cause"], e["epoch"]) for e in stragglers] == [(1, 1, "data_wait", 1)]
    assert stragglers[0]["ms_per_step"] >= 1000 * SLEEP_S > stragglers[0]["others_median_ms"]
    assert events[-1]["kind"] == "end" and events[-1]["status"] == "completed"
    assert "straggler: rank 1 (node 1" in outs[0]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["run"]  # one folder, rank 0's


# ------------------------------------------------------------------ TensorBoard


def test_tensorboard_holds_each_epoch_row(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from detrain import Model

    data = generate_shapes(tmp_path / "shapes", n_train=8, n_val=2, imgsz=64, seed=0) / "data.yaml"
    result = Model("n.yaml").train(
        data=str(data),
        epochs=2,
        imgsz=64,
        batch=8,
        device="cpu",
        workers=0,
        close_mosaic=0,
        val=False,
        plots=False,
        verbose=False,
        tensorboard=True,
        project=str(tmp_path / "runs"),
        name="run",
        exist_ok=True,
    )
    run = Path(result.save_dir)
    acc = EventAccumulator(str(run))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    rows = _rows(run)
    expected = [k for k in rows[0] if k != "epoch"]
    assert {
        "train/box_loss",
        "images_per_s",
        "slowest_rank",
        "data_wait_share_slowest_rank",
        "node0/cpu_pct",
        "node0/rss_gb",
    } <= set(expected)
    assert set(expected) <= tags
    for key in expected:
        logged = {e.step: e.value for e in acc.Scalars(key)}
        written = {int(r["epoch"]): float(r[key]) for r in rows if r[key] != ""}  # val=False: metrics at the end
        assert logged.keys() == written.keys(), key
        for step, value in written.items():
            assert logged[step] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, step)
    assert {e.step for e in acc.Scalars("node0/rss_gb")} == {1, 2}


# ------------------------------------------------------------------ the world's columns and stragglers


def _stat(rank: int, node: int, **kw: float) -> dict:
    base = {
        "rank": rank,
        "node": node,
        "host": f"h{node}",
        "images": 8,
        "epoch_s": 2.0,
        "step_s": 0.2,
        "wait_s": 0.01,
        "forward_s": 0.05,
        "cpu_pct": 100.0,
        "rss_bytes": 1_000_000_000,
        "gpu_mem_bytes": None,
        "gpu_util_pct": None,
    }
    return base | kw


def test_columns_sum_cpu_and_memory_per_node_and_take_the_busiest_gpu() -> None:
    stats = [
        _stat(0, 0, gpu_mem_bytes=3e9, gpu_util_pct=80.0),
        _stat(1, 0, gpu_mem_bytes=5e9, gpu_util_pct=60.0),
        _stat(2, 1, gpu_mem_bytes=4e9, gpu_util_pct=None, forward_s=0.09, epoch_s=4.0),
        _stat(3, 1, gpu_mem_bytes=4e9, gpu_util_pct=None),
    ]
    cols = epoch_stats.columns(stats)
    assert cols["images_per_s"] == pytest.approx(32 / 4.0)
    assert cols["node0/cpu_pct"] == 200.0 and cols["node0/rss_gb"] == 2.0
    assert cols["node0/gpu_mem_gb"] == 5.0 and cols["node0/gpu_util_pct"] == 70.0
    assert cols["node1/gpu_mem_gb"] == 4.0 and "node1/gpu_util_pct" not in cols  # no NVML there
    assert cols["slowest_rank"] == 2  # the largest own time per step: 0.01 + 0.09
    assert cols["data_wait_share_slowest_rank"] == pytest.approx(0.01 / 0.21)


def test_a_rank_slow_to_compute_is_flagged_and_equal_ranks_are_not() -> None:
    even = [_stat(r, r // 2) for r in range(4)]
    assert epoch_stats.stragglers(even) == []
    assert epoch_stats.stragglers(even[:1]) == []  # one rank: nobody to compare with
    slow = even[:3] + [_stat(3, 1, forward_s=0.3)]
    (flag,) = epoch_stats.stragglers(slow)
    assert (flag["rank"], flag["node"], flag["host"], flag["cause"]) == (3, 1, "h1", "compute")
    assert (flag["ms_per_step"], flag["others_median_ms"]) == (300.0, 50.0)
    # twice the others, but a tiny share of a step (1 ms of 210): noise, not a straggler
    assert epoch_stats.stragglers(even[:3] + [_stat(3, 1, wait_s=0.002, step_s=0.2)]) == []


def test_nodes_are_numbered_by_launcher_group_else_by_host() -> None:
    places = [
        {"rank": 0, "node_key": "1", "host": "a"},
        {"rank": 1, "node_key": "0", "host": "a"},
        {"rank": 2, "node_key": "1", "host": "a"},
    ]
    assert [p["node"] for p in number_nodes(places)] == [0, 1, 0]
    by_host = [
        {"rank": 0, "node_key": None, "host": "b"},
        {"rank": 1, "node_key": None, "host": "a"},
        {"rank": 2, "node_key": None, "host": "b"},
    ]
    assert [p["node"] for p in number_nodes(by_host)] == [0, 1, 0]
    assert all("node_key" not in p for p in number_nodes(by_host))


# ------------------------------------------------------------------ this process's usage, from /proc

_linux = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc")


def _burn_then_hold(cpu_s: float, hold_bytes: int, ready, release) -> None:
    held = bytearray(hold_bytes)
    for i in range(0, hold_bytes, 4096):  # touch every page: resident, not just reserved
        held[i] = 1
    start = time.process_time()
    while time.process_time() - start < cpu_s:
        pass
    ready.set()
    release.wait(60)


@_linux
def test_usage_counts_the_cpu_time_and_memory_of_live_children() -> None:
    ctx = mp.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    usage = ProcessUsage()
    usage.sample()
    child = ctx.Process(target=_burn_then_hold, args=(0.3, 64 << 20, ready, release))
    child.start()
    try:
        assert ready.wait(60)
        assert str(child.pid) in child_pids()
        after = usage.sample()
        own = rss_bytes(str(os.getpid()))  # this process alone, at the same moment
    finally:
        release.set()
        child.join(60)
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert after.cpu_s >= 0.3 - 2 * tick  # what the child measured itself, at the kernel's tick resolution
    # the children's part of the total holds the child's 64 MiB. Not the total's growth since a sample before the
    # child: other children of this process (a tracker's service left by an earlier test in this worker) may end
    # or shrink in between, and this process's own memory moves too
    assert own is not None and after.rss_bytes - own >= (64 << 20) * 0.9


def _hold(ready, release) -> None:
    ready.set()
    release.wait(60)


@_linux
@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").is_file(), reason="no smaps_rollup (Linux < 4.14)")
def test_pages_a_forked_worker_shares_with_its_parent_count_once() -> None:
    """A loader worker forked from the training process maps its pages: their sum of RSS would count a 64 MB buffer
    twice (nine times with eight workers on a GPU machine), their PSS once."""
    n = 64 << 20
    held = bytearray(b"\x01") * n  # written: resident, not zero pages
    ctx = mp.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    usage = ProcessUsage()
    before = usage.sample().rss_bytes
    child = ctx.Process(target=_hold, args=(ready, release))
    child.start()
    try:
        assert ready.wait(60)
        after = usage.sample().rss_bytes
        child_rss = int(status_value(child.pid, "VmRSS")) * 1024
    finally:
        release.set()
        child.join(60)
    assert child_rss >= 0.9 * n  # the kernel shows the buffer resident in the child too
    assert after - before < 0.25 * n, (before, after)  # yet the sum counts it once
    assert held[-1] == 1


def test_proc_files_that_lie_are_read_as_unknown(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "7").mkdir(parents=True)
    (proc / "7" / "stat").write_text("7 (a) b) (c) S 1 2 3 4 5 6 7 8 9 10 11 12 13\n")  # ")" in the name
    (proc / "7" / "status").write_text("Name:\tx\nVmRSS:\t  2048 kB\n")
    assert cpu_ticks("7", proc) == 11 + 12 and rss_bytes("7", proc) == 2048 * 1024  # no smaps_rollup: VmRSS
    (proc / "7" / "smaps_rollup").write_text("00-ff ---p 0 00:00 0 [rollup]\nRss:\t2048 kB\nPss:\t512 kB\n")
    assert rss_bytes("7", proc) == 512 * 1024
    (proc / "8").mkdir()
    (proc / "8" / "stat").write_text("8 (x) S 1 2\n")  # too short
    (proc / "8" / "status").write_text("VmRSS:\tlots kB\n")
    assert cpu_ticks("8", proc) is None and rss_bytes("8", proc) is None
    (proc / "9").mkdir()
    (proc / "9" / "stat").write_bytes(b"\xff\xfe (\x00) S" + b" x" * 20)
    assert cpu_ticks("9", proc) is None and cpu_ticks("10", proc) is None and rss_bytes("10", proc) is None
    assert child_pids(proc) == []  # no task folder: no children rather than an error


# ------------------------------------------------------------------ what a step waits for


class _Sleepy(nn.Module):
    def __init__(self, sleep_s: float) -> None:
        super().__init__()
        self.sleep_s = sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.sleep_s)
        return x


def _slow_batches(n: int, sleep_s: float):
    for _ in range(n):
        time.sleep(sleep_s)
        yield torch.zeros(1)


def test_step_clock_times_the_wait_for_data_and_the_forward_apart() -> None:
    model = _Sleepy(0.05)
    clock = StepClock(model, torch.device("cpu"))
    for batch in clock.timed(_slow_batches(3, 0.1)):
        model(batch)
        time.sleep(0.05)  # the rest of the step (backward, update): neither wait nor forward
    wait_s, forward_s = clock.epoch_means()
    assert wait_s >= 0.1 and forward_s >= 0.05  # lower bounds: what was slept, never less
    assert len(clock.waits) == len(clock.forwards) == 3
    clock.close()
    model(torch.zeros(1))
    assert len(clock.forwards) == 3  # the hooks are gone
    assert clock.epoch_means() == (wait_s, forward_s)


def test_results_png_leaves_the_per_node_columns_to_tensorboard(tmp_path: Path, monkeypatch) -> None:
    from matplotlib.axes import Axes

    from detrain.plots.val import plot_results_csv

    titles: list[str] = []
    real = Axes.set_title
    monkeypatch.setattr(
        Axes, "set_title", lambda self, label, *a, **k: (titles.append(label), real(self, label, *a, **k))[1]
    )
    path = tmp_path / "results.csv"
    path.write_text(
        "epoch,train/box_loss,slowest_rank,node0/cpu_pct,node0/rss_gb,node12/gpu_mem_gb,nodes/x\n1,1.5,1,99,2.5,3.1,7\n"
    )
    assert plot_results_csv(path).is_file()
    assert titles == ["train/box_loss", "slowest_rank", "nodes/x"]
