"""``augment_device=gpu``: the pixels of training samples drawn on the training device, in torch.

The loader's workers still do everything that needs no pixels (``train_sample.place_sample``: every random draw,
the warps and the labels) and hand over the encoded JPEG bytes (or, for other formats and cached images, the
decoded arrays) with each sample's :class:`~detrain.data.samples.train_sample.SampleLayout`. This module decodes
the JPEGs with ``torchvision.io.decode_jpeg`` (nvJPEG on a GPU, one call for the batch; libjpeg-turbo on a CPU)
and draws each layout as the numpy path does: each tile resampled bilinearly (``grid_sample``) through the same
:class:`~detrain.data.samples.affine.WarpPlan` onto grey, the mixup blend, the cutmix patch, then HSV. The same
code runs on CPU tensors, which is how the tests compare it with the numpy path.

A JPEG the numpy path decodes at 1/f (libjpeg's DCT scaling) is decoded whole here and averaged over f x f blocks
in its stored orientation (partial blocks at the stored end, as libjpeg's), then turned by its EXIF orientation:
the same pixel grid, so the same warps and labels; the pixels differ by the two resamplings' rounding (about a
level on average). torchvision is used rather than kornia or DALI: it is already a dependency, decodes a list of
JPEGs on the GPU in one call, and ``grid_sample`` is all the warping needs.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from detrain.data.image_io import read_image_bytes
from detrain.data.memory.batch_memory import Batch
from detrain.data.samples.affine import FILL, WarpPlan, is_perspective, transform_points, translation
from detrain.data.samples.train_sample import LayerLayout, SampleLayout

PixelKey = tuple[int, int]  # (image index, decode reduction)


@dataclass
class EncodedJpeg:
    """A JPEG file's bytes (1-D uint8 tensor) and its EXIF orientation (1-8, ``image_io.jpeg_header``)."""

    data: torch.Tensor
    orientation: int


def decode_all(jpegs: Mapping[int, EncodedJpeg], device: torch.device) -> dict[int, torch.Tensor | None]:
    """Every JPEG decoded in one call on ``device``: (3, H, W) uint8 RGB in its stored orientation. When the call
    fails, each is decoded alone, and one that cannot be is None (``source_pixels`` falls back to OpenCV)."""
    if not jpegs:
        return {}
    # here, not at the top: importing torchvision costs every process ~2 s of CPU (it loads torch._dynamo), and most
    # never decode on the device (the launcher, the loader's workers, a run with augment_device=cpu)
    from torchvision.io import ImageReadMode, decode_jpeg

    keys = list(jpegs)
    with warnings.catch_warnings():  # torchvision 0.29 announces its decoders will move to TorchCodec one day
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            images = decode_jpeg([jpegs[k].data for k in keys], mode=ImageReadMode.RGB, device=device)
            return dict(zip(keys, images))
        except RuntimeError:
            out: dict[int, torch.Tensor | None] = {}
            for k in keys:
                try:
                    out[k] = decode_jpeg(jpegs[k].data, mode=ImageReadMode.RGB, device=device)
                except RuntimeError:
                    out[k] = None
            return out


def _host_decode(jpeg: EncodedJpeg, f: int, shape_hw: tuple[int, int], device: torch.device) -> torch.Tensor:
    """A JPEG torchvision refused, as the numpy path reads it (OpenCV, EXIF applied, at 1/``f``), or grey where
    OpenCV cannot read it either (the numpy path would have drawn another image: this one keeps its labels)."""
    img = read_image_bytes(jpeg.data.numpy(), f)
    if img is None or img.shape[:2] != shape_hw:
        warnings.warn(f"a JPEG of this batch cannot be decoded: drawn grey ({shape_hw[1]}x{shape_hw[0]})", stacklevel=3)
        return torch.full((3, *shape_hw), float(FILL), device=device)
    return torch.from_numpy(np.ascontiguousarray(img[..., ::-1])).to(device).permute(2, 0, 1).float()


def reduced(img: torch.Tensor, f: int) -> torch.Tensor:
    """(3, H, W) float averaged over f x f blocks, the last block of a side partial (libjpeg's 1/f grid)."""
    if f == 1:
        return img
    return F.avg_pool2d(img[None], f, f, ceil_mode=True)[0]


