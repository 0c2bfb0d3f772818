"""Confusion matrix of a detector: which class was predicted for which true class, background included."""

from __future__ import annotations

from typing import Any

import numpy as np


class ConfusionMatrix:
    """Counts in ``matrix[predicted, true]`` of shape (nc + 1, nc + 1); the last row/column is background.

    Detections with ``score >= conf`` are paired one-to-one with ground truth of any class, highest IoU
    first, when the IoU exceeds ``iou_thres``. A pair counts at (its predicted class, its true class); a
    ground truth left alone is a miss (background row), a detection left alone a false alarm (background
    column). Several ranks' ``matrix`` add up (the validator sums them).

    >>> cm = ConfusionMatrix(nc=2)
    >>> cm.update(np.array([[0, 0, 10, 10, 0.9, 1]]), np.array([[0, 0, 10, 10]]), np.array([0]))
    >>> cm.matrix.tolist()
    [[0, 0, 0], [1, 0, 0], [0, 0, 0]]
    """

    def __init__(self, nc: int, conf: float = 0.25, iou_thres: float = 0.45) -> None:
        self.nc = nc
        self.conf = conf
        self.iou_thres = iou_thres
        self.matrix = np.zeros((nc + 1, nc + 1), dtype=np.int64)

    def update(self, det: Any, gt_xyxy: Any, gt_cls: Any) -> None:
        """Add one image: ``det`` (n, 6) as x1, y1, x2, y2, score, class; ground truth boxes and classes."""
        det = _np(det).reshape(-1, 6)
        det = det[det[:, 4] >= self.conf]
        gt = _np(gt_xyxy).reshape(-1, 4)
        gcls = _np(gt_cls).reshape(-1).astype(np.int64)
        dcls = det[:, 5].astype(np.int64)
        bg = self.nc
        gt_used = np.zeros(len(gt), bool)
        det_used = np.zeros(len(det), bool)
        if len(gt) and len(det):
            iou = box_iou_xyxy(gt, det[:, :4])
            gi, di = np.nonzero(iou > self.iou_thres)
            for p in np.argsort(-iou[gi, di], kind="stable"):  # best overlaps claim their partners first
                g, d = gi[p], di[p]
                if not gt_used[g] and not det_used[d]:
                    gt_used[g] = det_used[d] = True
                    self.matrix[dcls[d], gcls[g]] += 1
        np.add.at(self.matrix, (np.full((~gt_used).sum(), bg), gcls[~gt_used]), 1)
        np.add.at(self.matrix, (dcls[~det_used], np.full((~det_used).sum(), bg)), 1)


def box_iou_xyxy(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(N, M) IoU of corner boxes. ``box_iou_xyxy(np.array([[0, 0, 2, 2]]), np.array([[1, 0, 3, 2]]))`` -> 1/3."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(-1)
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def _np(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float64)
