"""Loss parity with Ultralytics: the same weights and the same batch give the same loss and gradients.

Runs only where Ultralytics is importable (it is never a dependency; e.g. ``PYTHONPATH=/opt/ulib
YOLO_OFFLINE=1 YOLO_CONFIG_DIR=/tmp/ycfg python -m pytest tests/unit/test_parity_loss.py``). The models are
YOLOv8n from each tool's own yaml with Ultralytics' weights copied into detrain's (the names are YOLOv8's in
both), in train mode; the batch mixes object sizes from 3 px (below the 16 px middle stride, where the
assigner widens candidate boxes) to half the image, with crowded images where anchors are contested.
"""

from __future__ import annotations

import os

import pytest
import torch
from _gains import DEFAULT_GAINS

os.environ.setdefault("YOLO_OFFLINE", "1")
ultralytics = pytest.importorskip("ultralytics")

from detrain.engine.build import build_model  # noqa: E402
from detrain.nn.loss import DetectionLoss  # noqa: E402

NC, IMGSZ, BATCH = 80, 256, 4


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Images (B, 3, S, S) and labels: batch_idx (M,), cls (M, 1), bboxes (M, 4) normalised xywh."""
    gen = torch.Generator().manual_seed(seed)
    imgs = torch.rand(BATCH, 3, IMGSZ, IMGSZ, generator=gen)
    counts = [12, 0, 3, 25]  # an empty image, and a crowded one
    idx, cls, boxes = [], [], []
    for i, k in enumerate(counts):
        side = (
            torch.exp(
                torch.empty(k, 2).uniform_(torch.log(torch.tensor(3.0)), torch.log(torch.tensor(128.0)), generator=gen)
            )
            / IMGSZ
        )
        centre = torch.rand(k, 2, generator=gen) * (1 - side) + side / 2
        idx.append(torch.full((k,), float(i)))
        cls.append(torch.randint(0, NC, (k, 1), generator=gen).float())
        boxes.append(torch.cat((centre, side), 1))
    return imgs, torch.cat(idx), torch.cat(cls), torch.cat(boxes)


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import DetectionModel

    torch.manual_seed(0)
    theirs = DetectionModel("yolov8n.yaml", nc=NC, verbose=False)
    theirs.args = get_cfg()  # the loss reads its gains (box 7.5, cls 0.5, dfl 1.5) from here
    ours, _ = build_model("n.yaml", nc=NC, verbose=False)
    missing, unexpected = ours.load_state_dict(theirs.state_dict(), strict=False)
    assert not missing and not unexpected
    return ours.train(), theirs.train()


@pytest.mark.parametrize("seed", [0, 1])
def test_loss_and_every_gradient_agree_with_ultralytics(seed: int) -> None:
    from ultralytics.utils.loss import v8DetectionLoss

    ours, theirs = _models()
    imgs, batch_idx, cls, bboxes = _batch(seed)
    # a few steps of real training would leave the head far from its init; 1e-2 noise on every weight gives
    # varied scores and boxes, so the top-k and the contested anchors are not decided by ties
    with torch.no_grad():
        gen = torch.Generator().manual_seed(100 + seed)
        for p_ours, p_theirs in zip(ours.parameters(), theirs.parameters()):
            noise = torch.randn(p_ours.shape, generator=gen) * 1e-2
            p_ours.add_(noise)
            p_theirs.add_(noise)

    their_loss, their_items = v8DetectionLoss(theirs)(
        theirs(imgs), {"batch_idx": batch_idx, "cls": cls, "bboxes": bboxes}
    )
    their_loss.sum().backward()
    maps = ours(imgs)
    our_loss, our_items = DetectionLoss(NC, ours.stride, reg_max=ours.reg_max, gains=DEFAULT_GAINS)(
        maps, batch_idx, cls, bboxes
    )
    our_loss.backward()

    their_items = (
        torch.stack([v.detach().reshape(()) for v in their_items.values()])
        if isinstance(their_items, dict)
        else their_items.detach()
    )
    torch.testing.assert_close(our_items, their_items, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(our_loss.detach(), their_loss.detach().sum(), rtol=1e-5, atol=1e-5)
    compared = 0
    trained = [(n, p, q) for (n, p), q in zip(ours.named_parameters(), theirs.parameters()) if q.requires_grad]
    for name, p_ours, p_theirs in trained:
        g, ref = p_ours.grad, p_theirs.grad
        assert g is not None and ref is not None, name
        scale = float(ref.abs().max()) or 1.0
        assert float((g - ref).abs().max()) <= 1e-5 * scale + 1e-8, name
        compared += 1
    assert compared == len(trained) > 180
