"""The numbers a user reads: the 12 COCO summary values, per-class P/R/AP and the curves behind them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from detrain.metrics.accumulate import accumulate, pool
from detrain.metrics.curves import CONF_GRID, best_f1_index, confidence_curves, f1_score
from detrain.metrics.match import AREA_NAMES, MAX_DETS, RECALL_THRESHOLDS, ImageStats

# The 12 values of the reference's summarize(): (is AP, IoU index or None for the mean, area, max dets).
_COCO_SUMMARY: tuple[tuple[str, bool, int | None, str, int], ...] = (
    ("map", True, None, "all", 100),
    ("map50", True, 0, "all", 100),
    ("map75", True, 5, "all", 100),
    ("map_small", True, None, "small", 100),
    ("map_medium", True, None, "medium", 100),
    ("map_large", True, None, "large", 100),
    ("ar1", False, None, "all", 1),
    ("ar10", False, None, "all", 10),
    ("ar100", False, None, "all", 100),
    ("ar_small", False, None, "small", 100),
    ("ar_medium", False, None, "medium", 100),
    ("ar_large", False, None, "large", 100),
)
SUMMARY_KEYS: tuple[str, ...] = tuple(row[0] for row in _COCO_SUMMARY)


@dataclass
class DetMetrics:
    """Detection metrics of a validation run, COCO-exact where COCO defines them.

    The 12 ``map*``/``ar*`` values equal pycocotools' ``stats`` (-1 where no class has ground truth in that
    area range). ``precision``/``recall`` are the means over classes of P and R at the confidence where the
    smoothed mean F1 peaks (``conf``), as YOLO tools report. ``fitness`` is mAP50-95 (0 where undefined): the
    figure a run reports, so ``best.pt`` is the checkpoint that reports best (as Ultralytics 8.4 picks it).

    >>> m = coco_summary([], nc=2)
    >>> m.map, m.as_dict()["fitness"]
    (-1.0, 0.0)
    """

    map: float
    map50: float
    map75: float
    map_small: float
    map_medium: float
    map_large: float
    ar1: float
    ar10: float
    ar100: float
    ar_small: float
    ar_medium: float
    ar_large: float
    precision: float
    recall: float
    fitness: float
    conf: float  # the F1-optimal confidence behind precision/recall
    # {class_id: {"p", "r", "ap50", "ap", "n_gt", "n_images"}} for classes with ground truth
    per_class: dict[int, dict[str, float]] = field(default_factory=dict)
    curve_classes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # (K,) rows below
    recall_grid: np.ndarray = field(default_factory=lambda: RECALL_THRESHOLDS.copy())  # (101,)
    pr_curve: np.ndarray = field(default_factory=lambda: np.zeros((0, len(RECALL_THRESHOLDS))))  # (K, 101)
    conf_grid: np.ndarray = field(default_factory=lambda: CONF_GRID.copy())  # (1000,)
    p_curve: np.ndarray = field(default_factory=lambda: np.zeros((0, len(CONF_GRID))))  # (K, 1000)
    r_curve: np.ndarray = field(default_factory=lambda: np.zeros((0, len(CONF_GRID))))
    f1_curve: np.ndarray = field(default_factory=lambda: np.zeros((0, len(CONF_GRID))))
    coco_precision: np.ndarray | None = None  # the reference's precision[T, R, K, A, M]
    coco_recall: np.ndarray | None = None  # the reference's recall[T, K, A, M]

    def as_dict(self) -> dict[str, float]:
        """Scalar metrics by name (the 12 COCO values, precision, recall, fitness), e.g. for results.csv."""
        keys = (*SUMMARY_KEYS, "precision", "recall", "fitness")
        return {k: float(getattr(self, k)) for k in keys}

    def coco_stats(self) -> np.ndarray:
        """The 12 values in the order of pycocotools' ``COCOeval.stats``."""
        return np.array([getattr(self, k) for k in SUMMARY_KEYS])


def coco_summary(stats: Sequence[ImageStats], nc: int) -> DetMetrics:
    """Accumulate per-image statistics (any order; sorted here by ``image_id``) into :class:`DetMetrics`.

    >>> from detrain.metrics.match import match_image
    >>> s = match_image(np.array([[0., 0, 10, 10]]), np.array([0.9]), np.array([0]),
    ...                 np.array([[0., 0, 10, 10]]), np.array([0]), image_id=1)
    >>> round(coco_summary([s], nc=1).map, 6)
    1.0
    """
    pooled = pool(stats, nc)
    precision, recall = accumulate(pooled)
    values: dict[str, Any] = {}
    for name, is_ap, iou_index, area, max_det in _COCO_SUMMARY:
        a, m = AREA_NAMES.index(area), MAX_DETS.index(max_det)
        table = precision[..., a, m] if is_ap else recall[..., a, m]
        if iou_index is not None:
            table = table[iou_index]
        valid = table[table > -1]
        values[name] = float(np.mean(valid)) if valid.size else -1.0

    classes = np.flatnonzero(pooled.n_gt[:, 0] > 0)
    p_curve, r_curve = _conf_curves(pooled, classes)
    f1_curve = f1_score(p_curve, r_curve)
    best = best_f1_index(f1_curve)
    per_class = {}
    for row, k in enumerate(classes.tolist()):
        per_class[k] = {
            "p": float(p_curve[row, best]),
            "r": float(r_curve[row, best]),
            "ap50": float(np.mean(precision[0, :, k, 0, -1])),
            "ap": float(np.mean(precision[:, :, k, 0, -1])),
            "n_gt": int(pooled.n_gt[k, 0]),
            "n_images": int(pooled.n_images[k]),
        }
    mean_p = float(p_curve[:, best].mean()) if len(classes) else 0.0
    mean_r = float(r_curve[:, best].mean()) if len(classes) else 0.0
    # -1 ("no ground truth") must not look better than 0 when picking the best checkpoint.
    fitness = max(values["map"], 0.0)
    return DetMetrics(
        **values,
        precision=mean_p,
        recall=mean_r,
        fitness=fitness,
        conf=float(CONF_GRID[best]),
        per_class=per_class,
        curve_classes=classes,
        pr_curve=precision[0, :, :, 0, -1][:, classes].T.copy(),
        p_curve=p_curve,
        r_curve=r_curve,
        f1_curve=f1_curve,
        coco_precision=precision,
        coco_recall=recall,
    )


def _conf_curves(pooled: Any, classes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(K, 1000) precision and recall over confidence at IoU 0.5, area "all", top 100 per image and class."""
    p_rows, r_rows = [], []
    for k in classes.tolist():
        lo, hi = pooled.class_start[k], pooled.class_start[k + 1]
        counted = (pooled.rank[lo:hi] < MAX_DETS[-1]) & ~pooled.ignored[lo:hi, 0, 0]
        p, r = confidence_curves(
            pooled.scores[lo:hi][counted], pooled.matched[lo:hi, 0, 0][counted], int(pooled.n_gt[k, 0])
        )
        p_rows.append(p)
        r_rows.append(r)
    if not p_rows:
        return np.zeros((0, len(CONF_GRID))), np.zeros((0, len(CONF_GRID)))
    return np.stack(p_rows), np.stack(r_rows)
