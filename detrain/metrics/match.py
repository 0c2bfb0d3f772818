"""Per-image matching of detections to ground truth with the COCO evaluation rules.

The result of one image is an :class:`ImageStats`: small numpy arrays, which travel between ranks as arrays
(:mod:`detrain.distributed.wire`), so ranks can gather them and :func:`detrain.metrics.coco_summary` can
accumulate them once, in image-id order.

The rules are those of the COCO reference evaluation (pycocotools ``COCOeval.evaluateImg``):

* per image and class, detections are ordered by score with a stable sort (ties keep the given order)
  and only the first ``max_dets`` are kept;
* IoU is computed in float64 on ``[x_min, y_min, w, h]`` boxes without a +1; for a crowd ground truth
  the union is the detection's area, so one crowd box can absorb many detections;
* a ground truth is *ignored* in an area range when it is a crowd or its area lies outside the range;
* at each IoU threshold, every detection in turn takes the best-overlapping ground truth that is still
  free (crowds are never used up), preferring regular ground truth over ignored ones; among equal IoUs
  the later ground truth wins, as in the reference's scan;
* a detection matched to an ignored ground truth is ignored, and so is an unmatched detection whose own
  area lies outside the range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from detrain.distributed.wire import carried

# The reference's grids, built with the same calls so that every threshold has the same bits.
IOU_THRESHOLDS: np.ndarray = np.linspace(0.5, 0.95, int(np.round((0.95 - 0.5) / 0.05)) + 1, endpoint=True)
RECALL_THRESHOLDS: np.ndarray = np.linspace(0.0, 1.0, int(np.round((1.0 - 0.0) / 0.01)) + 1, endpoint=True)
AREA_RANGES: np.ndarray = np.array([[0**2, 1e5**2], [0**2, 32**2], [32**2, 96**2], [96**2, 1e5**2]], dtype=np.float64)
AREA_NAMES: tuple[str, ...] = ("all", "small", "medium", "large")
MAX_DETS: tuple[int, ...] = (1, 10, 100)

_A, _T = len(AREA_RANGES), len(IOU_THRESHOLDS)


@carried  # gathered from every rank: see detrain.distributed.wire
@dataclass
class ImageStats:
    """What one image contributes to the metrics; numpy only, so it travels small and fast.

    Detections are those kept for evaluation (the top ``max_dets`` per class), grouped by class and, within
    a class, in evaluation order. ``det_matched``/``det_ignored`` hold, bit-packed along the last axis, a
    bool per (area range, IoU threshold); use :meth:`matched` and :meth:`ignored` to read them.

    >>> s = match_image(np.array([[0., 0, 10, 10]]), np.array([0.9]), np.array([0]),
    ...                 np.array([[0., 0, 10, 10]]), np.array([0]))
    >>> bool(s.matched()[0, 0, 0]), len(s.det_cls)
    (True, 1)
    """

    image_id: int
    det_cls: np.ndarray  # (D,) int32
    det_scores: np.ndarray  # (D,) float64
    det_rank: np.ndarray  # (D,) int32, position within its (image, class) in score order
    det_matched: np.ndarray  # (D, ceil(A*T/8)) uint8, packed bool (D, A, T)
    det_ignored: np.ndarray  # (D, ceil(A*T/8)) uint8, packed bool (D, A, T)
    gt_cls: np.ndarray  # (G,) int32
    gt_ignored: np.ndarray  # (G, A) bool: crowd, or area outside the range

    def matched(self) -> np.ndarray:
        """(D, A, T) bool: the detection found a ground truth at that area range and IoU threshold."""
        return _unpack(self.det_matched)

    def ignored(self) -> np.ndarray:
        """(D, A, T) bool: the detection counts neither as a true nor as a false positive there."""
        return _unpack(self.det_ignored)


def match_image(
    det_xyxy: Any,
    det_scores: Any,
    det_cls: Any,
    gt_xyxy: Any,
    gt_cls: Any,
    gt_area: Any | None = None,
    gt_crowd: Any | None = None,
    max_dets: int = 100,
    *,
    image_id: int = -1,
) -> ImageStats:
    """Match one image's detections to its ground truth (corner boxes in pixels) the COCO way.

    ``gt_area`` is what the area ranges use (COCO json keeps it apart from the box; default ``w * h``);
    ``gt_crowd`` marks crowd boxes. ``image_id`` orders images in :func:`coco_summary`, which decides
    ties in score across images exactly as the reference does. Numpy arrays or CPU/GPU tensors work.

    >>> s = match_image(np.array([[0., 0, 10, 10], [20, 20, 30, 30]]), np.array([0.9, 0.8]), np.array([1, 1]),
    ...                 np.array([[0., 0, 10, 9]]), np.array([1]), image_id=7)
    >>> s.matched()[:, 0, 0].tolist()  # area "all", IoU 0.5
    [True, False]
    """
    det = _as_f64(det_xyxy).reshape(-1, 4)
    gt = _as_f64(gt_xyxy).reshape(-1, 4)
    det_ltwh = np.concatenate((det[:, :2], det[:, 2:] - det[:, :2]), 1)
    gt_ltwh = np.concatenate((gt[:, :2], gt[:, 2:] - gt[:, :2]), 1)
    return match_image_coco(
        det_ltwh, det_scores, det_cls, gt_ltwh, gt_cls, gt_area, gt_crowd, max_dets, image_id=image_id
    )


def match_image_coco(
    det_ltwh: Any,
    det_scores: Any,
    det_cls: Any,
    gt_ltwh: Any,
    gt_cls: Any,
    gt_area: Any | None = None,
    gt_crowd: Any | None = None,
    max_dets: int = 100,
    *,
    image_id: int = -1,
    gt_ids: Any | None = None,
) -> ImageStats:
    """:func:`match_image` for COCO ``[x_min, y_min, w, h]`` boxes, bit for bit as the reference sees them.

    >>> s = match_image_coco(np.array([[0., 0, 10, 10]]), np.array([0.5]), np.array([0]),
    ...                      np.array([[0., 0, 10, 10]]), np.array([0]), gt_crowd=np.array([True]))
    >>> bool(s.ignored()[0, 0, 0])  # a detection on a crowd box is neither right nor wrong
    True

    ``gt_ids`` (the annotations' ids) only matters for an id of 0: the reference stores matches by id and
    so counts a detection matched to annotation 0 as unmatched, while the annotation is used up.
    """
    det = _as_f64(det_ltwh).reshape(-1, 4)
    scores = _as_f64(det_scores).reshape(-1)
    dcls = _as_i32(det_cls).reshape(-1)
    gt = _as_f64(gt_ltwh).reshape(-1, 4)
    gcls = _as_i32(gt_cls).reshape(-1)
    n, m = len(det), len(gt)
    if len(scores) != n or len(dcls) != n:
        raise ValueError(f"detections disagree in length: {n} boxes, {len(scores)} scores, {len(dcls)} classes")
    if len(gcls) != m:
        raise ValueError(f"ground truth disagrees in length: {m} boxes, {len(gcls)} classes")
    area, crowd, counts = _gt_columns(gt, gt_area, gt_crowd, gt_ids)
    keep, rank = _evaluation_order(scores, dcls, max_dets)
    det, scores, dcls = det[keep], scores[keep], dcls[keep]

    gt_ignored = crowd[:, None] | (area[:, None] < AREA_RANGES[:, 0]) | (area[:, None] > AREA_RANGES[:, 1])
    det_area = det[:, 2] * det[:, 3]
    det_outside = (det_area[:, None] < AREA_RANGES[:, 0]) | (det_area[:, None] > AREA_RANGES[:, 1])  # (D, A)

    iou = coco_box_iou(det, gt, crowd)
    iou[dcls[:, None] != gcls[None, :]] = -1.0  # other classes never match
    matched, on_ignored = _greedy(iou, dcls, crowd, gt_ignored, counts)
    ignored = on_ignored | (~matched & det_outside[:, :, None])
    return ImageStats(
        image_id=int(image_id),
        det_cls=dcls,
        det_scores=scores,
        det_rank=rank,
        det_matched=_pack(matched),
        det_ignored=_pack(ignored),
        gt_cls=gcls,
        gt_ignored=gt_ignored,
    )


def _gt_columns(
    gt: np.ndarray, gt_area: Any | None, gt_crowd: Any | None, gt_ids: Any | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(area, crowd, counts) of the ``gt`` boxes (ltwh): as given, or ``w * h``, none crowd, every one counted
    (``counts``: False for an annotation of id 0, see :func:`match_image_coco`)."""
    m = len(gt)
    area = gt[:, 2] * gt[:, 3] if gt_area is None else _as_f64(gt_area).reshape(-1)
    crowd = np.zeros(m, bool) if gt_crowd is None else _as_np(gt_crowd).reshape(-1).astype(bool)
    counts = np.ones(m, bool) if gt_ids is None else _as_np(gt_ids).reshape(-1) != 0
    if len(area) != m or len(crowd) != m or len(counts) != m:
        raise ValueError(f"gt_area/gt_crowd/gt_ids must have one entry per ground truth box ({m})")
    return area, crowd, counts


def _evaluation_order(scores: np.ndarray, dcls: np.ndarray, max_dets: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices kept, rank within their class) of the detections in evaluation order: class by class, best score
    first (stable sorts keep the given order on ties), at most ``max_dets`` of each class."""
    order = np.argsort(-scores, kind="stable")
    order = order[np.argsort(dcls[order], kind="stable")]
    dcls_sorted = dcls[order]
    first_of_class = np.searchsorted(dcls_sorted, dcls_sorted, side="left")
    rank = np.arange(len(scores)) - first_of_class
    keep = order[rank < max_dets]
    return keep, rank[rank < max_dets].astype(np.int32)


def coco_box_iou(det_ltwh: np.ndarray, gt_ltwh: np.ndarray, gt_crowd: np.ndarray | None = None) -> np.ndarray:
    """(D, G) IoU of ``[x_min, y_min, w, h]`` boxes as the COCO reference computes it (no +1).

    For a crowd ground truth the union is the detection's own area.

    >>> coco_box_iou(np.array([[0., 0, 2, 2]]), np.array([[1., 0, 2, 2], [0, 0, 4, 4]]), np.array([False, True]))
    array([[0.33333333, 1.        ]])
    """
    d = det_ltwh[:, None, :]
    g = gt_ltwh[None, :, :]
    # The right/bottom edges are formed as x + w, as the reference does, so equal inputs give equal bits.
    w = np.minimum(d[..., 2] + d[..., 0], g[..., 2] + g[..., 0]) - np.maximum(d[..., 0], g[..., 0])
    h = np.minimum(d[..., 3] + d[..., 1], g[..., 3] + g[..., 1]) - np.maximum(d[..., 1], g[..., 1])
    inter = w * h
    d_area = d[..., 2] * d[..., 3]
    union = d_area + g[..., 2] * g[..., 3] - inter
    if gt_crowd is not None and len(gt_crowd):
        union = np.where(gt_crowd[None, :], np.broadcast_to(d_area, union.shape), union)
    overlap = (w > 0) & (h > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(overlap, inter / np.where(overlap, union, 1.0), 0.0)


def _greedy(
    iou: np.ndarray, det_cls: np.ndarray, crowd: np.ndarray, gt_ignored: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(D, A, T) matched and matched-to-an-ignored-gt flags for detections in evaluation order.

    Greedy matching is sequential within a class, but classes never compete for a ground truth, so the
    k-th candidate of every class is matched in the same vectorised step (all areas and thresholds too).
    """
    n, m = iou.shape
    matched = np.zeros((n, _A, _T), bool)
    on_ignored = np.zeros((n, _A, _T), bool)
    if n == 0 or m == 0:
        return matched, on_ignored
    # Only detections that reach the lowest threshold with some gt take part; the rest stay unmatched.
    cand = np.flatnonzero(iou.max(1) >= IOU_THRESHOLDS[0])
    if len(cand) == 0:
        return matched, on_ignored
    cand_cls = det_cls[cand]
    step = np.arange(len(cand)) - np.searchsorted(cand_cls, cand_cls, side="left")  # cand is class-grouped
    taken = np.zeros((_A, _T, m), bool)
    regular = ~gt_ignored.T[None, :, None, :]  # (1, A, 1, G)
    thr = np.minimum(IOU_THRESHOLDS, 1 - 1e-10)[None, None, :, None]
    for k in range(int(step.max()) + 1):
        rows = cand[step == k]
        ious = iou[rows][:, None, None, :]  # (S, 1, 1, G)
        ok = (ious >= thr) & (~taken | crowd)[None]  # (S, A, T, G)
        j_reg, has_reg = _last_argmax(np.where(ok & regular, ious, -1.0))
        j_ign, has_ign = _last_argmax(np.where(ok & ~regular, ious, -1.0))
        choice = np.where(has_reg, j_reg, j_ign)
        hit = has_reg | has_ign
        matched[rows] = hit & counts[choice]
        on_ignored[rows] = has_ign & ~has_reg
        s, a, t = np.nonzero(hit)
        taken[a, t, choice[s, a, t]] = True  # rows are of different classes, so never the same gt
    return matched, on_ignored


def _last_argmax(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index of the last maximum along the last axis, and whether that maximum is a real candidate (>= 0)."""
    g = values.shape[-1]
    j = g - 1 - np.argmax(values[..., ::-1], axis=-1)
    return j, np.take_along_axis(values, j[..., None], -1)[..., 0] >= 0


def _pack(flags: np.ndarray) -> np.ndarray:
    return np.packbits(flags.reshape(len(flags), _A * _T), axis=1)


def _unpack(packed: np.ndarray) -> np.ndarray:
    n = len(packed)
    return np.unpackbits(packed, axis=1, count=_A * _T).reshape(n, _A, _T).astype(bool)


def _as_np(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, possibly on a GPU
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _as_f64(x: Any) -> np.ndarray:
    return _as_np(x).astype(np.float64, copy=False)


def _as_i32(x: Any) -> np.ndarray:
    return _as_np(x).astype(np.int32, copy=False)
