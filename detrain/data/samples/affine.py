"""Geometry of the training augmentations: 3x3 matrices, one warp per source image, box bookkeeping.

Every geometric step (resize, mosaic placement, rotation, scale, shear, perspective, translation, flips) is
a 3x3 matrix in continuous pixel coordinates (an image spans ``[0, w] x [0, h]``; see ``instances.py``).
The steps are multiplied into ONE matrix per source image and each source is warped once, straight into
the output canvas: no intermediate 2x-size mosaic canvas, no second resampling, and the boxes move with
exactly the same matrix as the pixels.

The box filter is YOLO's candidate rule (:func:`box_candidates`): after a transform a box is kept only if
it is wider and taller than 2 px, keeps more than 10 % of its area (compared with the box scaled by the
random scale, so zooming out does not count as a loss) and its aspect ratio stays below 100.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cv2
import numpy as np

FILL = 114  # grey of the padding, as YOLO uses


def translation(tx: float, ty: float) -> np.ndarray:
    """Shift by (tx, ty). ``translation(2, 3) @ [0, 0, 1]`` -> ``[2, 3, 1]``."""
    return np.array([[1.0, 0.0, tx], [0.0, 1.0, ty], [0.0, 0.0, 1.0]])


def scaling(sx: float, sy: float) -> np.ndarray:
    """Scale about the origin. ``scaling(2, 3) @ [1, 1, 1]`` -> ``[2, 3, 1]``."""
    return np.array([[sx, 0.0, 0.0], [0.0, sy, 0.0], [0.0, 0.0, 1.0]])


def flip_matrix(width: float, height: float, lr: bool, ud: bool) -> np.ndarray:
    """Mirror a ``width`` x ``height`` image left-right and/or up-down (identity when both are False).

    >>> (flip_matrix(10, 4, lr=True, ud=False) @ [1.0, 1.0, 1.0]).tolist()
    [9.0, 1.0, 1.0]
    """
    m = np.eye(3)
    if lr:
        m[0, 0], m[0, 2] = -1.0, width
    if ud:
        m[1, 1], m[1, 2] = -1.0, height
    return m


def random_affine_matrix(
    rng: np.random.Generator,
    center_xy: tuple[float, float],
    out_wh: tuple[int, int],
    degrees: float = 0.0,
    translate: float = 0.1,
    scale: float = 0.5,
    shear: float = 0.0,
    perspective: float = 0.0,
) -> tuple[np.ndarray, float]:
    """YOLO's random perspective: move ``center_xy`` to the output centre, then perspective, rotate/scale, shear
    and translate by up to ``translate`` of the output size. Returns (3x3 matrix, the random scale).

    The draws happen in a fixed order and always (a zero range draws zero), so the stream of a generator does
    not depend on which augmentations are switched on.

    >>> m, s = random_affine_matrix(np.random.default_rng(0), (50, 50), (100, 100), translate=0, scale=0)
    >>> np.allclose(m, np.eye(3)), s
    (True, 1.0)
    """
    c = translation(-center_xy[0], -center_xy[1])
    p = np.eye(3)
    p[2, 0] = rng.uniform(-perspective, perspective)
    p[2, 1] = rng.uniform(-perspective, perspective)
    angle = math.radians(rng.uniform(-degrees, degrees))
    s = float(rng.uniform(1 - scale, 1 + scale))
    # Counter-clockwise on screen (y points down), as cv2.getRotationMatrix2D.
    r = np.array(
        [
            [s * math.cos(angle), s * math.sin(angle), 0.0],
            [-s * math.sin(angle), s * math.cos(angle), 0.0],
            [0.0, 0.0, 1.0],
        ]
    )
    sh = np.eye(3)
    sh[0, 1] = math.tan(math.radians(rng.uniform(-shear, shear)))
    sh[1, 0] = math.tan(math.radians(rng.uniform(-shear, shear)))
    t = translation(
        rng.uniform(0.5 - translate, 0.5 + translate) * out_wh[0],
        rng.uniform(0.5 - translate, 0.5 + translate) * out_wh[1],
    )
    return t @ sh @ r @ p @ c, s


def is_perspective(m: np.ndarray) -> bool:
    """Whether ``m`` has a projective row (needs warpPerspective and a divide)."""
    return bool(m[2, 0] != 0.0 or m[2, 1] != 0.0 or m[2, 2] != 1.0)


def transform_points(xy: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Points (n, 2) through the 3x3 ``m`` (with the perspective divide)."""
    pts = np.asarray(xy, dtype=np.float64).reshape(-1, 2) @ m[:2, :2].T + m[:2, 2]
    if is_perspective(m):
        w = np.asarray(xy, dtype=np.float64).reshape(-1, 2) @ m[2, :2] + m[2, 2]
        pts /= w[:, None]
    return pts