def oriented(img: torch.Tensor, orientation: int) -> torch.Tensor:
    """(C, H, W) turned as EXIF ``orientation`` says (as OpenCV shows the file)."""
    if orientation >= 5:
        img = img.transpose(-1, -2)
    flips = {2: (-1,), 3: (-1, -2), 4: (-2,), 6: (-1,), 7: (-1, -2), 8: (-2,)}.get(orientation, ())
    return img.flip(flips) if flips else img


def source_pixels(
    jpegs: Mapping[int, EncodedJpeg],
    arrays: Mapping[PixelKey, torch.Tensor],
    shapes: Mapping[PixelKey, tuple[int, int]],
    device: torch.device,
) -> dict[PixelKey, torch.Tensor]:
    """The pixels of every (index, reduction) of ``shapes`` (their planned (h, w)) as (3, h, w) float32 RGB on
    ``device``: from the JPEGs (decoded once per image) or from ``arrays`` (HWC uint8 BGR, decoded by the workers)."""
    decoded = decode_all({i: jpegs[i] for i in {i for i, _ in shapes if i in jpegs}}, device)
    out: dict[PixelKey, torch.Tensor] = {}
    for key, shape_hw in shapes.items():
        index, f = key
        if key in arrays:
            out[key] = arrays[key].to(device, non_blocking=True).permute(2, 0, 1).flip(0).float()
            continue
        img = decoded[index]
        if img is None:
            out[key] = _host_decode(jpegs[index], f, shape_hw, device)
        else:
            out[key] = oriented(reduced(img.float(), f), jpegs[index].orientation)
    return out


def _destination(warp: WarpPlan, out_hw: tuple[int, int]) -> tuple[int, int, int, int] | None:
    """The output pixels (x0, y0, x1, y1) the warp may write, as the numpy path bounds them."""
    h, w = out_hw
    if warp.dst is not None:
        x0, y0, x1, y1 = warp.dst
        x0, y0, x1, y1 = max(x0, 0), max(y0, 0), min(x1, w), min(y1, h)
    else:
        rx0, ry0, rx1, ry1 = warp.rect
        m = warp.matrix
        corners = np.array([[rx0, ry0], [rx1, ry0], [rx0, ry1], [rx1, ry1]], np.float64)
        if is_perspective(m) and ((corners @ m[2, :2] + m[2, 2]) <= 1e-6).any():
            x0, y0, x1, y1 = 0, 0, w, h  # beyond the horizon: no bound
        else:
            xy = transform_points(corners, m)
            x0, y0 = max(math.floor(xy[:, 0].min()) - 1, 0), max(math.floor(xy[:, 1].min()) - 1, 0)
            x1, y1 = min(math.ceil(xy[:, 0].max()) + 1, w), min(math.ceil(xy[:, 1].max()) + 1, h)
    return (x0, y0, x1, y1) if x0 < x1 and y0 < y1 else None


def _crop_map(warp: WarpPlan) -> list[list[float]]:
    """Output pixels -> pixels of the warp's source crop (continuous coordinates), as a 3x3 list."""
    rx0, ry0 = warp.rect[:2]
    return (translation(-rx0, -ry0) @ np.linalg.inv(warp.matrix)).tolist()


def affine_theta(warp: WarpPlan, box: tuple[int, int, int, int]) -> np.ndarray:
    """``F.affine_grid``'s (2, 3) matrix for an affine warp drawn into ``box`` of the output: normalised box
    coordinates (align_corners=False) -> normalised coordinates of the source crop."""
    a = _crop_map(warp)
    x0, y0, x1, y1 = box
    wr, hr = x1 - x0, y1 - y0
    cw, ch = warp.rect[2] - warp.rect[0], warp.rect[3] - warp.rect[1]
    cx, cy = x0 + wr / 2, y0 + hr / 2  # the box's centre: normalised 0
    return np.array(
        [
            [a[0][0] * wr / cw, a[0][1] * hr / cw, 2 / cw * (a[0][0] * cx + a[0][1] * cy + a[0][2]) - 1],
            [a[1][0] * wr / ch, a[1][1] * hr / ch, 2 / ch * (a[1][0] * cx + a[1][1] * cy + a[1][2]) - 1],
        ]
    )


