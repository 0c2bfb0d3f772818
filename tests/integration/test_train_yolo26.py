"""A YOLO26 model trains end to end through the same loop as YOLOv8 and YOLO11, by its own head's seam: the end-to-end
loss (box, cls, l1 items; the branch weights moving over the run), NMS-free validation and prediction, ``nms=true``,
and what it saves rebuilds as YOLO26."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from _processes import one_thread  # noqa: F401 (a fixture)

from detrain import Model
from detrain.data.synthetic import generate_shapes
from detrain.nn.loss_e2e import EndToEndLoss
from detrain.weights.checkpoint import load_checkpoint, model_from_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(
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
    exist_ok=True,
)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two epochs of yolo26n on 16 shapes (data yaml, run folder)."""
    tmp = tmp_path_factory.mktemp("yolo26")
    root = generate_shapes(tmp / "shapes", n_train=16, n_val=4, imgsz=64, seed=0)
    result = Model("yolo26n.yaml").train(data=str(root / "data.yaml"), epochs=2, project=str(tmp), name="run", **SMALL)
    assert result is not None
    return root / "data.yaml", Path(result["save_dir"])


def test_results_name_the_end_to_end_loss_items(run: tuple[Path, Path]) -> None:
    _, save_dir = run
    with open(save_dir / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["1", "2"]
    assert {"train/box_loss", "train/cls_loss", "train/l1_loss"} <= rows[0].keys()
    assert "train/dfl_loss" not in rows[0]
    assert all(float(r["train/l1_loss"]) > 0 for r in rows) and "metrics/mAP50-95" in rows[0]


def test_the_checkpoint_rebuilds_yolo26_with_finite_weights(run: tuple[Path, Path]) -> None:
    _, save_dir = run
    ckpt = load_checkpoint(save_dir / "weights" / "best.pt")
    assert ckpt["model"]["yaml"]["end2end"] and ckpt["model"]["nc"] == 3
    net = model_from_checkpoint(ckpt)
    assert net.family == "yolo26" and net.reg_max == 1 and net.loss_names[-1] == "l1_loss"
    state = ckpt["ema"]["state_dict"]
    assert any(k.startswith("model.23.one2one_cv3.") for k in state)
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_the_branch_weights_follow_the_planned_epochs() -> None:
    """What the trainer builds for a 2-epoch run: (0.8, 0.2) in the first epoch, (0.1, 0.9) in the last."""
    from detrain.nn.head import LossGains
    from detrain.nn.model import DetectionModel

    criterion = DetectionModel("yolo26n.yaml", nc=3).criterion(LossGains(), epochs=2)
    assert isinstance(criterion, EndToEndLoss)
    criterion.set_epoch(0)
    first = criterion.weights
    criterion.set_epoch(1)
    assert first == pytest.approx((0.8, 0.2)) and criterion.weights == pytest.approx((0.1, 0.9))


def test_val_and_predict_are_nms_free_and_nms_true_uses_the_other_branch(
    run: tuple[Path, Path], tmp_path: Path
) -> None:
    data, save_dir = run
    best = str(save_dir / "weights" / "best.pt")
    kw = dict(data=str(data), imgsz=64, batch=4, device="cpu", plots=False, verbose=False, project=str(tmp_path))
    e2e = Model(best).val(**kw)
    with_nms = Model(best).val(nms=True, **kw)
    assert e2e is not None and with_nms is not None
    assert 0.0 <= e2e["map"] <= 1.0 and 0.0 <= with_nms["map"] <= 1.0
    image = sorted((data.parent / "images" / "val").iterdir())[0]
    kw = dict(imgsz=64, conf=0.0, max_det=5, device="cpu", verbose=False, project=str(tmp_path))
    (r,) = Model(best).predict(str(image), **kw)
    assert len(r.boxes) == 5  # top-k: exactly max_det detections at conf 0
    (n,) = Model(best).predict(str(image), nms=True, **kw)
    assert 0 < len(n.boxes) <= 5
