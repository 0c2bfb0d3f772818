"""Non-finite losses for real: ``tests/_inject``'s ``TEST_NONFINITE`` rule makes chosen batches' losses NaN on one
of two gloo workers (the NaN goes through backward and DDP's gradient all-reduce). Both ranks skip that same update
(their parameters and EMA unchanged by it, and equal between the ranks), it is counted in results.csv and
events.jsonl and no NaN reaches last.pt or best.pt; ``nonfinite_limit`` updates in a row stop the run with one line,
exit code 2. Also a damaged last.pt: resume falls back to last.prev.pt."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _faults import INJECT
from _processes import REPO, child_env

from detrain.data.synthetic import generate_shapes
from detrain.weights.checkpoint import load_checkpoint

pytestmark = pytest.mark.integration

ARGS = dict(
    model="n.yaml",
    imgsz=64,
    batch=4,
    nbs=4,
    workers=0,
    close_mosaic=0,
    warmup_epochs=0,
    optimizer="SGD",
    val=False,
    plots=False,
    verbose=False,
    seed=0,
    epochs=2,
    name="run",
)
LIMIT_S = 240.0


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = generate_shapes(tmp_path_factory.mktemp("nonfinite") / "shapes", n_train=16, n_val=2, imgsz=64, seed=0)
    return root / "data.yaml"


def _train(args: dict, rule: dict | None = None) -> subprocess.CompletedProcess:
    env = child_env()
    if rule is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(INJECT), env["PYTHONPATH"]])
        env["TEST_NONFINITE"] = json.dumps(rule)
    cmd = [sys.executable, "-m", "detrain.cli", "train", *(f"{k}={v}" for k, v in args.items())]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LIMIT_S, cwd=REPO)


def _dump(folder: Path, rank: int) -> dict[int, dict]:
    lines = (folder / f"rank{rank}.jsonl").read_text().splitlines()
    return {d["step"]: d for d in map(json.loads, lines)}


def test_a_nan_on_one_rank_skips_that_update_on_both(data: Path, tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    dump.mkdir()
    # two workers of 2 images, 4 batches an epoch, an update every batch; rank 1's loss is NaN at batch 2 of epoch 2
    args = {**ARGS, "data": data, "project": tmp_path, "device": "cpu,cpu"}
    done = _train(args, {"rank": 1, "at": [5], "dump": str(dump)})
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [_dump(dump, 0), _dump(dump, 1)]
    assert ranks[1][5]["nan"] and not ranks[0][5]["nan"]
    for r in ranks:
        assert r[5]["before"] == r[5]["after"], "the NaN step changed the parameters or the EMA"
        assert r[5]["ema"] == r[4]["ema"]  # no EMA update
        assert r[4]["before"] != r[4]["after"] and r[6]["before"] != r[6]["after"]  # the updates around it ran
    assert ranks[0][5]["after"] == ranks[1][5]["after"] and ranks[0][7]["after"] == ranks[1][7]["after"]
    run = tmp_path / "run"
    with open(run / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["nonfinite_skipped"] for row in rows] == ["0", "1"]
    assert all(math.isfinite(float(row["train/box_loss"])) for row in rows)  # the NaN batch is not in the mean
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    skipped = [e for e in events if e["kind"] == "nonfinite"]
    assert [(e["epoch"], e["batch"], e["what"], e["ranks"]) for e in skipped] == [(2, 2, "loss", 1)]
    assert "non-finite loss on 1 rank(s) at epoch 2, batch 2/4: update skipped" in done.stdout
    for name in ("last.pt", "best.pt"):
        load_checkpoint(run / "weights" / name)  # refuses non-finite weights


def test_a_nan_in_the_forward_leaves_no_trace_in_batchnorm_on_any_rank(data: Path, tmp_path: Path) -> None:
    """The NaN enters rank 0's model input at batch 2 of epoch 2: every BatchNorm layer's running statistics take
    it in the forward, before the loss is seen. The skip puts them back on every rank (rank 0's would reach rank 1
    with the next forward's buffer broadcast), the weights stay, and the run saves finite checkpoints to its end."""
    dump = tmp_path / "dump"
    dump.mkdir()
    args = {**ARGS, "data": data, "project": tmp_path, "device": "cpu,cpu"}
    done = _train(args, {"rank": 0, "at": [5], "in": "forward", "dump": str(dump)})
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [_dump(dump, 0), _dump(dump, 1)]
    assert ranks[0][5]["nan"] and not ranks[1][5]["nan"]
    for r in ranks:
        assert r[5]["before"] == r[5]["after"], "the NaN step changed the parameters or the EMA"
        assert r[5]["buffers_before"] == r[5]["buffers_after"], "the NaN step left BatchNorm statistics behind"
        assert r[4]["buffers_before"] != r[4]["buffers_after"]  # a finite forward moves them, as it should
        assert r[6]["before"] != r[6]["after"]  # training goes on
    # both ranks' losses: the loss's normaliser (target scores summed over the ranks) carries rank 0's NaN
    assert "non-finite loss on 2 rank(s) at epoch 2, batch 2/4: update skipped" in done.stdout
    for name in ("last.pt", "best.pt"):
        load_checkpoint(tmp_path / "run" / "weights" / name)  # refuses non-finite weights and buffers


def test_nonfinite_limit_in_a_row_stops_every_rank(data: Path, tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    dump.mkdir()
    args = {**ARGS, "data": data, "project": tmp_path, "device": "cpu,cpu", "nonfinite_limit": 2}
    done = _train(args, {"rank": 1, "from": 5, "dump": str(dump)})
    assert done.returncode == 2, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: worker rank ")
    assert "2 updates in a row had a non-finite loss (nonfinite_limit=2), the last at epoch 2, batch 3/4" in line
    assert max(_dump(dump, 0)) == max(_dump(dump, 1)) == 6  # both ranks stopped at that step
    load_checkpoint(tmp_path / "run" / "weights" / "last.pt")  # epoch 1's, finite


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:  # flip bytes in the middle of the zip
        for k in range(len(data) // 2, len(data) // 2 + 64):
            data[k] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip"])  # a truncated last.pt: tests/unit/test_nonfinite.py (CI time)
def test_a_damaged_last_pt_resumes_from_the_generation_before(data: Path, tmp_path: Path, how: str) -> None:
    args = {**ARGS, "data": data, "project": tmp_path, "device": "cpu", "epochs": 2}
    assert _train(args).returncode == 0
    weights = tmp_path / "run" / "weights"
    assert load_checkpoint(weights / "last.prev.pt")["epoch"] == 0  # epoch 1's last.pt, kept
    _damage(weights / "last.pt", how)
    done = _train({**args, "resume": weights / "last.pt"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming from {weights / 'last.prev.pt'} at epoch 2" in done.stdout
    assert "epoch 2/2" in done.stdout and "epoch 1/2" not in done.stdout
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    fell = [e for e in events if e["kind"] == "checkpoint_fallback"]
    assert len(fell) == 1 and fell[0]["damaged"].endswith("last.pt") and fell[0]["instead"].endswith("last.prev.pt")
    assert load_checkpoint(weights / "last.pt")["epoch"] == 1
    assert load_checkpoint(weights / "last.prev.pt")["epoch"] == 0  # the damaged file did not become the generation
    _damage(weights / "last.pt", how)
    _damage(weights / "last.prev.pt", how)
    both = _train({**args, "resume": weights / "last.pt"})
    assert both.returncode == 2
    line = both.stderr.strip().splitlines()[-1]  # last.pt's own reason, as without a generation
    assert line.startswith("error: ") and f"{weights / 'last.pt'}:" in line and "Traceback" not in both.stderr