def transform_boxes(boxes_xyxy: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The axis-aligned boxes (n, 4) around the four transformed corners of each box."""
    n = len(boxes_xyxy)
    if n == 0:
        return np.zeros((0, 4), np.float32)
    b = boxes_xyxy
    if m[0, 1] == 0.0 and m[1, 0] == 0.0 and not is_perspective(m):  # scale + shift (+ flips): corners map to corners
        xs = b[:, [0, 2]] * m[0, 0] + m[0, 2]
        ys = b[:, [1, 3]] * m[1, 1] + m[1, 2]
        xs.sort(1)
        ys.sort(1)
        return np.stack((xs[:, 0], ys[:, 0], xs[:, 1], ys[:, 1]), 1).astype(np.float32)
    corners = np.stack((b[:, [0, 1]], b[:, [2, 1]], b[:, [0, 3]], b[:, [2, 3]]), 1).reshape(-1, 2)
    xy = transform_points(corners, m).reshape(n, 4, 2)
    return np.concatenate((xy.min(1), xy.max(1)), 1).astype(np.float32)


def clip_boxes(boxes_xyxy: np.ndarray, x1: float, y1: float, x2: float, y2: float) -> np.ndarray:
    """Boxes clipped to the rectangle [x1, x2] x [y1, y2] (a new array)."""
    return boxes_xyxy.clip(np.array([x1, y1, x1, y1], boxes_xyxy.dtype), np.array([x2, y2, x2, y2], boxes_xyxy.dtype))


def box_candidates(
    before_xyxy: np.ndarray,
    after_xyxy: np.ndarray,
    scale: float = 1.0,
    wh_thr: float = 2.0,
    area_thr: float = 0.1,
    ar_thr: float = 100.0,
    eps: float = 1e-16,
) -> np.ndarray:
    """YOLO's rule for boxes that survive a transform (bool mask).

    A box is kept if, after the transform (and clipping), it is wider and taller than ``wh_thr`` px, its area is
    more than ``area_thr`` of its area before times ``scale**2`` (the augmentation's own zoom does not count as
    a loss) and its aspect ratio max(w/h, h/w) is below ``ar_thr``.

    >>> box_candidates(np.array([[0, 0, 10, 10.]]), np.array([[0, 0, 10, 0.5]])).tolist()  # a sliver
    [False]
    """
    w1 = (before_xyxy[:, 2] - before_xyxy[:, 0]) * scale
    h1 = (before_xyxy[:, 3] - before_xyxy[:, 1]) * scale
    w2 = after_xyxy[:, 2] - after_xyxy[:, 0]
    h2 = after_xyxy[:, 3] - after_xyxy[:, 1]
    ar = np.maximum(w2 / (h2 + eps), h2 / (w2 + eps))
    return (w2 > wh_thr) & (h2 > wh_thr) & (w2 * h2 / (w1 * h1 + eps) > area_thr) & (ar < ar_thr)


@dataclass(frozen=True)
class WarpPlan:
    """How :func:`apply_warp` moves a source into a canvas, worked out from shapes alone (no pixels) by
    :func:`plan_warp`, so the labels and a renderer elsewhere (``device_render.py``) follow the very same geometry.

    ``matrix``: source pixels -> canvas as applied; ``rect``: the source pixels read (x1, y1, x2, y2); ``dst``:
    for the scale + shift fast path, the whole destination pixels (x1, y1, x2, y2, before clipping to the canvas)
    that ``rect`` is resized onto; None for the general (bilinear, transparent border) warp."""

    matrix: np.ndarray
    rect: tuple[int, int, int, int]
    dst: tuple[int, int, int, int] | None = None


def plan_warp(
    src_hw: tuple[int, int], canvas_hw: tuple[int, int], m: np.ndarray, src_rect: tuple[int, int, int, int] | None
) -> WarpPlan | None:
    """The :class:`WarpPlan` of ``m`` (continuous coordinates, src -> canvas) for a source of ``src_hw`` pixels (only
    its ``src_rect`` = x1, y1, x2, y2 when given) into a canvas of ``canvas_hw``; None when nothing is drawn (then
    the matrix applied counts as ``m``).

    The plan's matrix is ``m`` itself, except for a pure scale + translation (+ flips, the default augmentation):
    that case uses ``cv2.resize`` of the part that lands in the output and a paste, which is several times faster
    than ``cv2.warpAffine``, on whole destination pixels; the matrix applied then differs from ``m`` by at most half
    a pixel of shift (and the matching tiny scale change), and labels must move with it."""
    h, w = src_hw
    x1, y1, x2, y2 = src_rect if src_rect is not None else (0, 0, w, h)
    if x1 >= x2 or y1 >= y2:
        return None
    if not is_perspective(m) and m[0, 1] == 0.0 and m[1, 0] == 0.0 and m[0, 0] != 0.0 and m[1, 1] != 0.0:
        return _plan_scaled(canvas_hw, m, (x1, y1, x2, y2))
    return WarpPlan(m, (x1, y1, x2, y2))


def apply_warp(canvas: np.ndarray, src: np.ndarray, plan: WarpPlan) -> None:
    """Draw ``src`` (HWC uint8) into ``canvas`` in place as ``plan`` (from :func:`plan_warp`) says. Only the canvas
    pixels that the (restricted) source covers change, so several sources compose on one canvas like tiles, and
    the work is limited to the area the source covers in the output.

    >>> canvas = np.zeros((4, 4, 3), np.uint8)
    >>> apply_warp(canvas, np.full((2, 2, 3), 9, np.uint8), plan_warp((2, 2), (4, 4), translation(1, 1), None))
    >>> canvas[..., 0].tolist()
    [[0, 0, 0, 0], [0, 9, 9, 0], [0, 9, 9, 0], [0, 0, 0, 0]]
    """
    x1, y1, x2, y2 = plan.rect
    if plan.dst is None:
        _warp_general(canvas, src[y1:y2, x1:x2], plan.matrix @ translation(x1, y1))
    else:
        _paste_scaled(canvas, src, plan)


def _scaled_span(s: float, t: float, a: int, b: int, n: int) -> tuple[int, int, int, int] | None:
    """For the map ``X = s * x + t`` of source pixels [a, b] into an output axis of n pixels: the source pixels
    [sa, sb] that reach the output and whole destination pixels [da, db] they go to (None if nothing lands)."""
    lo, hi = sorted((s * a + t, s * b + t))
    lo, hi = max(lo, 0.0), min(hi, float(n))
    if lo >= hi:
        return None
    xa, xb = sorted(((lo - t) / s, (hi - t) / s))
    sa, sb = max(math.floor(xa), a), min(math.ceil(xb), b)
    if sa >= sb:
        return None
    da, db = sorted((round(s * sa + t), round(s * sb + t)))
    return (sa, sb, da, db) if da < db else None


def _plan_scaled(canvas_hw: tuple[int, int], m: np.ndarray, rect: tuple[int, int, int, int]) -> WarpPlan | None:
    ch, cw = canvas_hw
    sx, tx, sy, ty = m[0, 0], m[0, 2], m[1, 1], m[1, 2]
    span_x = _scaled_span(sx, tx, rect[0], rect[2], cw)
    span_y = _scaled_span(sy, ty, rect[1], rect[3], ch)
    if span_x is None or span_y is None:
        return None
    (sax, sbx, dax, dbx), (say, sby, day, dby) = span_x, span_y
    # What is applied: source [sa, sb] onto destination [da, db], reversed where flipped.
    ex, ey = (dbx - dax) / (sbx - sax), (dby - day) / (sby - say)
    fx = (ex, dax - ex * sax) if sx > 0 else (-ex, dbx + ex * sax)
    fy = (ey, day - ey * say) if sy > 0 else (-ey, dby + ey * say)
    applied = np.array([[fx[0], 0.0, fx[1]], [0.0, fy[0], fy[1]], [0.0, 0.0, 1.0]])
    return WarpPlan(applied, (sax, say, sbx, sby), (dax, day, dbx, dby))


def _paste_scaled(canvas: np.ndarray, src: np.ndarray, plan: WarpPlan) -> None:
    assert plan.dst is not None
    ch, cw = canvas.shape[:2]
    sx, sy = plan.matrix[0, 0], plan.matrix[1, 1]
    (sax, say, sbx, sby), (dax, day, dbx, dby) = plan.rect, plan.dst
    crop = src[say:sby, sax:sbx]
    size = (dbx - dax, dby - day)
    out = crop if size == (sbx - sax, sby - say) else cv2.resize(crop, size, interpolation=cv2.INTER_LINEAR)
    ox0, oy0, ox1, oy1 = max(dax, 0), max(day, 0), min(dbx, cw), min(dby, ch)
    # The part of (the flipped) ``out`` inside the canvas, as rows/cols of the unflipped ``out``.
    c0, c1 = (ox0 - dax, ox1 - dax) if sx > 0 else (dbx - ox1, dbx - ox0)
    r0, r1 = (oy0 - day, oy1 - day) if sy > 0 else (dby - oy1, dby - oy0)
    part, dst = out[r0:r1, c0:c1], canvas[oy0:oy1, ox0:ox1]
    if sx > 0 and sy > 0:
        dst[...] = part
    else:  # cv2.flip writes into the view; a negative-stride numpy copy is ten times slower
        cv2.flip(part, 1 if sy > 0 else 0 if sx > 0 else -1, dst=dst)


def _warp_general(canvas: np.ndarray, src: np.ndarray, m: np.ndarray) -> None:
    """Any 3x3 warp of the whole ``src`` into the part of ``canvas`` it covers (bilinear)."""
    h, w = src.shape[:2]
    ch, cw = canvas.shape[:2]
    projective = is_perspective(m)
    corners = np.array([[0, 0], [w, 0], [0, h], [w, h]], np.float64)
    denominators = corners @ m[2, :2] + m[2, 2]
    if projective and (denominators <= 1e-6).any():
        x0, y0, x1, y1 = 0, 0, cw, ch  # the source crosses the horizon: its bounding box is unbounded
    else:
        xy = transform_points(corners, m)
        x0, y0 = max(math.floor(xy[:, 0].min()) - 1, 0), max(math.floor(xy[:, 1].min()) - 1, 0)
        x1, y1 = min(math.ceil(xy[:, 0].max()) + 1, cw), min(math.ceil(xy[:, 1].max()) + 1, ch)
    if x0 >= x1 or y0 >= y1:
        return
    # cv2 addresses pixel centres by their index (centre of pixel j is x = j), we by j + 0.5.
    mi = translation(-0.5 - x0, -0.5 - y0) @ m @ translation(0.5, 0.5)
    dst = canvas[y0:y1, x0:x1]
    size = (x1 - x0, y1 - y0)
    # BORDER_TRANSPARENT leaves the canvas where the source does not reach, so earlier tiles stay.
    if projective:
        out = cv2.warpPerspective(src, mi, size, dst=dst, flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_TRANSPARENT)
    else:
        out = cv2.warpAffine(src, mi[:2], size, dst=dst, flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_TRANSPARENT)
    if not np.shares_memory(out, canvas):  # cv2 only writes in place into a uint8 HWC view of the right size
        raise RuntimeError(f"apply_warp needs a writable uint8 (H, W, 3) canvas, got {canvas.dtype} {canvas.shape}")