def _perspective_grid(warp: WarpPlan, box: tuple[int, int, int, int], device: torch.device) -> torch.Tensor:
    """The sampling grid (1, h, w, 2) of a perspective warp drawn into ``box`` (normalised crop coordinates)."""
    a = _crop_map(warp)
    x0, y0, x1, y1 = box
    gy = torch.arange(y0, y1, device=device, dtype=torch.float32)[:, None] + 0.5
    gx = torch.arange(x0, x1, device=device, dtype=torch.float32)[None, :] + 0.5
    d = a[2][0] * gx + a[2][1] * gy + a[2][2]
    u = (a[0][0] * gx + a[0][1] * gy + a[0][2]) / d
    v = (a[1][0] * gx + a[1][1] * gy + a[1][2]) / d
    cw, ch = warp.rect[2] - warp.rect[0], warp.rect[3] - warp.rect[1]
    return torch.stack((2 * u / cw - 1, 2 * v / ch - 1), -1)[None]


def draw_warp(canvas: torch.Tensor, src: torch.Tensor, warp: WarpPlan, theta: torch.Tensor | None = None) -> None:
    """Draw ``src`` (3, H, W) float into ``canvas`` (3, h, w) float in place as ``warp`` says (the numpy path's
    ``affine.apply_warp``): bilinear samples (align_corners=False) rounded to whole levels as uint8 stores them.
    ``theta``: the warp's :func:`affine_theta` already on the device (``render_batch`` copies a batch's at once)."""
    box = _destination(warp, (canvas.shape[1], canvas.shape[2]))
    if box is None:
        return
    x0, y0, x1, y1 = box
    rx0, ry0, rx1, ry1 = warp.rect
    crop = src[:, ry0:ry1, rx0:rx1]
    if is_perspective(warp.matrix):
        grid = _perspective_grid(warp, box, canvas.device)
    else:
        if theta is None:
            theta = torch.as_tensor(affine_theta(warp, box), dtype=torch.float32).to(canvas.device)
        grid = F.affine_grid(theta[None], [1, 3, y1 - y0, x1 - x0], align_corners=False)
    region = canvas[:, y0:y1, x0:x1]
    if warp.dst is not None:  # the fast path: cv2.resize of the crop, its edges replicated
        sampled = F.grid_sample(crop[None], grid, mode="bilinear", padding_mode="border", align_corners=False)[0]
        region.copy_(sampled.round())
        return
    # A general warp, as OpenCV's with a transparent border: a pixel whose centre maps within half a pixel of the
    # source is written; its neighbours outside the source count with the value the canvas has there.
    ones = torch.ones_like(crop[:1])
    sampled = F.grid_sample(torch.cat((crop, ones))[None], grid, mode="bilinear", align_corners=False)[0]
    blended = sampled[:3] + (1 - sampled[3:]) * region
    cw, ch = rx1 - rx0, ry1 - ry0
    gx, gy = grid[0, ..., 0], grid[0, ..., 1]
    inside = (gx >= -1 - 1 / cw) & (gx < 1 + 1 / cw) & (gy >= -1 - 1 / ch) & (gy < 1 + 1 / ch)
    region.copy_(torch.where(inside[None], blended.round(), region))


Thetas = Mapping[int, torch.Tensor]  # id of a WarpPlan -> its affine_theta on the device


def batch_thetas(layouts: Sequence[SampleLayout], device: torch.device) -> dict[int, torch.Tensor]:
    """The :func:`affine_theta` of every affine warp of the batch, copied to ``device`` at once (one copy, not
    one per tile)."""
    placed = [
        (warp, _destination(warp, (layer.out_wh[1], layer.out_wh[0])))
        for lay in layouts
        for layer in _layers(lay)
        for warp in layer.warps
        if warp is not None and not is_perspective(warp.matrix)
    ]
    kept = [(warp, box) for warp, box in placed if box is not None]
    if not kept:
        return {}
    thetas = torch.as_tensor(np.stack([affine_theta(w, b) for w, b in kept]), dtype=torch.float32).to(device)
    return {id(w): thetas[k] for k, (w, _) in enumerate(kept)}


