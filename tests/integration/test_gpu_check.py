"""scripts/gpu_check.py: its CPU-safe checks as a real command (rows, figures, skipped GPU checks and one table),
the one-rank group's worker on gloo, and the Ultralytics side-by-side step on a CPU (tests/unit/test_gpu_check_rows.py
has the table and the comparison).

The command's resume check on a CPU is two gloo workers, rank 0 SIGKILLed right after mid.pt at batch 2 of epoch 2
and restarted by the launcher, against the same run uninterrupted: the runs that
tests/integration/test_resume_every_node.py trained for itself until the two were found to be the same (16 images
at 64 px, batch 4, nbs 4, SGD, seed 0). They are trained once, here, and the product's stronger claims (bitwise
model and EMA, the restart that resumed from mid.pt) are read from the folders the command leaves.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _processes import REPO, child_env
from _scripts import load_script
from _ultralytics import offline_ultralytics

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
GPU_ONLY = ("fp16", "nccl-one-rank", "nccl-watchdog", "ultralytics-step", "compile")


gc = load_script("gpu_check")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    """``gpu_check.py --cpu`` run once: (the process, its JSON report, its work folder)."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    out, work = tmp / "rows.json", tmp / "work"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--json", str(out), "--work", str(work)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text()), work


def test_cpu_run_proves_the_cpu_paths_and_skips_the_gpu_ones(cpu_run) -> None:
    proc, report, _ = cpu_run
    rows = {r["check"]: r for r in report["rows"]}
    assert report["cuda"] is False and list(rows) == [name for name, _ in gc.CHECKS]
    for name in ("versions", "train", "resume"):
        assert rows[name]["status"] == "ok", rows[name]
    assert rows["versions"]["figures"]["torch"] == torch.__version__
    train = rows["train"]["figures"]
    assert train["images_per_s"] > 0 and 0 <= train["data_wait_share"] <= 1 and train["losses_finite"] is True
    assert 0 <= train["mAP50-95"] <= 1
    resume = rows["resume"]["figures"]
    assert resume["ranks"] == 2 and resume["max_abs_diff"] <= gc.CPU_FLOOR and resume["run_to_run"] == 0
    for name in GPU_ONLY:
        assert rows[name]["status"] == "skipped" and rows[name]["result"].startswith("no CUDA"), rows[name]
    # one table at the end: a header and a line per check
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(gc.CHECKS) and table[0].startswith("| check | status |")


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_two_workers_restarted_mid_epoch_resume_at_the_step_with_the_uninterrupted_weights(cpu_run) -> None:
    """mid.pt is saved after every step (save_interval of a few nanoseconds); rank 0 is killed after the one of
    batch 2 of epoch 2, the launcher restarts both, and they go on from batch 3 to the weights (model and EMA, with
    each rank's own BatchNorm statistics) of a run that never saved mid.pt nor stopped. (Moved here from
    tests/integration/test_resume_every_node.py, whose runs were the command's resume check's.)"""
    _, _, work = cpu_run
    args = gc._resume_args(gc.Context(work=work, cuda=False, gpus=0), "cpu,cpu")
    assert (args["epochs"], args["batch"], args["nbs"], args["device"]) == (2, 4, 4, "cpu,cpu")
    straight, run = work / "resume-straight0" / "run", work / "resume-killed" / "run"
    one, two = _load(straight / "weights" / "last.pt"), _load(run / "weights" / "last.pt")
    for key in ("model", "ema"):
        assert one[key]["state_dict"].keys() == two[key]["state_dict"].keys()
        for name, tensor in one[key]["state_dict"].items():
            assert torch.equal(tensor, two[key]["state_dict"][name]), (key, name)
    assert one["ema"]["updates"] == two["ema"]["updates"] and one["last_update"] == two["last_update"]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    (restart,) = [e for e in events if e["kind"] == "restart"]
    assert restart["launcher_restart_count"] == 1 and restart["epoch"] == 2
    assert restart["resumed_from"] == str(run / "weights" / "mid.pt")
    with open(run / "results.csv") as f:
        assert [r["epoch"].strip() for r in csv.DictReader(f)] == ["1", "2"]
    assert not (run / "weights" / "mid.pt").exists()


def test_one_rank_group_runs_ddp_fsdp_and_every_collective_on_gloo() -> None:
    """The nccl-one-rank check's worker, on gloo (CPU: no SyncBatchNorm, as torch's is GPU-only, and no AMP), in a
    process of its own as the check runs it: the sharded model's device mesh keeps the group's store, which listens
    on every address, alive until its process ends (it would show in test_network's loopback check)."""
    code = (
        "import sys; sys.path.insert(0, 'tests'); from _scripts import load_script; "
        "gc = load_script('gpu_check'); gc.one_rank_group(gc._free_port(), 'gloo')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["backend"] == "gloo" and figures["ddp_steps"] == 3 and figures["collectives"] == 9
    assert figures["fsdp_steps"] == 3 and figures["fsdp_amp"] is None and figures["fsdp_tensors"] > 300


def test_ultralytics_step_side_by_side_in_fp32_on_cpu(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The ultralytics-step check's code on a CPU, in fp32 at 64 px (skipped where Ultralytics is absent)."""
    with offline_ultralytics(tmp_path_factory):
        figures = gc.step_side_by_side(torch.device("cpu"), {"fp32": None}, imgsz=64, batch=2, iters=1)
    assert figures["fp32_detrain_finite"] and figures["fp32_ultralytics_finite"]
    assert figures["fp32_detrain_ms"] > 0 and figures["fp32_ratio"] > 0


def test_compile_check_code_on_cpu_with_the_tracing_backend() -> None:
    """The compile check's code on a CPU, with aot_eager (inductor would compile for minutes)."""
    figures = gc.compile_vs_eager(torch.device("cpu"), None, imgsz=64, batch=2, mode="aot_eager", iters=1)
    assert figures["compiled_first_ms"] > figures["compiled_ms"] > 0 and figures["speedup"] > 0
