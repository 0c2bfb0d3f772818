"""A YOLO11 model trains and validates through the same loop as YOLOv8 (same loss, DFL and NMS), and what it saves
rebuilds as YOLO11."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _processes import one_thread  # noqa: F401 (a fixture)

from detrain import Model
from detrain.data.synthetic import generate_shapes
from detrain.weights.checkpoint import load_checkpoint, model_from_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def test_yolo11n_trains_one_epoch_and_validates(tmp_path: Path) -> None:
    root = generate_shapes(tmp_path / "shapes", n_train=16, n_val=4, imgsz=64, seed=0)
    result = Model("yolo11n.yaml").train(
        data=str(root / "data.yaml"),
        epochs=1,
        imgsz=64,
        batch=8,
        nbs=16,
        device="cpu",
        workers=0,
        warmup_epochs=0,
        close_mosaic=0,
        optimizer="SGD",
        plots=False,
        verbose=False,
        project=str(tmp_path),
        name="run",
        exist_ok=True,
    )
    assert result is not None
    run = Path(result.save_dir)
    rows = (run / "results.csv").read_text().splitlines()
    assert len(rows) == 2 and "metrics/mAP50-95" in rows[0].split(",")  # one epoch, validated
    best = run / "weights" / "best.pt"
    ckpt = load_checkpoint(best)
    assert ckpt["model"]["yaml"]["backbone"][10][2] == "C2PSA" and ckpt["model"]["nc"] == 3
    net = model_from_checkpoint(ckpt)
    assert net.family == "yolo11" and net.head.depthwise_cls and net.imgsz == 64
    assert "model.10.m.0.attn.qkv.conv.weight" in ckpt["ema"]["state_dict"]
    assert all(torch.isfinite(v).all() for v in ckpt["ema"]["state_dict"].values() if v.is_floating_point())
    metrics = Model(str(best)).val(
        data=str(root / "data.yaml"), imgsz=64, batch=4, device="cpu", plots=False, project=str(tmp_path)
    )
    assert metrics is not None and 0.0 <= metrics.box.map <= metrics.box.map50 <= 1.0
