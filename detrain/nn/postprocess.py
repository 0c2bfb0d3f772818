"""Post-processing of decoded predictions: confidence filtering and per-class NMS."""

from __future__ import annotations

import torch
from torch import Tensor

from detrain.nn.boxes import xywh2xyxy
from detrain.nn.nms_kernel import nms_kernel


def non_max_suppression(
    preds: Tensor,
    conf_thres: float = 0.25,
    iou_thres: float = 0.45,
    max_det: int = 300,
    classes: list[int] | None = None,
    agnostic: bool = False,
    multi_label: bool = False,
    max_nms: int = 30000,
    max_wh: int = 7680,
) -> list[Tensor]:
    """Decoded model output (B, 4 + nc, N) of xywh boxes and class scores -> per image (n, 6) detections
    [x1, y1, x2, y2, score, class], best first, on ``preds``' device.

    A candidate is an anchor whose best class score exceeds ``conf_thres`` (with ``multi_label``, every
    (anchor, class) pair above it). At most ``max_nms`` candidates, by score, enter NMS; NMS runs per class
    (all classes together with ``agnostic``) by offsetting each class's boxes by ``class * max_wh`` pixels,
    so ``max_wh`` must exceed the image size. ``classes`` keeps only those class ids.

    >>> preds = torch.zeros(1, 6, 3)
    >>> preds[0, :4] = torch.tensor([[10., 11, 50], [10, 11, 50], [8, 8, 8], [8, 8, 8]])  # xywh per anchor
    >>> preds[0, 4] = torch.tensor([0.9, 0.8, 0.7])  # class 0 scores
    >>> out = non_max_suppression(preds, conf_thres=0.5, iou_thres=0.5)[0]
    >>> [round(s, 2) for s in out[:, 4].tolist()], out[:, 5].tolist()  # the 2nd box overlaps the 1st
    ([0.9, 0.7], [0.0, 0.0])
    """
    if preds.dim() != 3 or preds.shape[1] < 5:
        raise ValueError(f"preds must be (B, 4 + nc, N), got {tuple(preds.shape)}")
    nc = preds.shape[1] - 4
    scores_all = preds[:, 4:]
    candidates = scores_all.amax(1) > conf_thres  # (B, N), one vectorised pass over the batch
    class_filter = torch.tensor(classes, device=preds.device) if classes is not None else None
    out: list[Tensor] = []
    for i in range(preds.shape[0]):
        x = preds[i, :, candidates[i]].T  # (n, 4 + nc)
        if not x.shape[0]:
            out.append(preds.new_zeros((0, 6)))
            continue
        boxes_xyxy = xywh2xyxy(x[:, :4])
        cls_scores = x[:, 4:]
        if multi_label and nc > 1:
            anchor_idx, cls_idx = (cls_scores > conf_thres).nonzero(as_tuple=True)
            dets = torch.cat(
                (boxes_xyxy[anchor_idx], cls_scores[anchor_idx, cls_idx, None], cls_idx[:, None].to(x.dtype)), 1
            )
        else:
            conf, cls_idx = cls_scores.max(1, keepdim=True)
            dets = torch.cat((boxes_xyxy, conf, cls_idx.to(x.dtype)), 1)
        if class_filter is not None:
            dets = dets[(dets[:, 5:6] == class_filter).any(1)]
        if dets.shape[0] > max_nms:
            dets = dets[dets[:, 4].topk(max_nms).indices]
        if not dets.shape[0]:
            out.append(dets)
            continue
        offsets = 0.0 if agnostic else dets[:, 5:6] * max_wh
        # torchvision's CPU kernel has no half support; NMS only needs the ordering and IoUs
        keep = nms_kernel()((dets[:, :4] + offsets).float(), dets[:, 4].float(), iou_thres)
        out.append(dets[keep[:max_det]])
    return out
