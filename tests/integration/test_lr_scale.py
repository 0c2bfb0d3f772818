"""A global batch of 256 with the learning rate following it (lr_scale=auto) learns more in the same epochs than
with lr0 as Ultralytics keeps it (lr_scale=none): the same data, seed and updates, only the rate differs.

Tiny on purpose (512 images of 32 px, 2 updates an epoch, 4 epochs): too short for any mAP, so the measure is the
training loss the run itself records. The full-size figures (mAP50-95 at batch 16 and 256) are in docs/learning.md
(scripts/bench_scaling.py)."""

from __future__ import annotations

import csv
from pathlib import Path

import cv2
import pytest
import torch
from _processes import one_thread  # noqa: F401 (a fixture)
from torch import nn

from detrain import Model
from detrain.data.synthetic import generate_shapes
from detrain.nn.model import DetectionModel
from detrain.weights.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
LOSSES = ("train/box_loss", "train/cls_loss", "train/dfl_loss")


def _losses(save_dir: str) -> list[float]:
    with open(Path(save_dir) / "results.csv") as f:
        rows = list(csv.DictReader(f))
    return [sum(float(row[k]) for k in LOSSES) for row in rows]


def test_a_batch_of_256_learns_more_with_the_scaled_rate(tmp_path: Path) -> None:
    root = generate_shapes(tmp_path / "shapes", n_train=512, n_val=2, imgsz=64, seed=0)
    data = root / "fit.yaml"
    data.write_text("path: .\ntrain: images/train\nval: images/train\nnames: [circle, rectangle, triangle]\n")
    common = dict(data=str(data), epochs=4, imgsz=32, batch=256, device="cpu", workers=0, warmup_epochs=1,
                  close_mosaic=0, val=False, plots=False, verbose=False, project=str(tmp_path / "runs"))  # fmt: skip
    loss = {
        scale: _losses(Model("n.yaml").train(**common, lr_scale=scale, name=scale).save_dir)
        for scale in ("none", "auto")
    }
    assert loss["none"][0] == pytest.approx(loss["auto"][0], rel=0.02)  # warmup's first epoch: hardly apart
    # AdamW (optimizer=auto) at 4 x lr0 (the square root of 256 / 16); at 2 x 4.32 against 4.73 was measured
    assert loss["auto"][-1] < loss["none"][-1] - 0.2, loss


def _stale(run: Path, images: list[Path]) -> float:
    """How far last.pt's BatchNorm running means are from its weights' own: the relative distance to the means
    recomputed over ``images`` (training-mode forward passes, every image counted alike)."""
    ckpt = load_checkpoint(run / "weights" / "last.pt")
    model = DetectionModel(ckpt["model"]["yaml"], nc=ckpt["model"]["nc"])
    model.load_state_dict(ckpt["model"]["state_dict"])
    saved = [m.running_mean.clone() for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None  # a cumulative average
    x = torch.stack([torch.from_numpy(cv2.resize(cv2.imread(str(p)), (32, 32))[:, :, ::-1].copy()) for p in images])
    with torch.no_grad():
        model.train()(x.permute(0, 3, 1, 2).float() / 255)
    fresh = [m.running_mean for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    return float(torch.cat([a - b for a, b in zip(saved, fresh)]).norm() / torch.cat(fresh).norm())


def test_a_batch_of_256_keeps_the_batchnorm_statistics_of_its_weights(tmp_path: Path) -> None:
    """The same training (AdamW at one rate: 2 x 0.001 scaled, the square root of 256 / 64 for a chosen AdamW, or
    0.002 given with lr_scale=none) with BatchNorm's
    momentum following the batch (0.386 for forward passes of 256 images) or at 0.03: the same losses to the bit
    (training-mode BatchNorm normalises with the batch's statistics), but at 0.03 the 6 updates leave the running
    statistics (what validation and the saved model normalise with) mostly at their start."""
    root = generate_shapes(tmp_path / "shapes", n_train=512, n_val=2, imgsz=64, seed=0)
    data = root / "fit.yaml"
    data.write_text("path: .\ntrain: images/train\nval: images/train\nnames: [circle, rectangle, triangle]\n")
    common = dict(data=str(data), epochs=3, imgsz=32, batch=256, device="cpu", workers=0, warmup_epochs=1,
                  close_mosaic=0, mosaic=0.0, val=False, plots=False, verbose=False, optimizer="AdamW",
                  project=str(tmp_path / "runs"))  # fmt: skip
    runs = {
        name: Path(Model("n.yaml").train(**common, **keys, name=name).save_dir)
        for name, keys in {"scaled": {"lr0": 0.001}, "none": {"lr0": 0.002, "lr_scale": "none"}}.items()
    }
    assert _losses(str(runs["scaled"])) == _losses(str(runs["none"]))
    images = sorted((root / "images" / "train").glob("*"))[:128]
    stale = {name: _stale(run, images) for name, run in runs.items()}
    assert stale["scaled"] < 0.5 * stale["none"], stale
