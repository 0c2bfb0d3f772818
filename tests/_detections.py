"""Compare two sets of detections that should be the same model's, computed by different float kernels.

An export served by onnxruntime or TorchScript, or the same ``.pt`` on another CPU, computes its float32 sums in
another order: scores move by rounding (TorchScript's were 2e-4 from the ``.pt``'s on an AMD EPYC, 0 on a Xeon), and
where two boxes' scores are closer than that, NMS (or a top-k) may keep the other one. Comparing row for row then
fails on a correct export. What float rounding cannot do is invent a detection or drop one that no other detection
explains, so the comparison is exact about those:

* every row of one set is a candidate of the reference: a box the reference's network gave before NMS (same class,
  score within ``SCORE_TOL``, corners within ``BOX_TOL`` pixels);
* every row of one set that the other lacks is explained by NMS or a limit under a score change of ``SCORE_TOL``:
  the other set keeps a box of its class that overlaps it past the NMS threshold with a score no lower than its own
  less twice the tolerance (it may rank first under rounding and suppress it), or its score lies within twice the
  tolerance of the confidence threshold or of the lowest kept score when the set is full (``max_det``).

A broken export (a shifted box, scores off by more than rounding, a swapped class) fails the first rule.
"""

from __future__ import annotations

import numpy as np

# Tolerances grounded in what float32 kernels were seen to differ by, with room: scores 2e-4 apart on an AMD EPYC
# (sigmoids of logits some 1e-3 apart), box corners well under a hundredth of a pixel.
SCORE_TOL = 1e-3
BOX_TOL = 0.1  # pixels


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every (x1 y1 x2 y2) box of ``a`` with every one of ``b``: (len(a), len(b))."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:4], b[None, :, 2:4])
    inter = np.clip(rb - lt, 0, None).prod(-1)
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    return inter / np.maximum(area_a[:, None] + area_b[None, :] - inter, 1e-9)


def _close(a: np.ndarray, b: np.ndarray, score_tol: float, box_tol: float) -> np.ndarray:
    """(len(a), len(b)): row i of ``a`` and row j of ``b`` are one detection up to rounding."""
    box = np.abs(a[:, None, :4] - b[None, :, :4]).max(-1)
    score = np.abs(a[:, None, 4] - b[None, :, 4])
    return (box <= box_tol) & (score <= score_tol) & (a[:, None, 5] == b[None, :, 5])


def _unexplained(
    rows: np.ndarray, other: np.ndarray, iou: float, conf: float, max_det: int, score_tol: float, box_tol: float
) -> np.ndarray:
    """The rows of ``rows`` that ``other`` neither holds nor explains by suppression or a limit."""
    if not len(rows):
        return rows
    held = _close(rows, other, score_tol, box_tol).any(1) if len(other) else np.zeros(len(rows), bool)
    slack = 2 * score_tol
    if len(other):
        overlap = box_iou(rows[:, :4], other[:, :4]) > iou - 0.01
        rival = (other[None, :, 4] >= rows[:, None, 4] - slack) & (other[None, :, 5] == rows[:, None, 5])
        suppressed = (overlap & rival).any(1)
        at_limit = (len(other) >= max_det) & (rows[:, 4] <= other[:, 4].min() + slack)
    else:
        suppressed = at_limit = np.zeros(len(rows), bool)
    at_conf = rows[:, 4] <= conf + slack
    return rows[~(held | suppressed | at_limit | at_conf)]


def assert_same_detections(
    got: np.ndarray,
    want: np.ndarray,
    candidates: np.ndarray,
    *,
    iou: float = 0.7,
    conf: float = 0.01,
    max_det: int = 300,
    score_tol: float = SCORE_TOL,
    box_tol: float = BOX_TOL,
) -> None:
    """``got`` and ``want`` (n, 6: x1 y1 x2 y2 conf cls) are one model's detections up to float rounding.

    ``candidates`` are the reference's boxes before suppression (``predict(iou=1.0, max_det=large)``), ``iou``,
    ``conf`` and ``max_det`` the settings both sets were made with."""
    got, want, candidates = (np.asarray(x, dtype=np.float64).reshape(-1, 6) for x in (got, want, candidates))
    assert len(want), "no reference detections to compare"
    if len(got):
        real = _close(got, candidates, score_tol, box_tol).any(1)
        assert real.all(), f"{(~real).sum()} of {len(got)} rows are no box of the reference: {got[~real][:3]}"
    for rows, other, name in ((got, want, "got"), (want, got, "want")):
        lost = _unexplained(rows, other, iou, conf, max_det, score_tol, box_tol)
        assert not len(lost), f"{len(lost)} rows of {name} missing from the other set, unexplained: {lost[:3]}"
