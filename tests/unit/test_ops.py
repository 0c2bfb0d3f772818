"""non_max_suppression against a slow greedy reference, plus its filters and edge cases."""

from __future__ import annotations

import pytest
import torch

from detrain.nn.boxes import xywh2xyxy
from detrain.nn.postprocess import non_max_suppression


def _iou(a: torch.Tensor, b: torch.Tensor) -> float:
    w = max(0.0, float(min(a[2], b[2]) - max(a[0], b[0])))
    h = max(0.0, float(min(a[3], b[3]) - max(a[1], b[1])))
    inter = w * h
    area = float((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]))
    return inter / (area - inter)


def _reference(pred: torch.Tensor, conf: float, iou: float, max_det: int, agnostic: bool) -> torch.Tensor:
    """Greedy NMS one box at a time: the definition, with none of the vectorisation."""
    rows = []
    for a in range(pred.shape[1]):
        score, cls = pred[4:, a].max(0)
        if score > conf:
            rows.append((float(score), int(cls), xywh2xyxy(pred[:4, a])))
    rows.sort(key=lambda r: -r[0])
    kept: list[tuple[float, int, torch.Tensor]] = []
    for score, cls, box in rows:
        if all((not agnostic and c != cls) or _iou(box, b) <= iou for _, c, b in kept):
            kept.append((score, cls, box))
    kept = kept[:max_det]
    if not kept:
        return torch.zeros(0, 6)
    return torch.stack([torch.cat((b, torch.tensor([s, float(c)]))) for s, c, b in kept])


def _random_preds(b: int, nc: int, n: int, seed: int, size: float = 100.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(b, 2, n, generator=g) * size
    wh = torch.rand(b, 2, n, generator=g) * size / 4 + 2
    scores = torch.rand(b, nc, n, generator=g)
    return torch.cat((xy, wh, scores), 1)


@pytest.mark.parametrize("agnostic", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_greedy_reference(seed: int, agnostic: bool) -> None:
    preds = _random_preds(2, 3, 150, seed)
    out = non_max_suppression(preds, conf_thres=0.5, iou_thres=0.4, agnostic=agnostic)
    assert len(out) == 2
    for pred, dets in zip(preds, out):
        ref = _reference(pred, 0.5, 0.4, 300, agnostic)
        assert dets.shape == ref.shape and dets.shape[0] > 5
        torch.testing.assert_close(dets, ref)


def test_classes_are_suppressed_separately() -> None:
    preds = torch.zeros(1, 6, 2)
    preds[0, :4] = torch.tensor([[20.0, 20.0], [20.0, 20.0], [10.0, 10.0], [10.0, 10.0]])  # two identical boxes
    preds[0, 4:, 0] = torch.tensor([0.9, 0.1])  # anchor 0: class 0
    preds[0, 4:, 1] = torch.tensor([0.1, 0.8])  # anchor 1: class 1
    assert non_max_suppression(preds, 0.25, 0.5)[0][:, 5].tolist() == [0.0, 1.0]
    assert non_max_suppression(preds, 0.25, 0.5, agnostic=True)[0][:, 5].tolist() == [0.0]
    assert non_max_suppression(preds, 0.25, 0.5, classes=[1])[0][:, 5].tolist() == [1.0]


def test_multi_label_keeps_every_class_above_threshold() -> None:
    preds = torch.zeros(1, 7, 1)
    preds[0, :4, 0] = torch.tensor([20.0, 20.0, 10.0, 10.0])
    preds[0, 4:, 0] = torch.tensor([0.9, 0.6, 0.1])
    dets = non_max_suppression(preds, 0.5, 0.5, multi_label=True)[0]
    assert dets[:, 5].tolist() == [0.0, 1.0]
    assert non_max_suppression(preds, 0.5, 0.5)[0].shape == (1, 6)


def test_max_det_and_max_nms() -> None:
    preds = _random_preds(1, 2, 400, seed=3, size=2000.0)  # sparse boxes: NMS removes few
    full = non_max_suppression(preds, 0.1, 0.5, max_det=1000)[0]
    top = non_max_suppression(preds, 0.1, 0.5, max_det=10)[0]
    assert full.shape[0] > 10 and top.shape == (10, 6)
    torch.testing.assert_close(top, full[:10])
    assert (top[:-1, 4] >= top[1:, 4]).all()
    # with max_nms only the highest-scoring candidates enter NMS
    few = non_max_suppression(preds, 0.1, 0.5, max_nms=20, max_det=1000)[0]
    assert few.shape[0] <= 20 and few[:, 4].min() >= full[19, 4] - 1e-6


def test_conf_filter() -> None:
    preds = _random_preds(1, 4, 200, seed=4)
    dets = non_max_suppression(preds, conf_thres=0.9, iou_thres=1.0)[0]
    best = preds[0, 4:].amax(0)
    assert dets.shape[0] == int((best > 0.9).sum())
    assert (dets[:, 4] > 0.9).all()


def test_empty_inputs() -> None:
    assert non_max_suppression(torch.zeros(2, 84, 0))[1].shape == (0, 6)
    nothing = non_max_suppression(torch.zeros(3, 84, 50), conf_thres=0.25)
    assert len(nothing) == 3 and all(d.shape == (0, 6) for d in nothing)
    preds = _random_preds(1, 2, 10, seed=5)
    assert non_max_suppression(preds, 0.0, 0.5, classes=[7])[0].shape == (0, 6)
    with pytest.raises(ValueError, match=r"preds must be \(B, 4 \+ nc, N\), got \(4, 10\)"):
        non_max_suppression(torch.zeros(4, 10))


def test_half_precision_and_device() -> None:
    preds = _random_preds(1, 3, 100, seed=6)
    dets = non_max_suppression(preds.half(), 0.5, 0.5)[0]
    assert dets.dtype == torch.float16 and dets.device == preds.device
    # half rounding may move a score or an IoU across a threshold, nothing more
    assert abs(dets.shape[0] - non_max_suppression(preds, 0.5, 0.5)[0].shape[0]) <= 3