def _layers(layout: SampleLayout) -> list[LayerLayout]:
    """The layers a sample draws: the blended ones and the cutmix patch's."""
    return [*layout.layers, *([layout.patch[1]] if layout.patch is not None else [])]


def draw_layer(
    layout: LayerLayout, pixels: Mapping[PixelKey, torch.Tensor], device: torch.device, thetas: Thetas | None = None
) -> torch.Tensor:
    """The layer's (3, h, w) float image: grey, then each tile drawn by its warp."""
    w, h = layout.out_wh
    canvas = torch.full((3, h, w), float(FILL), device=device)
    for tile, warp in zip(layout.tiles, layout.warps):
        if warp is not None:
            theta = thetas.get(id(warp)) if thetas is not None else None
            draw_warp(canvas, pixels[(tile.index, tile.reduce)], warp, theta)
    return canvas


def draw_sample(
    layout: SampleLayout, pixels: Mapping[PixelKey, torch.Tensor], device: torch.device, thetas: Thetas | None = None
) -> torch.Tensor:
    """The sample's (3, h, w) float RGB image before HSV: its layers blended, the cutmix patch pasted."""
    images = [draw_layer(layer, pixels, device, thetas) for layer in layout.layers]
    img = images[0]
    if len(images) == 2:
        img = (images[0] * layout.mix_ratio + images[1] * (1.0 - layout.mix_ratio)).round_()
    if layout.patch is not None:
        (x1, y1, x2, y2), patch = layout.patch
        img[:, y1:y2, x1:x2] = draw_layer(patch, pixels, device, thetas)
    return img


def apply_hsv_torch(rgb: torch.Tensor, gains: torch.Tensor) -> torch.Tensor:
    """``augment.apply_hsv`` in torch for a batch: (B, 3, h, w) RGB levels (float, whole numbers), each image's hue
    shifted by ``gains[i, 0]`` of the circle and saturation and value scaled by ``1 + gains[i, 1:]``, through 8-bit
    full-range HSV as OpenCV's conversions quantise it; RGB levels out. An image whose gains are all zero is left
    as it is (the numpy path skips its conversion too)."""
    g = gains.to(rgb.device, torch.float32)[:, :, None, None]  # (B, 3, 1, 1)
    r, gr, b = rgb[:, 0:1], rgb[:, 1:2], rgb[:, 2:3]
    v = torch.maximum(torch.maximum(r, gr), b)
    diff = v - torch.minimum(torch.minimum(r, gr), b)
    s = torch.where(v > 0, (255 * diff / v.clamp(min=1)).round(), torch.zeros_like(v))
    safe = diff.clamp(min=1e-6)
    hue = torch.where(v == r, (gr - b) / safe, torch.where(v == gr, 2 + (b - r) / safe, 4 + (r - gr) / safe))
    hue = torch.where(diff > 0, hue, torch.zeros_like(hue))
    h = (hue * (256 / 6)).round().remainder(256)
    h = (h + g[:, 0:1] * 256).remainder(256).floor()
    s = (s * (1 + g[:, 1:2])).clamp(0, 255).floor()
    v = (v * (1 + g[:, 2:3])).clamp(0, 255).floor()
    h6, sf, vf = h * (6 / 255), s / 255, v / 255  # OpenCV's 8-bit conversion back reads full-range hue as /255
    # each channel n (R 5, G 3, B 1) by the sector formula in closed form: v - v s clip(min(k, 4 - k), 0, 1)
    k = (torch.tensor([5.0, 3.0, 1.0], device=rgb.device)[None, :, None, None] + h6).remainder(6)
    out = ((vf - vf * sf * torch.minimum(k, 4 - k).clamp(0, 1)) * 255).round()
    unchanged = (gains == 0).all(1).to(rgb.device)[:, None, None, None]
    return torch.where(unchanged, rgb, out)


