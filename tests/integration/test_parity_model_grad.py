"""Whole-model parity with Ultralytics 8.4: from the same weights and the same batch, detrain's model and loss give
Ultralytics' loss, loss items and every parameter's gradient (train mode), and its decoded outputs and detections
(eval mode, on real coco8 images).

The unit parity tests check the loss on YOLOv8n alone (``tests/unit/test_parity_loss.py``) and the pieces of YOLO26
(``test_parity_e2e.py``); here the whole network is in the loop, for every family: its blocks, its head, the
trainer's loss call and the detections step.

Both sides pick their loss and detections step from the model they built: detrain through its head seam
(``model.criterion``, driven as the trainer drives it; ``model.postprocess``), Ultralytics by ``init_criterion``
(``v8DetectionLoss``, or ``E2ELoss`` for YOLO26's end-to-end head) and its ``non_max_suppression`` (which filters
end-to-end outputs as well as running NMS). YOLO26's loss is checked at three points of its schedule (the epoch at
which both sides set the weight that moves from the one-to-many to the one-to-one branch over a 100-epoch run), and
its eval output is the NMS-free top-k of the one-to-one branch on both sides.

The train-mode check runs in float64, where 1e-5 means something: in float32 the two sides differ by rounding
alone by more than that. Ultralytics' own float32 class loss is 2e-5 from its float64 value on pretrained YOLOv8n
(a dense sum of 84,000 small terms; detrain's is within 1e-7), the trainer's channels_last layout rounds
differently from Ultralytics' contiguous one (gradients 5e-4 apart), and a gradient that is zero in exact arithmetic
(a BatchNorm bias whose shift the next train-mode BatchNorm removes, as in YOLO11's attention) is pure rounding
noise, as large as 2x its value. In float64 that noise is 1e-17 and everything agrees to 2e-7; all of what remains
is detrain's CIoU clamping a box height at eps where Ultralytics adds eps to it (with Ultralytics' form, loss and
gradients agree to 1e-13). The eval check runs in float32, the precision inference uses.

Runs only where Ultralytics is importable (``PYTHONPATH=$PWD:/opt/ulib python -m pytest -s
tests/integration/test_parity_model_grad.py``; ``-s`` prints the worst differences) and with ``../shared``'s coco8
(and yolov8n.pt for the pretrained YOLOv8n).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from _gains import DEFAULT_LOSS
from _ultralytics import load_ultralytics_checkpoint, offline_ultralytics, to_detrain_model
from torch import Tensor, nn

from detrain.data.image_io import read_image
from detrain.data.samples.augment import letterbox
from detrain.engine.train.setup import to_channels_last
from detrain.nn.head import InferenceOptions
from detrain.nn.model import DetectionModel

SHARED = Path(__file__).resolve().parents[3] / "shared"
COCO8 = SHARED / "data" / "coco8"
NC, TRAIN_SIZE, EVAL_SIZE, BATCH = 80, 160, 256, 2
IOU, MAX_DET = 0.7, 300
SEED = 0

Batch = dict[str, Tensor]
OurLoss = Callable[[Any, Batch], tuple[Tensor, Tensor]]  # (train-mode output, batch) -> (loss, items)


@dataclass(frozen=True)
class Family:
    """One model family under test. ``name``: both tools build ``<name>.yaml``; ``weights``: an Ultralytics file
    both load, else Ultralytics' own initialisation under a fixed seed; ``epoch``: where both sides stand in a loss
    schedule (YOLO26's branch weights; nothing changes for the others)."""

    name: str
    weights: Path | None = None
    epoch: int = 0

    @property
    def id(self) -> str:
        return f"{self.name}@{self.epoch}" if self.name.startswith("yolo26") else self.name


EPOCHS = 100  # Ultralytics' default, which its loss schedule reads from the model's args


def trainer_loss(model: DetectionModel, epoch: int) -> OurLoss:
    """The model's own criterion (the head seam) as the trainer builds and calls it: ``set_epoch``, ``assign``,
    then ``score`` with the summed target scores (one process: its own) and the step's batch as the global batch."""
    criterion = model.criterion(DEFAULT_LOSS, epochs=EPOCHS)
    criterion.set_epoch(epoch)

    def loss(maps: Any, batch: Batch) -> tuple[Tensor, Tensor]:
        targets = criterion.assign(maps, batch["batch_idx"], batch["cls"], batch["bboxes"])
        return criterion.score(targets, targets.score_sum, global_batch=BATCH)

    return loss


def their_criterion(theirs: nn.Module, epoch: int) -> Any:
    """Ultralytics' criterion for its model, its schedule (if any) moved to ``epoch`` as its trainer does."""
    criterion = theirs.init_criterion()
    if hasattr(criterion, "update") and epoch:
        criterion.updates = epoch - 1
        criterion.update()
    return criterion


FAMILIES = [
    Family("yolov8n", SHARED / "weights" / "yolov8n.pt"),
    Family("yolo11n"),
    Family("yolo26n", epoch=0),
    Family("yolo26n", epoch=50),
    Family("yolo26n", epoch=EPOCHS - 1),
]
EVAL_FAMILIES = [f for f in FAMILIES if f.epoch == 0]


@pytest.fixture(scope="module")
def ul(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    if not COCO8.is_dir():
        pytest.skip(f"needs {COCO8}")
    with offline_ultralytics(tmp_path_factory):
        from ultralytics.cfg import get_cfg
        from ultralytics.nn.tasks import DetectionModel as TheirModel
        from ultralytics.utils.nms import non_max_suppression as their_nms

        yield SimpleNamespace(get_cfg=get_cfg, Model=TheirModel, nms=their_nms)


def _models(ul: SimpleNamespace, family: Family, dtype: torch.dtype) -> tuple[DetectionModel, nn.Module]:
    """(ours, theirs) holding the same weights in ``dtype``: the family's file, or Ultralytics' init at SEED."""
    torch.manual_seed(SEED)
    theirs = ul.Model(f"{family.name}.yaml", nc=NC, verbose=False)
    theirs.args = ul.get_cfg()  # its loss reads the gains (box 7.5, cls 0.5, dfl 1.5) and epochs (100) from here
    assert theirs.args.epochs == EPOCHS
    if family.weights is None:
        ours = DetectionModel(f"{family.name}.yaml", nc=NC)
        ours.load_state_dict(theirs.state_dict())
    else:
        if not family.weights.is_file():
            pytest.skip(f"needs {family.weights}")
        ours = to_detrain_model(load_ultralytics_checkpoint(family.weights))
        theirs.load_state_dict(ours.state_dict())
    assert [k for k, _ in ours.state_dict().items()] == [k for k, _ in theirs.state_dict().items()]
    return ours.to(dtype), theirs.to(dtype)


def _coco8_batch(split: str, size: int) -> Batch:
    """The first BATCH images of a coco8 split, letterboxed to ``size`` as detrain's loader does (uint8 RGB), and
    their labels: the batch dict both trainers read (img, batch_idx, cls, normalised xywh bboxes)."""
    imgs, idx, cls, boxes = [], [], [], []
    for i, path in enumerate(sorted((COCO8 / "images" / split).glob("*.jpg"))[:BATCH]):
        bgr = read_image(str(path))
        assert bgr is not None, path
        h, w = bgr.shape[:2]
        img, (gain, _), (left, top) = letterbox(bgr, size)
        imgs.append(torch.from_numpy(np.ascontiguousarray(img[..., ::-1].transpose(2, 0, 1))))
        labels = torch.from_numpy(np.loadtxt(COCO8 / "labels" / split / f"{path.stem}.txt", ndmin=2)).float()
        xywh = labels[:, 1:] * torch.tensor([w, h, w, h]) * gain
        xywh[:, :2] += torch.tensor([left, top])
        idx.append(torch.full((len(labels),), float(i)))
        cls.append(labels[:, :1])
        boxes.append(xywh / size)
    return {"img": torch.stack(imgs), "batch_idx": torch.cat(idx), "cls": torch.cat(cls), "bboxes": torch.cat(boxes)}


@pytest.fixture
def float64_default() -> Iterator[None]:
    """Ultralytics' loss makes its item and target buffers in the default dtype: float64 all through."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _batchnorm_statistics_of(model: nn.Module, imgs: Tensor) -> None:
    """Set every BatchNorm's running statistics to those of one train-mode pass over ``imgs``. A fresh init's
    (mean 0, variance 1) shrink the features layer after layer in eval mode until every anchor scores its class
    bias alone: the classes would tie everywhere and the detections would test nothing."""
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.momentum = 1.0
    with torch.no_grad():
        model.train()(imgs)
    for m, momentum in zip(norms, momenta, strict=True):
        m.momentum = momentum


def _worst_gradient(ours: nn.Module, theirs: nn.Module) -> tuple[float, float, str, float]:
    """Every trained parameter's gradient against Ultralytics': (worst relative difference, each parameter's
    largest difference over its largest gradient; the worst absolute difference; the parameter of the worst
    relative one; the largest gradient of the model). Asserts both sides trained the same parameters."""
    pairs = [(n, p, q) for (n, p), (m, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True)]
    assert all(n == m for (n, _), (m, _) in zip(ours.named_parameters(), theirs.named_parameters()))
    trained = [(n, p.grad, q.grad) for n, p, q in pairs if q.requires_grad]
    assert all(g is not None and ref is not None for _, g, ref in trained) and len(trained) > 180
    assert all(p.grad is None for _, p, q in pairs if not q.requires_grad)  # the DFL's fixed weights
    largest = max(float(ref.abs().max()) for _, _, ref in trained)
    # structurally zero gradients (see the module docstring) are compared against the model's scale
    floor = 1e-7 * largest
    worst_rel, worst_abs, worst_name = 0.0, 0.0, ""
    for name, g, ref in trained:
        diff = float((g - ref).abs().max())
        rel = diff / max(float(ref.abs().max()), floor)
        worst_abs = max(worst_abs, diff)
        if rel > worst_rel:
            worst_rel, worst_name = rel, name
    return worst_rel, worst_abs, worst_name, largest


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.id)
def test_loss_and_every_gradient_agree_with_ultralytics(
    ul: SimpleNamespace, family: Family, float64_default: None
) -> None:
    ours, theirs = _models(ul, family, torch.float64)
    ours = to_channels_last(ours.train())  # the trainer's layout
    theirs.train()
    batch = _coco8_batch("train", TRAIN_SIZE)
    assert len(batch["cls"]) > 5

    their_loss, their_items = their_criterion(theirs, family.epoch)(theirs(batch["img"].double() / 255), batch)
    their_loss.sum().backward()
    imgs = batch["img"].contiguous(memory_format=torch.channels_last).double() / 255
    our_loss, our_items = trainer_loss(ours, family.epoch)(ours(imgs), batch)
    our_loss.backward()

    their_items = torch.stack([v.reshape(()) for v in their_items.values()])
    assert our_items.dtype == their_items.dtype == torch.float64
    torch.testing.assert_close(our_items, their_items, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(our_loss.detach(), their_loss.detach().sum(), rtol=1e-5, atol=1e-6)
    worst_rel, worst_abs, name, largest = _worst_gradient(ours, theirs)
    total, their_total = float(our_loss.detach()), float(their_loss.detach().sum())
    print(
        f"\n{family.id} float64: loss {total:.6f} vs {their_total:.6f}, items rel "
        f"{float(((our_items - their_items).abs() / their_items.abs()).max()):.1e}; gradients: worst rel "
        f"{worst_rel:.1e} ({name}), worst abs {worst_abs:.1e}, largest {largest:.2f}"
    )
    assert worst_rel <= 1e-5, name


@pytest.mark.parametrize("family", EVAL_FAMILIES, ids=lambda f: f.id)
def test_eval_outputs_and_detections_agree_with_ultralytics(ul: SimpleNamespace, family: Family) -> None:
    ours, theirs = _models(ul, family, torch.float32)
    imgs = _coco8_batch("val", EVAL_SIZE)["img"].float() / 255
    if family.weights is None:
        _batchnorm_statistics_of(theirs, imgs)
        ours.load_state_dict(theirs.state_dict())
    if hasattr(theirs, "end2end"):
        theirs.end2end = bool(ours.head.end2end)  # Ultralytics 8.4.190 runs YOLO26 NMS-free only when asked to
    with torch.no_grad():
        mine = ours.eval()(imgs)
        ref = theirs.eval()(imgs)[0]  # (decoded, raw maps)
    assert isinstance(mine, Tensor) and mine.shape == ref.shape
    torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-4)

    # a threshold that sends about 1 anchor in 50 to NMS, whatever the scores' scale (a random init scores low)
    scores = ref[..., 4] if ref.shape[-1] == 6 else ref[:, 4:].amax(1)  # end-to-end (B, max_det, 6) or (B, 4+nc, N)
    conf = float(scores.flatten().quantile(0.98))
    options = InferenceOptions(conf=conf, iou=IOU, max_det=MAX_DET)
    dets, their_dets = ours.postprocess(mine, options), ul.nms(ref, conf, IOU, max_det=MAX_DET)
    kept = [len(d) for d in their_dets]
    assert [len(d) for d in dets] == kept and sum(kept) >= 5, kept
    for d, t in zip(dets, their_dets):
        torch.testing.assert_close(d[:, 5], t[:, 5], rtol=0, atol=0)  # the same classes in the same order
        torch.testing.assert_close(d, t, rtol=1e-4, atol=1e-4)
    diff = (mine - ref).abs()
    worst = max(float((d - t).abs().max()) for d, t in zip(dets, their_dets) if len(d))
    print(
        f"\n{family.id} float32 eval: boxes worst abs {float(diff[:, :4].max()):.1e} px, scores worst abs "
        f"{float(diff[:, 4:].max()):.1e}; {kept} detections at conf {conf:.3g}, worst abs {worst:.1e}"
    )


def test_the_families_cover_what_detrain_builds() -> None:
    """A family detrain builds has a case here."""
    from detrain.nn.model import FAMILIES as BUILT

    assert {f.name.rstrip("nsmlx") for f in FAMILIES} == set(BUILT)
