"""Precision, recall and F1 as functions of the confidence threshold, and the F1-optimal confidence.

YOLO tools report one P and one R per class: the values at the confidence where the mean F1 over classes
(smoothed with a box filter 0.1 wide) peaks. We do the same, in the same way, so that users read the
numbers they know:

* true positives are the COCO matches at IoU 0.5 (area "all", top 100 per image and class); detections
  the COCO rules ignore (on crowds) count as neither TP nor FP;
* precision and recall are known at each detection's score and linearly interpolated in between on a
  1000-point confidence grid, as YOLO tools do (on the reference yolov8n predictions this gives
  Ultralytics' P and R to 1e-6); the exact step function (``score >= c``) sits on sawtooth peaks and reads
  several points higher;
* above the highest score, precision is 1 and recall 0; a class that is never predicted has both 0.
"""

from __future__ import annotations

import numpy as np

CONF_GRID: np.ndarray = np.linspace(0.0, 1.0, 1000)


def confidence_curves(
    scores_desc: np.ndarray, is_tp: np.ndarray, n_gt: int, grid: np.ndarray = CONF_GRID
) -> tuple[np.ndarray, np.ndarray]:
    """Precision and recall of one class at each confidence in ``grid`` (scores sorted descending).

    >>> p, r = confidence_curves(np.array([0.8, 0.4]), np.array([True, False]), 2, np.array([0.0, 0.6, 0.9]))
    >>> np.round(p, 6).tolist(), r.tolist()
    ([0.5, 0.75, 1.0], [0.5, 0.5, 0.0])
    """
    if len(scores_desc) == 0:
        return np.zeros(len(grid)), np.zeros(len(grid))
    n_tp = np.cumsum(is_tp)
    precision_at_det = n_tp / np.arange(1, len(n_tp) + 1)
    recall_at_det = n_tp / max(n_gt, 1)
    # np.interp wants increasing x: walk the confidences from high to low as -score.
    precision = np.interp(-grid, -scores_desc, precision_at_det, left=1.0)
    recall = np.interp(-grid, -scores_desc, recall_at_det, left=0.0)
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
    half = round(len(values) * fraction)
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
