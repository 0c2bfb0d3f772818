"""Precision, recall and F1 as functions of the confidence threshold, and the F1-optimal confidence.

YOLO tools report one P and one R per class: the values at the confidence where the mean F1 over classes
(smoothed with a box filter) peaks. We do the same, with two choices spelled out:

* the curves are exact step functions: at confidence ``c`` the kept detections are those with
  ``score >= c`` (what a user gets with ``conf=c``), rather than linear interpolation between detections;
* true positives are the COCO matches at IoU 0.5 (area "all", top 100 per image and class), and
  detections the COCO rules ignore (on crowds) count as neither TP nor FP;
* the precision of an empty set is 1 for a class that has detections at all (the curve starts at 1 at
  high confidence) and 0 for a class the model never predicts, as YOLO tools do.
"""

from __future__ import annotations

import numpy as np

CONF_GRID: np.ndarray = np.linspace(0.0, 1.0, 1000)


def confidence_curves(scores_desc: np.ndarray, is_tp: np.ndarray, n_gt: int,
                      grid: np.ndarray = CONF_GRID) -> tuple[np.ndarray, np.ndarray]:
    """Precision and recall of one class at each confidence in ``grid`` (scores sorted descending).

    >>> p, r = confidence_curves(np.array([0.9, 0.4]), np.array([True, False]), 2, np.array([0.0, 0.5, 0.95]))
    >>> p.tolist(), r.tolist()
    ([0.5, 1.0, 1.0], [0.5, 0.5, 0.0])
    """
    if len(scores_desc) == 0:
        return np.zeros(len(grid)), np.zeros(len(grid))
    tp = np.concatenate(([0], np.cumsum(is_tp)))
    kept = np.searchsorted(-scores_desc, -grid, side="right")  # number of scores >= each threshold
    n_tp = tp[kept].astype(np.float64)
    precision = np.where(kept > 0, n_tp / np.maximum(kept, 1), 1.0)
    recall = n_tp / max(n_gt, 1)
    return precision, recall


def f1_score(precision: np.ndarray, recall: np.ndarray) -> np.ndarray:
    """Harmonic mean, 0 where both are 0. ``f1_score(np.array([1.0]), np.array([0.5]))`` -> ``[0.667]``."""
    total = precision + recall
    return np.where(total > 0, 2 * precision * recall / np.where(total > 0, total, 1.0), 0.0)


def smooth(values: np.ndarray, fraction: float = 0.05) -> np.ndarray:
    """Box-filter a curve over a window of ``2 * fraction`` of its length, edges padded with edge values.

    >>> smooth(np.array([0.0, 0.0, 3.0, 0.0, 0.0]), fraction=0.2).tolist()
    [0.0, 1.0, 1.0, 1.0, 0.0]
    """
    half = int(round(len(values) * fraction))
    if half == 0 or len(values) == 0:
        return values.astype(np.float64)
    padded = np.concatenate((np.full(half, values[0]), values, np.full(half, values[-1])))
    return np.convolve(padded, np.ones(2 * half + 1) / (2 * half + 1), mode="valid")


def best_f1_index(f1_per_class: np.ndarray) -> int:
    """Grid index where the smoothed mean F1 over classes (rows) is highest; 0 when there are no classes.

    >>> best_f1_index(np.array([[0.1, 0.8, 0.2]]))
    1
    """
    if len(f1_per_class) == 0:
        return 0
    return int(np.argmax(smooth(f1_per_class.mean(0))))
