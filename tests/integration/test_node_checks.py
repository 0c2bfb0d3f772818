"""Nodes that differ are refused at start, and restarts that cannot help stop (issue 22 items 4 and 7), with real
processes: two launchers on 127.0.0.1 as two nodes, each with its own run folder and its own copy of the dataset
(:mod:`detrain.distributed.launch.node_consistency`), and a worker that fails at the same step on every attempt
(:mod:`detrain.distributed.launch.restart_policy`).

Every run is tiny (64 px, 16 images, scale n, workers=0, one thread per process); the time limits are hang guards,
never timed asserts.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from _faults import INJECT
from _processes import REPO, child_env, free_port

import detrain
from detrain.data.synthetic import generate_shapes

LIMIT_S = 120  # a refusal takes seconds; a launcher still running after this hangs

FAST = dict(
    imgsz=64,
    batch=8,
    workers=0,
    warmup_epochs=0,
    close_mosaic=0,
    val=False,
    plots=False,
    verbose=False,
    exist_ok=True,
    name="run",
)


def _cli(args: dict) -> list[str]:
    return [sys.executable, "-m", "detrain.cli", "train", *(f"{k}={v}" for k, v in args.items())]


def _shapes(where: Path) -> Path:
    return generate_shapes(where, n_train=16, n_val=2, imgsz=64, seed=0) / "data.yaml"


def _two_nodes(
    tmp_path: Path, data: tuple[Path, Path], envs: tuple[dict, dict], node1: dict | None = None
) -> list[tuple[int, str]]:
    """Node 0 and node 1 of one run, each with its own dataset, run folder and environment (``node1``: arguments
    node 1 adds to its command line): (exit code, output)."""
    port = free_port()
    procs = []
    for r in (0, 1):
        args = {**FAST, "data": data[r], "epochs": 1, "device": "cpu", "nnodes": 2, "node_rank": r, "run_id": "t"}
        args |= (node1 or {}) if r == 1 else {}
        args |= {"master_addr": "127.0.0.1", "master_port": port, "project": tmp_path / f"node{r}" / "runs"}
        out = open(tmp_path / f"node{r}.txt", "w")  # noqa: SIM115 - the child keeps it
        # not run in the checkout: python -m would import its detrain first, whatever PYTHONPATH says
        procs.append(subprocess.Popen(_cli(args), env=envs[r], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT))
        out.close()
    try:
        for p in procs:
            p.wait(timeout=LIMIT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, (tmp_path / f"node{r}.txt").read_text()) for r, p in enumerate(procs)]


def _last_line(out: str) -> str:
    lines = [line for line in out.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def test_a_node_whose_dataset_has_one_image_fewer_is_refused_on_both_nodes(tmp_path: Path) -> None:
    data0, data1 = _shapes(tmp_path / "data0"), _shapes(tmp_path / "data1")
    gone = sorted((data1.parent / "images" / "train").iterdir())[-1]
    gone.unlink()
    (data1.parent / "labels" / "train" / f"{gone.stem}.txt").unlink(missing_ok=True)
    ends = _two_nodes(tmp_path, (data0, data1), (child_env(), child_env()))
    host = socket.gethostname()
    for r, (code, out) in enumerate(ends):
        assert code == 2, f"node {r} exit {code}\n{out[-3000:]}"
        line = _last_line(out)
        assert line.startswith("error: "), out[-3000:]
        # "the run ended on node 0: ..." would be no worse, where node 0's word comes first
        assert (
            f"node_rank=1 (host {host}) differs from node 0 (host {host}): train images 15 there, 16 on node 0"
        ) in line, out[-3000:]
        assert out.count("error: ") == 1, out[-3000:]  # one line, and no traceback
    assert not list((tmp_path / "node0").rglob("last.pt"))  # refused before training


def test_a_node_started_with_other_arguments_is_refused_on_both_nodes(tmp_path: Path) -> None:
    """Node 1's command line says parallel=fsdp: its ranks would call other collectives than node 0's."""
    data = _shapes(tmp_path / "data0"), _shapes(tmp_path / "data1")
    ends = _two_nodes(tmp_path, data, (child_env(), child_env()), node1={"parallel": "fsdp"})
    host = socket.gethostname()
    for r, (code, out) in enumerate(ends):
        assert code == 2, f"node {r} exit {code}\n{out[-3000:]}"
        assert (
            f"node_rank=1 (host {host}) differs from node 0 (host {host}): parallel=fsdp there, parallel=ddp on node 0"
        ) in _last_line(out), out[-3000:]
    assert not list((tmp_path / "node0").rglob("last.pt"))  # refused before training


def test_a_node_with_other_code_and_version_is_refused_on_both_nodes(tmp_path: Path) -> None:
    """Node 1 runs a copy of the package whose version says 9.9.9: a real other install, no hook in detrain."""
    other = tmp_path / "other"
    shutil.copytree(REPO / "detrain", other / "detrain", ignore=shutil.ignore_patterns("__pycache__"))
    init = other / "detrain" / "__init__.py"
    init.write_text(init.read_text().replace(f'__version__ = "{detrain.__version__}"', '__version__ = "9.9.9"'))
    data = _shapes(tmp_path / "data")
    env1 = child_env(PYTHONPATH=str(other))
    ends = _two_nodes(tmp_path, (data, data), (child_env(), env1))
    for r, (code, out) in enumerate(ends):
        assert code == 2, f"node {r} exit {code}\n{out[-3000:]}"
        line = _last_line(out)
        assert line.startswith("error: ") and "node_rank=1 (host " in line, out[-3000:]
        assert f"detrain '9.9.9' there, '{detrain.__version__}' on node 0" in line, line


def test_a_failure_that_repeats_without_progress_stops_with_growing_waits(tmp_path: Path) -> None:
    """A worker that fails at epoch 2's save on every attempt: the first attempt saved epoch 1, the restart resumed
    there and failed the same way, so the third attempt stops the run with one line; max_restarts=3 is not used
    up, and the waits before the restarts doubled (0.5 s, then 1 s, as said in the log)."""
    data = _shapes(tmp_path / "data")
    args = {**FAST, "data": data, "epochs": 3, "device": "cpu,cpu", "max_restarts": 3, "restart_backoff": 0.5}
    args["project"] = tmp_path / "runs"
    env = child_env()
    env["PYTHONPATH"] = f"{INJECT}:{env['PYTHONPATH']}"
    env["TEST_FAULT"] = json.dumps({"after": "last.pt", "epoch": 1, "then": "raise", "every_attempt": True})
    proc = subprocess.run(_cli(args), env=env, cwd=REPO, capture_output=True, text=True, timeout=LIMIT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    last = _last_line(proc.stderr)
    assert last.startswith("error: the same failure repeated 2 times with no progress since epoch 2 batch 0: "), out
    assert "injected failure" in last, last
    waits = [line.split(" s before")[0] for line in out.splitlines() if " before the workers start again" in line]
    assert waits == ["restart 1: waiting 0.5", "restart 2: waiting 1"], out[-3000:]