def render_batch(
    layouts: Sequence[SampleLayout],
    jpegs: Mapping[int, EncodedJpeg],
    arrays: Mapping[PixelKey, torch.Tensor],
    device: torch.device,
) -> torch.Tensor:
    """The batch's images (B, 3, h, w) uint8 RGB, channels-last, on ``device``: as the numpy path's batch."""
    shapes = {(t.index, t.reduce): t.pixels_hw for lay in layouts for layer in _layers(lay) for t in layer.tiles}
    pixels = source_pixels(jpegs, arrays, shapes, device)
    thetas = batch_thetas(layouts, device)
    images = torch.stack([draw_sample(layout, pixels, device, thetas) for layout in layouts])
    gains = torch.as_tensor(np.stack([layout.hsv for layout in layouts]), dtype=torch.float32)
    out = apply_hsv_torch(images, gains).clamp_(0, 255).to(torch.uint8)
    return out.contiguous(memory_format=torch.channels_last)


@dataclass
class DeviceBatch:
    """A training batch whose pixels are still to be drawn (``augment_device=gpu``): what a loader worker hands
    over instead of images. ``render(device)`` gives the batch the trainer reads (``img`` on ``device``).

    Every JPEG's bytes and every worker-decoded array lie end to end in one tensor (``data``), so a batch crosses
    from a worker in one shared-memory segment (one file descriptor), not one per image; the labels travel as
    numpy arrays, pickled with the rest."""

    layouts: list[SampleLayout]
    data: torch.Tensor
    jpeg_spans: dict[int, tuple[int, int, int]]  # image index -> (start, end, EXIF orientation) in data
    array_spans: dict[PixelKey, tuple[int, int, int]]  # -> (start, h, w) in data of an (h, w, 3) BGR array
    cls: np.ndarray
    bboxes: np.ndarray
    batch_idx: np.ndarray
    im_file: list[str]
    ori_shape: list[tuple[int, int]]
    ratio_pad: list[tuple[tuple[float, float], tuple[float, float]]]

    @staticmethod
    def pack(
        layouts: list[SampleLayout],
        jpegs: Mapping[int, EncodedJpeg],
        arrays: Mapping[PixelKey, np.ndarray],
        **rest: Any,
    ) -> DeviceBatch:
        """The batch of ``layouts`` drawing from ``jpegs`` and ``arrays`` (HWC uint8 BGR); ``rest``: the labels and
        per-image lists of the other fields."""
        parts: list[np.ndarray] = []
        offset = 0
        jpeg_spans: dict[int, tuple[int, int, int]] = {}
        for index, jpeg in jpegs.items():
            parts.append(jpeg.data.numpy())
            jpeg_spans[index] = (offset, offset + jpeg.data.numel(), jpeg.orientation)
            offset += jpeg.data.numel()
        array_spans: dict[PixelKey, tuple[int, int, int]] = {}
        for key, img in arrays.items():
            parts.append(np.ascontiguousarray(img).reshape(-1))
            array_spans[key] = (offset, img.shape[0], img.shape[1])
            offset += img.size
        data = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.uint8))
        return DeviceBatch(layouts, data, jpeg_spans, array_spans, **rest)

    def __len__(self) -> int:
        return len(self.layouts)

    def pin_memory(self, device: Any = None) -> DeviceBatch:
        """The batch with ``data`` in pinned memory (the DataLoader's pinning thread calls this with CUDA), so its
        copies to the device do not wait for the host."""
        return dataclasses.replace(self, data=self.data.pin_memory())

    def jpegs(self) -> dict[int, EncodedJpeg]:
        """The JPEGs to decode, by image index (views of ``data``)."""
        return {i: EncodedJpeg(self.data[a:b], o) for i, (a, b, o) in self.jpeg_spans.items()}

    def arrays(self) -> dict[PixelKey, torch.Tensor]:
        """The worker-decoded images, (h, w, 3) uint8 BGR views of ``data``."""
        return {k: self.data[a : a + h * w * 3].view(h, w, 3) for k, (a, h, w) in self.array_spans.items()}

    def render(self, device: torch.device | str) -> Batch:
        """The collated batch (as ``DetectionDataset.collate`` makes it) with its images drawn on ``device``."""
        img = render_batch(self.layouts, self.jpegs(), self.arrays(), torch.device(device))
        return Batch(
            img=img,
            batch_idx=torch.from_numpy(self.batch_idx),
            cls=torch.from_numpy(self.cls),
            bboxes=torch.from_numpy(self.bboxes),
            im_file=self.im_file,
            ori_shape=self.ori_shape,
            ratio_pad=self.ratio_pad,
        )
