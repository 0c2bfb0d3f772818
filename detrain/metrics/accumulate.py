"""COCO accumulation: matched per-image statistics -> the precision and recall tables of the reference.

The tables have the reference's layout, ``precision[T, R, K, A, M]`` and ``recall[T, K, A, M]`` (IoU
thresholds, 101 recall points, classes, area ranges, max detections 1/10/100), with -1 where a class has
no ground truth in an area range. The work is one stable sort of all detections and, per class, a few
vectorised cumulative sums; the reference loops in Python per class, area, max-dets and threshold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from detrain.metrics.match import AREA_RANGES, IOU_THRESHOLDS, MAX_DETS, RECALL_THRESHOLDS, ImageStats


@dataclass
class Pooled:
    """Every image's statistics in one set of arrays, detections sorted by (class, score) as COCO does.

    ``class_start[k]:class_start[k + 1]`` are the detections of class ``k``.
    """

    scores: np.ndarray  # (N,) float64
    rank: np.ndarray  # (N,) int32, position within its (image, class)
    matched: np.ndarray  # (N, A, T) bool
    ignored: np.ndarray  # (N, A, T) bool
    class_start: np.ndarray  # (nc + 1,) int64
    n_gt: np.ndarray  # (nc, A) int64: ground truth that is not ignored, per class and area range
    n_images: np.ndarray  # (nc,) int64: images holding at least one such ground truth (area "all")


def pool(stats: Sequence[ImageStats], nc: int) -> Pooled:
    """Concatenate per-image statistics in image-id order and sort detections as the reference does.

    Statistics with the same ``image_id`` (>= 0) are one image: the first one counts.

    >>> pool([], 3).n_gt.shape
    (3, 4)
    """
    # Stable, so images without an id (-1) keep the order they were passed in. A distributed sampler pads
    # shards by repeating images; an id seen again is that padding and counts once.
    ordered: list[ImageStats] = []
    for s in sorted(stats, key=lambda s: s.image_id):
        if s.image_id < 0 or not ordered or ordered[-1].image_id != s.image_id:
            ordered.append(s)
    n_area = len(AREA_RANGES)
    cls = _cat([s.det_cls for s in ordered], np.int32)
    scores = _cat([s.det_scores for s in ordered], np.float64)
    rank = _cat([s.det_rank for s in ordered], np.int32)
    matched = np.concatenate([s.matched() for s in ordered]) if ordered else np.zeros((0, n_area, 10), bool)
    ignored = np.concatenate([s.ignored() for s in ordered]) if ordered else np.zeros((0, n_area, 10), bool)
    gt_cls = _cat([s.gt_cls for s in ordered], np.int32)
    gt_ignored = np.concatenate([s.gt_ignored for s in ordered]) if ordered else np.zeros((0, n_area), bool)
    for what, c in (("detection", cls), ("ground truth", gt_cls)):
        if len(c) and (c.min() < 0 or c.max() >= nc):
            raise ValueError(f"{what} class {int(c.max() if c.max() >= nc else c.min())} is outside 0..{nc - 1}")

    # Within a class: score descending, ties in concatenation order (images by id, then per-image order),
    # which is exactly what the reference's mergesort over concatenated per-image lists gives.
    order = np.argsort(-scores, kind="stable")
    order = order[np.argsort(cls[order], kind="stable")]
    class_start = np.searchsorted(cls[order], np.arange(nc + 1), side="left")

    n_gt = np.stack([np.bincount(gt_cls[~gt_ignored[:, a]], minlength=nc) for a in range(n_area)], 1)
    image_sets = [np.unique(s.gt_cls[~s.gt_ignored[:, 0]]) for s in ordered]
    n_images = np.bincount(np.concatenate(image_sets) if image_sets else np.zeros(0, np.int64), minlength=nc)
    return Pooled(
        scores[order],
        rank[order],
        matched[order],
        ignored[order],
        class_start,
        n_gt.astype(np.int64),
        n_images.astype(np.int64),
    )


def accumulate(pooled: Pooled) -> tuple[np.ndarray, np.ndarray]:
    """``precision[T, R, K, A, M]`` and ``recall[T, K, A, M]`` exactly as the reference's ``accumulate``.

    >>> p, r = accumulate(pool([], 2))
    >>> p.shape, float(r.max())
    ((10, 101, 2, 4, 3), -1.0)
    """
    n_t, n_r, n_a, n_m = len(IOU_THRESHOLDS), len(RECALL_THRESHOLDS), len(AREA_RANGES), len(MAX_DETS)
    nc = len(pooled.n_gt)
    precision = -np.ones((n_t, n_r, nc, n_a, n_m))
    recall = -np.ones((n_t, nc, n_a, n_m))
    for k in range(nc):
        lo, hi = pooled.class_start[k], pooled.class_start[k + 1]
        if not pooled.n_gt[k].any():
            continue
        rank = pooled.rank[lo:hi]
        for m, max_det in enumerate(MAX_DETS):
            keep = rank < max_det
            matched, ignored = pooled.matched[lo:hi][keep], pooled.ignored[lo:hi][keep]
            for a in range(n_a):
                n_gt = pooled.n_gt[k, a]
                if n_gt == 0:
                    continue
                q, rc = _precision_at_recall(matched[:, a].T, ignored[:, a].T, n_gt)
                precision[:, :, k, a, m] = q
                recall[:, k, a, m] = rc
    return precision, recall


def _precision_at_recall(matched: np.ndarray, ignored: np.ndarray, n_gt: int) -> tuple[np.ndarray, np.ndarray]:
    """(T, R) interpolated precision and (T,) final recall for one class, area range and max-dets.

    Arrays are (T, N) in score order; ignored detections stay in the sequence (neither TP nor FP), as in
    the reference, because that decides which position each recall threshold lands on.
    """
    n = matched.shape[1]
    if n == 0:
        return np.zeros((len(matched), len(RECALL_THRESHOLDS))), np.zeros(len(matched))
    tp = np.cumsum(matched & ~ignored, axis=1).astype(np.float64)
    fp = np.cumsum(~matched & ~ignored, axis=1).astype(np.float64)
    rc = tp / n_gt
    pr = tp / (fp + tp + np.spacing(1))
    envelope = np.maximum.accumulate(pr[:, ::-1], axis=1)[:, ::-1]  # precision made monotone
    q = np.zeros((len(matched), len(RECALL_THRESHOLDS)))
    for t in range(len(matched)):
        idx = np.searchsorted(rc[t], RECALL_THRESHOLDS, side="left")
        reached = idx < n  # recall levels never reached keep precision 0
        q[t, reached] = envelope[t, idx[reached]]
    return q, rc[:, -1]


def _cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
