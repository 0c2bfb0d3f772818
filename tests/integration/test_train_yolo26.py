"""A YOLO26 model trains end to end through the same loop as YOLOv8 and YOLO11, by its own head's seam: the end-to-end
loss (box, cls, l1 items; the branch weights moving over the run), NMS-free validation and prediction, ``nms=true``,
and what it saves rebuilds as YOLO26."""

from __future__ import annotations

import csv
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _faults import fault_env
from _gains import DEFAULT_LOSS
from _processes import child_env, one_thread  # noqa: F401 (a fixture)

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
    return root / "data.yaml", Path(result.save_dir)


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
    from detrain.nn.model import DetectionModel

    criterion = DetectionModel("yolo26n.yaml", nc=3).criterion(DEFAULT_LOSS, epochs=2)
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
    assert 0.0 <= e2e.box.map <= 1.0 and 0.0 <= with_nms.box.map <= 1.0
    image = sorted((data.parent / "images" / "val").iterdir())[0]
    kw = dict(imgsz=64, conf=0.0, max_det=5, device="cpu", verbose=False, project=str(tmp_path))
    (r,) = Model(best).predict(str(image), **kw)
    assert len(r.boxes) == 5  # top-k: exactly max_det detections at conf 0
    (n,) = Model(best).predict(str(image), nms=True, **kw)
    assert 0 < len(n.boxes) <= 5


# ------------------------------------------------------------------ resume: bitwise, mid-epoch, the schedule restored
REPO = Path(__file__).resolve().parents[2]
RESUME = dict(
    model="yolo26n.yaml",
    imgsz=64,
    batch=4,
    nbs=8,
    workers=0,
    close_mosaic=0,
    warmup_epochs=0,
    optimizer="SGD",
    val=False,
    plots=False,
    verbose=False,
    seed=0,
    epochs=2,
    device="cpu",
    name="run",
)


def _train(args: dict, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "detrain.cli", "train", *(f"{k}={v}" for k, v in args.items())]
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"detrain train did not end within 300 s:\n{e.stdout}\n{e.stderr}")


def test_a_yolo26_run_killed_after_mid_pt_resumes_bitwise(run: tuple[Path, Path], tmp_path: Path) -> None:
    """Killed in epoch 2 (the branch weights at their second point) with one batch's gradients waiting: the resumed
    run ends with the uninterrupted run's weights, bit for bit."""
    data, _ = run
    straight = _train({**RESUME, "data": str(data), "project": str(tmp_path / "a")}, child_env())
    assert straight.returncode == 0, straight.stderr[-3000:]
    args = {**RESUME, "data": str(data), "project": str(tmp_path / "b"), "save_interval": 1e-9}
    died = _train(args, fault_env("mid.pt", 0, "kill", next_batch=3))  # mid.pt in epoch 2: epoch index 0 done
    assert died.returncode == -signal.SIGKILL, died.stdout[-2000:] + died.stderr[-2000:]
    mid = torch.load(tmp_path / "b" / "run" / "weights" / "mid.pt", map_location="cpu", weights_only=True)
    assert mid["mid_epoch"]["next_batch"] == 3 and mid["pending_grads"] is not None
    resumed = _train({"resume": str(tmp_path / "b" / "run" / "weights" / "last.pt"), "device": "cpu"}, child_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "3/4 batches done" in resumed.stdout + resumed.stderr
    a, b = (
        torch.load(p / "run" / "weights" / "last.pt", map_location="cpu", weights_only=True)
        for p in (tmp_path / "a", tmp_path / "b")
    )
    for key in ("model", "ema"):
        assert a[key]["state_dict"].keys() == b[key]["state_dict"].keys()
        for name, tensor in a[key]["state_dict"].items():
            assert torch.equal(tensor, b[key]["state_dict"][name]), (key, name)
