"""NMS-free decoding of an end-to-end head's one-to-one branch: boxes from raw distances, then the top-k
(anchor, class) pairs by score.

The one-to-one branch was trained to give each object a single confident anchor, so its best ``max_det`` scores
already are the detections: no NMS, and a fixed-shape (B, max_det, 6) output that exports as is. The top-k runs in
two steps, first the ``max_det`` anchors with the highest best-class score, then the top ``max_det`` of those
anchors' (anchor, class) scores: the same pairs as one top-k over every anchor and class (a pair in the overall
top-k has an anchor whose best score beats all but fewer than ``max_det`` anchors), over ``max_det * nc`` scores
instead of ``N * nc``. The confidence filter then only drops rows, as Ultralytics does for end-to-end models
(``tests/unit/test_parity_e2e.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from detrain.nn.boxes import dist2bbox, make_anchors


def decode_xyxy(head_maps: list[Tensor], strides: Tensor | Sequence[float]) -> Tensor:
    """Raw ``reg_max`` 1 maps (B, 4 + nc, H_i, W_i) (ltrb distances in strides, class logits) -> (B, 4 + nc, N):
    xyxy boxes in input pixels and sigmoid scores, anchors in ``make_anchors`` order.

    >>> maps = [torch.zeros(1, 5, 2, 2)]
    >>> maps[0][:, :4] = 1.0  # one stride to every side
    >>> out = decode_xyxy(maps, [8.0])
    >>> out[0, :, 0].tolist()  # the anchor at (4, 4) px: a 16 px box around it, score sigmoid(0)
    [-4.0, -4.0, 12.0, 12.0, 0.5]
    """
    b, no = head_maps[0].shape[:2]
    strides_t = strides if isinstance(strides, Tensor) else torch.tensor([float(s) for s in strides])
    anchors, stride_per_anchor = make_anchors(head_maps, strides_t, 0.5)
    x = torch.cat([m.reshape(b, no, -1) for m in head_maps], 2)
    box, logits = x.split((4, no - 4), 1)
    boxes_xyxy = dist2bbox(box, anchors.T[None], xywh=False, dim=1) * stride_per_anchor.T[None]
    return torch.cat((boxes_xyxy, logits.sigmoid()), 1)


def topk_detections(preds: Tensor, max_det: int = 300, agnostic: bool = False) -> Tensor:
    """Decoded one-to-one output (B, 4 + nc, N) of xyxy boxes and class scores -> (B, k, 6) [x1, y1, x2, y2,
    score, class], best first, k = min(max_det, N).

    Each (anchor, class) pair is a candidate, so one anchor may appear with several classes; with ``agnostic``
    each anchor gives only its best class.

    >>> preds = torch.zeros(1, 6, 3)
    >>> preds[0, :4] = torch.tensor([[0., 1, 2], [0, 1, 2], [5, 6, 7], [5, 6, 7]])  # xyxy per anchor
    >>> preds[0, 4:] = torch.tensor([[0.1, 0.9, 0.3], [0.8, 0.2, 0.0]])  # class 0 and class 1 scores
    >>> [[round(v, 2) for v in row] for row in topk_detections(preds, max_det=2)[0].tolist()]
    [[1.0, 1.0, 6.0, 6.0, 0.9, 0.0], [0.0, 0.0, 5.0, 5.0, 0.8, 1.0]]
    """
    boxes, scores = preds[:, :4].transpose(1, 2), preds[:, 4:].transpose(1, 2)  # (B, N, 4), (B, N, nc)
    nc = scores.shape[-1]
    k = min(max_det, scores.shape[1])
    if agnostic:
        best, labels = scores.max(-1)
        top, anchor = best.topk(k, dim=1)
        label = labels.gather(1, anchor)
    else:
        anchor_k = scores.amax(-1).topk(k, dim=1).indices  # the k anchors with the best best-class score
        pair_scores = scores.gather(1, anchor_k[..., None].expand(-1, -1, nc)).flatten(1)  # (B, k * nc)
        top, pair = pair_scores.topk(k, dim=1)
        anchor, label = anchor_k.gather(1, pair // nc), pair % nc
    chosen = boxes.gather(1, anchor[..., None].expand(-1, -1, 4))
    return torch.cat((chosen, top[..., None], label[..., None].to(top.dtype)), -1)


def filter_detections(
    dets: Tensor, conf_thres: float = 0.25, max_det: int = 300, classes: list[int] | None = None
) -> list[Tensor]:
    """(B, k, 6) top-k detections -> per image (n, 6) float rows with a score above ``conf_thres`` (and a class
    in ``classes``), at most ``max_det``, in the order given (best first).

    >>> dets = torch.tensor([[[0., 0, 1, 1, 0.9, 2], [0, 0, 1, 1, 0.5, 1], [0, 0, 1, 1, 0.1, 2]]])
    >>> [d[:, 5].tolist() for d in filter_detections(dets, conf_thres=0.2)]
    [[2.0, 1.0]]
    >>> [d[:, 5].tolist() for d in filter_detections(dets, conf_thres=0.2, classes=[2])]
    [[2.0]]
    """
    keep = dets[..., 4] > conf_thres
    if classes is not None:
        keep &= torch.isin(dets[..., 5], torch.tensor(classes, device=dets.device, dtype=dets.dtype))
    return [d[k][:max_det].float() for d, k in zip(dets, keep)]
