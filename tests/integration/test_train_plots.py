"""A training run's last validation leaves what ``detrain val`` leaves: the PR/F1/P/R curves, both confusion
matrices, the val_batch label and prediction pictures, labels.jpg of the training labels, and the per-class table
on the terminal (printed by rank 0 alone); plots=false draws none of them. ``Model.train()``'s metrics carry the
confusion matrix and the curves.

The runs are tiny (16 training images of 64 px, scale n, workers=0, 2 epochs): one on two gloo workers through the
real ``detrain`` command, one in this process.
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _processes import child_env, one_thread  # noqa: F401 (a fixture)

from detrain import Model
from detrain.data.synthetic import generate_shapes

REPO = Path(__file__).resolve().parents[2]
NAMES = ("circle", "rectangle", "triangle")
VAL_PICTURES = (
    "PR_curve.png",
    "F1_curve.png",
    "P_curve.png",
    "R_curve.png",
    "confusion_matrix.png",
    "confusion_matrix_normalized.png",
    "val_batch0_labels.jpg",  # rank 0's first batch: 8 val images in batches of 4, one to each rank
    "val_batch0_pred.jpg",
)
TABLE_HEAD = re.compile(r"^class +images +instances +P +R +mAP50 +mAP50-95$", re.M)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = generate_shapes(tmp_path_factory.mktemp("shapes"), n_train=16, n_val=8, imgsz=64, seed=0)
    return root / "data.yaml"


def _val_instances(data: Path) -> int:
    return sum(len(f.read_text().split("\n")) - 1 for f in (data.parent / "labels" / "val").glob("*.txt"))


def _last_row(run: Path) -> dict[str, str]:
    return list(csv.DictReader(open(run / "results.csv")))[-1]


def test_two_workers_leave_the_last_validations_pictures_and_table(shapes: Path, tmp_path: Path) -> None:
    args = dict(data=shapes, model="n.yaml", epochs=2, imgsz=64, batch=4, device="cpu,cpu", workers=0, close_mosaic=0)
    cmd = [sys.executable, "-m", "detrain.cli", "train", *(f"{k}={v}" for k, v in args.items())]
    cmd += [f"project={tmp_path}", "name=run"]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "run"
    for name in (*VAL_PICTURES, "labels.jpg", "results.png"):
        assert (run / name).stat().st_size > 0, name
    out = proc.stdout
    assert len(TABLE_HEAD.findall(out)) == 1, out  # once, at the end, from rank 0 only
    table = out[TABLE_HEAD.search(out).end() :]
    last = _last_row(run)
    # the "all" row is the last validation's: results.csv's last row, to the table's 3 decimals
    p, r, map50, map_ = (f"{float(last[f'metrics/{k}']):.3f}" for k in ("precision", "recall", "mAP50", "mAP50-95"))
    all_row = rf"^all +8 +{_val_instances(shapes)} +{p} +{r} +{map50} +{map_}$"
    assert re.search(all_row, table, re.M), (all_row, table)
    for name in NAMES:  # one row per class: images, instances, P, R, mAP50, mAP50-95
        assert re.search(rf"^{name} +\d+ +\d+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+$", table, re.M), table


@pytest.mark.usefixtures("one_thread")
def test_plots_false_draws_nothing_and_the_metrics_carry_the_confusion_matrix(
    shapes: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = Model("n.yaml").train(
        data=str(shapes), epochs=1, imgsz=64, batch=8, device="cpu", workers=0, plots=False, project=str(tmp_path)
    )
    run = Path(metrics.save_dir)
    assert sorted(p.name for p in run.iterdir() if p.suffix in (".png", ".jpg")) == []
    assert len(TABLE_HEAD.findall(capsys.readouterr().out)) == 1  # the table is printed all the same
    counts = metrics.confusion_matrix.matrix
    assert counts.shape == (4, 4) and counts.dtype == np.int64
    assert counts[:, :3].sum() == _val_instances(shapes)  # every ground-truth box is in one column of its class
    assert metrics.curves == [
        "Precision-Recall(B)",
        "F1-Confidence(B)",
        "Precision-Confidence(B)",
        "Recall-Confidence(B)",
    ]
    for x, y, _, _ in metrics.curves_results:
        assert y.shape == (len(metrics.box.ap_class_index), len(x))
