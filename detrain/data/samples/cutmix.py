"""CutMix for detection: a rectangle of another training sample pasted into this one, with the boxes inside it.

The rule (as Ultralytics' CutMix, 8.3+): draw a few candidate rectangles, each of area ``1 - lam`` of the image
(``lam ~ Beta(1, 1)``, the same fraction of width and height) around a uniform random centre, clipped to the
image; keep those that overlap no box of the sample, so no object of the sample loses pixels it is labelled
by; pick one of them. The partner's boxes are clipped to the rectangle and kept by YOLO's candidate rule
(``affine.box_candidates``: more than 10 % of the box inside, wider and taller than 2 px). A rectangle that would
bring no box is not pasted. Without a free rectangle the sample stays as it is.

All draws (:func:`cutmix_areas` and the ``pick`` in [0, 1)) happen before anything is rendered, so a training
sample stays a function of its (seed, epoch, index) generator: which rectangle is free is known only once the
sample's boxes are, and ``pick`` chooses among the free ones then (:func:`choose_area`). ``train_sample.py``
plans the draws, places the chosen rectangle of the partner with its boxes (``place_sample``: none if it holds no
box) and renders only that rectangle over the sample (``render_geometry``; ``device_render.draw_sample`` on the
training device).
"""

from __future__ import annotations

import numpy as np

CUTMIX_AREAS = 3  # candidate rectangles per sample
CUTMIX_BETA = 1.0  # lam ~ Beta(1, 1): the pasted fraction of the area is uniform


def cutmix_areas(rng: np.random.Generator, w: int, h: int, n: int = CUTMIX_AREAS) -> np.ndarray:
    """``n`` candidate rectangles (n, 4) int64 ``x1 y1 x2 y2`` in a ``w`` x ``h`` image.

    >>> a = cutmix_areas(np.random.default_rng(0), 100, 50)
    >>> a.shape, bool((a[:, [0, 2]] <= 100).all() and (a[:, [1, 3]] <= 50).all() and (a[:, :2] <= a[:, 2:]).all())
    ((3, 4), True)
    """
    lam = rng.beta(CUTMIX_BETA, CUTMIX_BETA, n)
    cut = np.sqrt(1.0 - lam)
    half_w, half_h = (w * cut).astype(np.int64) // 2, (h * cut).astype(np.int64) // 2
    cx, cy = rng.integers(w, size=n), rng.integers(h, size=n)
    return np.stack(
        (
            np.clip(cx - half_w, 0, w),
            np.clip(cy - half_h, 0, h),
            np.clip(cx + half_w, 0, w),
            np.clip(cy + half_h, 0, h),
        ),
        1,
    ).astype(np.int64)


def free_areas(areas: np.ndarray, boxes_xyxy: np.ndarray) -> np.ndarray:
    """Which rectangles (bool per row) have room (positive area) and overlap no box by a positive area.

    >>> free_areas(np.array([[0, 0, 10, 10], [20, 0, 30, 10], [5, 5, 5, 9]]), np.array([[8, 8, 12, 12.]])).tolist()
    [False, True, False]
    """
    a = np.asarray(areas, np.float64).reshape(-1, 4)
    b = np.asarray(boxes_xyxy, np.float64).reshape(-1, 4)
    room = (a[:, 2] > a[:, 0]) & (a[:, 3] > a[:, 1])
    iw = np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0])
    ih = np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1])
    return room & ~((iw > 0) & (ih > 0)).any(1)


def choose_area(areas: np.ndarray, boxes_xyxy: np.ndarray, pick: float) -> tuple[int, int, int, int] | None:
    """The free rectangle ``pick`` (in [0, 1)) falls on, or None when none is free.

    >>> choose_area(np.array([[0, 0, 4, 4], [10, 10, 14, 14]]), np.zeros((0, 4)), 0.7)
    (10, 10, 14, 14)
    """
    free = np.asarray(areas).reshape(-1, 4)[free_areas(areas, boxes_xyxy)]
    if not len(free):
        return None
    return tuple(int(v) for v in free[min(int(pick * len(free)), len(free) - 1)])  # type: ignore[return-value]
