"""One augmented training sample, in two steps: plan (all random draws, no pixels) and render.

Planning first lets the dataset decode each image once per batch (several mosaics of a batch share source images,
see ``dataset.py``) and at reduced JPEG scale when the sample shows it much smaller than its file.

Everything random comes from one generator, in this order: mosaic or not; [mosaic partners; mosaic centre];
affine; flips; mixup or not; [the mixed-in layer: its image, mosaic or not, partners, centre, affine; the mixing
ratio]; HSV; cutmix or not; [the pasted layer: its image, mosaic or not, partners, centre, affine; the candidate
rectangles and the pick among them]. (CutMix comes last in the stream so that switching it on changes nothing
drawn before; it is applied after mixup and before HSV, as in Ultralytics.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import cv2
import numpy as np

from detrain.config.keys import Augment
from detrain.data.image_io import pixel_extent, reduce_factor
from detrain.data.samples.affine import (
    FILL,
    WarpPlan,
    apply_warp,
    flip_matrix,
    is_perspective,
    random_affine_matrix,
    translation,
)
from detrain.data.samples.augment import MIXUP_BETA, hsv_gains
from detrain.data.samples.compose import place_tiles
from detrain.data.samples.cutmix import choose_area, cutmix_areas
from detrain.data.samples.instances import Labels


@dataclass
class TilePlan:
    """Image ``index`` shown at ``size_wh`` (its load size) at ``origin_xy`` on the canvas, decoded at 1/``reduce``."""

    index: int
    size_wh: tuple[int, int]
    origin_xy: tuple[int, int]
    reduce: int = 1


@dataclass
class LayerPlan:
    """Tiles on a canvas of ``canvas_wh`` moved into the output by ``m`` (affine and flips; random zoom ``scale``)."""

    tiles: list[TilePlan]
    canvas_wh: tuple[int, int]
    m: np.ndarray
    scale: float


@dataclass
class CutMixPlan:
    """CutMix (``cutmix.py``): candidate rectangles ``areas`` (n, 4) in output pixels and ``pick`` in [0, 1), which
    chooses among those left free by the sample's boxes. The plan's last layer is the one pasted."""

    areas: np.ndarray
    pick: float


@dataclass
class SamplePlan:
    """A whole sample: one layer, or two blended with ``mix_ratio`` (mixup); a rectangle of one more layer pasted
    in (``cutmix``); then HSV ``hsv`` gains."""

    index: int
    layers: list[LayerPlan]
    out_wh: tuple[int, int]
    hsv: np.ndarray
    mix_ratio: float = 1.0
    mosaic: bool = False
    cutmix: CutMixPlan | None = None


@dataclass
class SampleSource:
    """What the planner needs to know about the dataset: load sizes (w, h) and file long sides per index, and
    whether decodes may be reduced (not when pixels come from a cache)."""

    load_sizes_wh: Sequence[tuple[int, int]]
    file_long_sides: Sequence[int]
    can_reduce: bool = True


def draw_partners(rng: np.random.Generator, index: int, k: int, n: int, pool: Sequence[int] | None) -> list[int]:
    """``k`` mosaic partners of ``index``: from ``pool`` (other images of the same sampler group) if it holds any
    other image, else from the whole dataset of ``n``.

    >>> draw_partners(np.random.default_rng(2), 3, 3, 100, pool=[3, 7, 9])  # never 3 itself
    [9, 7, 7]
    """
    others = [p for p in pool if p != index] if pool is not None else []
    if others:
        return [int(others[j]) for j in rng.integers(len(others), size=k)]
    return [int(j) for j in rng.integers(n, size=k)]


def mosaic_origins(rng: np.random.Generator, sizes_wh: Sequence[tuple[int, int]], imgsz: int) -> list[tuple[int, int]]:
    """Top-left corners on the 2s canvas of four images of ``sizes_wh``, around a random centre: YOLO's 4-image
    mosaic layout, composed with the random affine into one warp per image.

    As YOLOv8: a virtual canvas of 2s x 2s (s = imgsz) with a random centre (xc, yc), each uniform in [s/2, 3s/2).
    The four images (at load size, long side s) touch the centre with a corner: the first to its top-left, then
    top-right, bottom-left, bottom-right; whatever falls outside the canvas is cut. The random affine then maps the
    canvas centre to the output centre (zoom, rotation, shear, translation) into an s x s output.

    >>> o = mosaic_origins(np.random.default_rng(0), [(10, 10)] * 4, 20)
    >>> o[3][0] - o[0][0], o[3][1] - o[0][1]  # the first ends where the last starts: at the centre
    (10, 10)
    """
    xc = int(rng.uniform(imgsz / 2, 1.5 * imgsz))
    yc = int(rng.uniform(imgsz / 2, 1.5 * imgsz))
    (w0, h0), (_, h1), (w2, _), _ = sizes_wh
    return [(xc - w0, yc - h0), (xc, yc - h1), (xc - w2, yc), (xc, yc)]


def plan_sample(
    index: int,
    rng: np.random.Generator,
    source: SampleSource,
    hyp: Augment,
    imgsz: int,
    mosaic_on: bool = True,
    out_hw: tuple[int, int] | None = None,
    pool: Sequence[int] | None = None,
) -> SamplePlan:
    """All the random choices for the training sample of ``index`` (see the module docstring for the order), with
    the probabilities and ranges of ``hyp`` (the config's augment section, ``cfg.augment``).

    ``out_hw`` (rect training) disables mosaic, mixup and cutmix and sets the output size; default ``imgsz``
    square. ``mosaic_on=False`` (close_mosaic) disables all three too, as in Ultralytics.
    """
    out_h, out_w = out_hw or (imgsz, imgsz)
    mosaic_on = mosaic_on and out_hw is None
    first = _plan_layer(index, rng, source, hyp, imgsz, mosaic_on, (out_w, out_h), pool)
    lr, ud = rng.random() < hyp.fliplr, rng.random() < hyp.flipud
    layers, ratio = [first], 1.0
    if rng.random() < hyp.mixup and mosaic_on:
        other = draw_partners(rng, index, 1, len(source.load_sizes_wh), pool)[0]
        layers.append(_plan_layer(other, rng, source, hyp, imgsz, mosaic_on, (out_w, out_h), pool))
        ratio = float(rng.beta(MIXUP_BETA, MIXUP_BETA))
    flips = flip_matrix(out_w, out_h, lr, ud)
    for layer in layers:
        layer.m = flips @ layer.m
        _choose_reductions(layer, source)
    gains = hsv_gains(rng, hyp.hsv_h, hyp.hsv_s, hyp.hsv_v)
    cut = None
    if rng.random() < hyp.cutmix and mosaic_on:
        other = draw_partners(rng, index, 1, len(source.load_sizes_wh), pool)[0]
        pasted = _plan_layer(other, rng, source, hyp, imgsz, mosaic_on, (out_w, out_h), pool)
        pasted.m = flips @ pasted.m  # flipped with the sample, as Ultralytics flips after CutMix
        _choose_reductions(pasted, source)
        layers.append(pasted)
        cut = CutMixPlan(cutmix_areas(rng, out_w, out_h), float(rng.random()))
    return SamplePlan(index, layers, (out_w, out_h), gains, ratio, mosaic=len(first.tiles) > 1, cutmix=cut)


def _plan_layer(
    index: int,
    rng: np.random.Generator,
    source: SampleSource,
    hyp: Augment,
    imgsz: int,
    mosaic_on: bool,
    out_wh: tuple[int, int],
    pool: Sequence[int] | None,
) -> LayerPlan:
    use_mosaic = rng.random() < hyp.mosaic and mosaic_on
    affine = (hyp.degrees, hyp.translate, hyp.scale, hyp.shear, hyp.perspective)
    if use_mosaic:
        indices = [index, *draw_partners(rng, index, 3, len(source.load_sizes_wh), pool)]
        sizes = [(w, h) for w, h in (source.load_sizes_wh[i] for i in indices)]
        origins = mosaic_origins(rng, sizes, imgsz)
        canvas = (2 * imgsz, 2 * imgsz)
        m, s = random_affine_matrix(rng, (imgsz, imgsz), out_wh, *affine)
        tiles = [TilePlan(i, size, origin) for i, size, origin in zip(indices, sizes, origins)]
        return LayerPlan(tiles, canvas, m, s)
    w, h = source.load_sizes_wh[index]
    m, s = random_affine_matrix(rng, (w / 2, h / 2), out_wh, *affine)
    return LayerPlan([TilePlan(index, (w, h), (0, 0))], (w, h), m, s)


def _choose_reductions(layer: LayerPlan, source: SampleSource) -> None:
    """Decode at 1/2, 1/4 or 1/8 when the sample shows an image at most that fraction of its file's size."""
    if not source.can_reduce or is_perspective(layer.m):
        return
    stretch = float(np.linalg.svd(layer.m[:2, :2], compute_uv=False)[0])  # the most any direction is enlarged
    for tile in layer.tiles:
        tile.reduce = reduce_factor(source.file_long_sides[tile.index], max(tile.size_wh) * stretch)


@dataclass
class PlacedTile:
    """A tile of a plan without pixels (a :class:`compose.TileShape`): where image ``index`` decoded at 1/``reduce``
    goes, with its pixels' size ``pixels_hw`` and ``extent`` (``image_io.pixel_extent``)."""

    index: int
    reduce: int
    size_wh: tuple[int, int]
    origin_xy: tuple[float, float]
    labels: Labels
    pixels_hw: tuple[int, int]
    extent: tuple[float, float, float, float]


@dataclass
class LayerLayout:
    """One rendered layer: an ``out_wh`` image of grey on which each of ``tiles`` is drawn by its ``warps`` entry
    (None: nothing of it shows)."""

    tiles: list[PlacedTile]
    warps: list[WarpPlan | None]
    out_wh: tuple[int, int]


@dataclass
class SampleLayout:
    """A planned sample with its geometry worked out and no pixels: the blended ``layers`` (one, or two mixed with
    ``mix_ratio``), the cutmix ``patch`` (its rectangle and layer) if one is pasted, the final ``labels`` (output
    pixels) and the ``hsv`` gains. ``render_layout`` (numpy) and ``device_render`` (torch) draw it."""

    layers: list[LayerLayout]
    mix_ratio: float
    patch: tuple[tuple[int, int, int, int], LayerLayout] | None
    labels: Labels
    hsv: np.ndarray


PixelShape = Callable[[int, int], tuple[tuple[int, int], tuple[float, float, float, float]]]


def place_sample(
    plan: SamplePlan, pixel_shape: PixelShape, labels_at_load_size: Callable[[int], Labels]
) -> SampleLayout:
    """The :class:`SampleLayout` of ``plan``: ``pixel_shape(index, reduce)`` gives the (H, W) and extent of the
    pixels image ``index`` will be drawn from, ``labels_at_load_size(index)`` its labels in load-size pixels."""

    def place(layer: LayerPlan, m: np.ndarray, out_wh: tuple[int, int]) -> tuple[LayerLayout, Labels]:
        tiles = [
            PlacedTile(
                t.index, t.reduce, t.size_wh, t.origin_xy, labels_at_load_size(t.index), *pixel_shape(t.index, t.reduce)
            )
            for t in layer.tiles
        ]
        warps, labels = place_tiles(tiles, layer.canvas_wh, m, out_wh, layer.scale)
        return LayerLayout(tiles, warps, out_wh), labels

    blended = plan.layers[:-1] if plan.cutmix is not None else plan.layers
    placed = [place(layer, layer.m, plan.out_wh) for layer in blended]
    out_labels = Labels.concat([labels for _, labels in placed])
    patch = None
    if plan.cutmix is not None:
        area = choose_area(plan.cutmix.areas, out_labels.boxes_xyxy, plan.cutmix.pick)
        if area is not None:  # only the rectangle of the pasted layer is rendered, straight into its own canvas
            x1, y1, x2, y2 = area
            layer = plan.layers[-1]
            patch_layout, patch_labels = place(layer, translation(-x1, -y1) @ layer.m, (x2 - x1, y2 - y1))
            if len(patch_labels):  # a patch without boxes is not pasted (the rule in cutmix.py)
                patch = (area, patch_layout)
                out_labels = Labels.concat([out_labels, patch_labels.scaled(1.0, 1.0, x1, y1)])
    return SampleLayout([layout for layout, _ in placed], plan.mix_ratio, patch, out_labels, plan.hsv)


def render_layer(layout: LayerLayout, pixels: Callable[[int, int], np.ndarray]) -> np.ndarray:
    """The layer's (h, w, 3) uint8 image: grey, then each tile's pixels drawn by its warp."""
    out_w, out_h = layout.out_wh
    out = np.full((out_h, out_w, 3), FILL, dtype=np.uint8)
    for tile, warp in zip(layout.tiles, layout.warps):
        if warp is not None:
            apply_warp(out, pixels(tile.index, tile.reduce), warp)
    return out


def render_geometry(
    plan: SamplePlan,
    pixels: Callable[[int, int], np.ndarray],
    labels_at_load_size: Callable[[int], Labels],
) -> tuple[np.ndarray, Labels]:
    """The planned sample before its colour step: (out_h, out_w, 3) uint8 BGR and its labels (output pixels).

    ``pixels(index, reduce)`` gives the decoded image (any resolution: it is stretched to the tile's load size by the
    same warp), ``labels_at_load_size(index)`` its labels in load-size pixels.
    """

    def shape(index: int, reduce: int) -> tuple[tuple[int, int], tuple[float, float, float, float]]:
        img = pixels(index, reduce)
        return (img.shape[0], img.shape[1]), pixel_extent(img)

    layout = place_sample(plan, shape, labels_at_load_size)
    images = [render_layer(layer, pixels) for layer in layout.layers]
    img = images[0]
    if len(images) == 2:
        img = cv2.addWeighted(images[0], plan.mix_ratio, images[1], 1.0 - plan.mix_ratio, 0.0)
    if layout.patch is not None:
        (x1, y1, x2, y2), patch = layout.patch
        img[y1:y2, x1:x2] = render_layer(patch, pixels)
    return img, layout.labels
