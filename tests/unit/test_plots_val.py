"""Validation plots are written as real PNG files, also for empty results."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from detrain.metrics import ConfusionMatrix, coco_summary, match_image
from detrain.plots.val import plot_all, plot_confidence_curve, plot_confusion_matrix, plot_results_csv

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 1000


def some_metrics():
    rng = np.random.default_rng(0)
    stats = []
    for i in range(4):
        gt = rng.uniform(0, 200, (5, 2))
        gt_xyxy = np.concatenate((gt, gt + rng.uniform(10, 80, (5, 2))), 1)
        det = gt_xyxy + rng.normal(0, 3, gt_xyxy.shape)
        stats.append(match_image(det, rng.random(5), rng.integers(0, 3, 5), gt_xyxy, rng.integers(0, 3, 5), image_id=i))
    return coco_summary(stats, nc=3)


def test_all_validation_plots(tmp_path: Path) -> None:
    cm = ConfusionMatrix(nc=3)
    cm.update(np.array([[0, 0, 10, 10, 0.9, 1]]), np.array([[0, 0, 10, 10]]), np.array([2]))
    paths = plot_all(tmp_path / "val", some_metrics(), cm, ["a", "b", "c"])
    assert [p.name for p in paths] == [
        "PR_curve.png",
        "F1_curve.png",
        "P_curve.png",
        "R_curve.png",
        "confusion_matrix.png",
        "confusion_matrix_normalized.png",
    ]
    assert all(is_png(p) for p in paths)


def test_plots_of_empty_results(tmp_path: Path) -> None:
    paths = plot_all(tmp_path, coco_summary([], nc=2), ConfusionMatrix(nc=2).matrix, {0: "a", 1: "b"})
    assert all(is_png(p) for p in paths)
    with pytest.raises(ValueError, match="which"):
        plot_confidence_curve(coco_summary([], nc=2), [], tmp_path / "x.png", "g1")


def test_confusion_matrix_of_many_classes(tmp_path: Path) -> None:
    counts = np.random.default_rng(1).integers(0, 5, (46, 46))
    assert is_png(plot_confusion_matrix(counts, [], tmp_path / "cm.png"))


def test_results_png(tmp_path: Path) -> None:
    csv_path = tmp_path / "results.csv"
    csv_path.write_text(
        "epoch, train/box_loss, metrics/mAP50(B), lr/pg0\n1, 1.5, 0.1, 0.01\n2, 1.2, 0.2, 0.009\n3, nan, 0.25, 0.008\n"
    )
    out = plot_results_csv(csv_path)
    assert out == tmp_path / "results.png" and is_png(out)
    empty = tmp_path / "empty.csv"
    empty.write_text("epoch,loss\n")
    assert is_png(plot_results_csv(empty, tmp_path / "empty.png"))
