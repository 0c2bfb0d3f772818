"""Render source images ("tiles") through one matrix each into the output image, and move their labels.

A tile sits on a virtual canvas (the 2x mosaic canvas, or just the image itself) at ``origin_xy`` with size
``size_wh``; what lies outside the canvas is cut, as YOLO's mosaic cuts it. The canvas is never allocated: each
tile is warped straight into the output with ``m @ placement @ resize`` (see ``affine.plan_warp``), whatever the
resolution of its pixels (decoded at reduced scale, or from a cache at load size). The pixels span the whole tile,
except a reduced JPEG decode that overhangs its file (``image_io.pixel_extent``): it is placed by its true scale.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from detrain.data.image_io import pixel_extent
from detrain.data.samples.affine import (
    FILL,
    WarpPlan,
    apply_warp,
    box_candidates,
    clip_boxes,
    plan_warp,
    scaling,
    transform_boxes,
    translation,
)
from detrain.data.samples.instances import Labels


@dataclass
class Tile:
    """One source image on the canvas: ``pixels`` (H, W, 3) uint8 at any resolution, shown at ``size_wh``
    with its top-left corner at ``origin_xy``; ``labels`` in pixels of the ``size_wh`` image. The pixels cover
    the image exactly, or the fractions of it that ``image_io.pixel_extent(pixels)`` gives."""

    pixels: np.ndarray
    size_wh: tuple[int, int]
    origin_xy: tuple[float, float]
    labels: Labels

    @property
    def pixels_hw(self) -> tuple[int, int]:
        """The pixels' (H, W)."""
        h, w = self.pixels.shape[:2]
        return h, w

    @property
    def extent(self) -> tuple[float, float, float, float]:
        """The part of the image the pixels span (``image_io.pixel_extent``)."""
        return pixel_extent(self.pixels)


class TileShape(Protocol):
    """What placing a tile needs: a :class:`Tile` without its pixels (only their size and extent)."""

    @property
    def size_wh(self) -> tuple[int, int]: ...
    @property
    def origin_xy(self) -> tuple[float, float]: ...
    @property
    def labels(self) -> Labels: ...
    @property
    def pixels_hw(self) -> tuple[int, int]: ...
    @property
    def extent(self) -> tuple[float, float, float, float]: ...


def render(
    tiles: Sequence[Tile],
    canvas_wh: tuple[int, int],
    m: np.ndarray,
    out_wh: tuple[int, int],
    scale: float = 1.0,
    fill: int = FILL,
) -> tuple[np.ndarray, Labels]:
    """The output image (out_h, out_w, 3) uint8 and the surviving labels, for tiles moved by ``m`` (canvas ->
    output). ``scale`` is the random zoom inside ``m``, for the candidate rule (``affine.box_candidates``).

    >>> tile = Tile(np.full((8, 8, 3), 9, np.uint8), (8, 8), (0, 0), Labels([0], [[1, 1, 7, 7]]))
    >>> img, labels = render([tile], (8, 8), translation(2, 2), (16, 16))
    >>> img[3, 3].tolist(), img[12, 12].tolist(), labels.boxes_xyxy.tolist()
    ([9, 9, 9], [114, 114, 114], [[3.0, 3.0, 9.0, 9.0]])
    """
    out_w, out_h = out_wh
    out = np.full((out_h, out_w, 3), fill, dtype=np.uint8)
    warps, labels = place_tiles(tiles, canvas_wh, m, out_wh, scale)
    for tile, warp in zip(tiles, warps):
        if warp is not None:
            apply_warp(out, tile.pixels, warp)
    return out, labels


def place_tiles(
    tiles: Sequence[TileShape],
    canvas_wh: tuple[int, int],
    m: np.ndarray,
    out_wh: tuple[int, int],
    scale: float = 1.0,
) -> tuple[list[WarpPlan | None], Labels]:
    """:func:`render` without pixels: each tile's :class:`~affine.WarpPlan` (None: nothing of it is drawn) and
    the surviving labels, from the pixels' sizes and extents alone."""
    out_w, out_h = out_wh
    canvas_w, canvas_h = canvas_wh
    warps: list[WarpPlan | None] = []
    kept: list[Labels] = []
    for tile in tiles:
        (tw, th), (ox, oy) = tile.size_wh, tile.origin_xy
        vx1, vy1, vx2, vy2 = max(ox, 0), max(oy, 0), min(ox + tw, canvas_w), min(oy + th, canvas_h)
        if vx1 >= vx2 or vy1 >= vy2:
            warps.append(None)
            continue
        ph, pw = tile.pixels_hw
        ex0, ey0, ex1, ey1 = tile.extent
        # Tile pixels -> canvas: pixel (0, 0)'s corner lands at (px, py), each pixel is sx x sy canvas pixels.
        sx, sy = tw * (ex1 - ex0) / pw, th * (ey1 - ey0) / ph
        px, py = ox + tw * ex0, oy + th * ey0
        # The visible part in the tile's own pixels (whole pixels, so at most one extra pixel at a cut edge: also
        # the part of a reduced decode's last pixel that lies beyond its file).
        rect = (
            max(math.floor((vx1 - px) / sx), 0),
            max(math.floor((vy1 - py) / sy), 0),
            min(math.ceil((vx2 - px) / sx), pw),
            min(math.ceil((vy2 - py) / sy), ph),
        )
        wanted = m @ translation(px, py) @ scaling(sx, sy)  # tile pixels -> output
        warp = plan_warp((ph, pw), (out_h, out_w), wanted, rect)
        warps.append(warp)
        if len(tile.labels):
            # canvas -> output as the pixels actually moved (the fast path may round the shift)
            m_tile = m
            if warp is not None and warp.dst is not None:
                m_tile = warp.matrix @ scaling(1 / sx, 1 / sy) @ translation(-px, -py)
            before = clip_boxes(tile.labels.boxes_xyxy + np.array((ox, oy, ox, oy), np.float32), vx1, vy1, vx2, vy2)
            after = clip_boxes(transform_boxes(before, m_tile), 0, 0, out_w, out_h)
            keep = box_candidates(before, after, scale)
            kept.append(Labels(tile.labels.cls[keep], after[keep]))
    return warps, Labels.concat(kept)
