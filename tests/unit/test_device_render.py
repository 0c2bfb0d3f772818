"""``augment_device=gpu``'s torch renderer (``samples/device_render.py``) piece by piece against the numpy path it
replaces: a reduced JPEG decode of every EXIF orientation (same grid, close pixels), the HSV step, and each kind of
warp (the scale + shift fast path, a rotation, a perspective) drawn through the same ``WarpPlan``.

Pixel tolerances: resampling differs in rounding only (OpenCV's fixed-point weights, libjpeg's DCT scaling vs a
block average), so the mean absolute difference stays under about a level and no pixel is far off."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from detrain.data.image_io import jpeg_header, pixel_extent, read_image, reduced_jpeg_grid
from detrain.data.samples import device_render as dr
from detrain.data.samples.affine import apply_warp, flip_matrix, plan_warp, scaling, translation
from detrain.data.samples.augment import apply_hsv


def _smooth(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A smooth BGR image (so that resampling differences stay small), with some structure to tell places apart."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(h // 12, 2), max(w // 12, 2), 3), dtype=np.uint8)
    return cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)


def _with_orientation(jpeg: bytes, orientation: int) -> bytes:
    """``jpeg`` with an EXIF APP1 segment holding only the orientation tag, right after its start-of-image."""
    tiff = b"MM\x00\x2a" + struct.pack(">I", 8) + struct.pack(">H", 1)
    tiff += struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack(">I", 0)
    body = b"Exif\x00\x00" + tiff
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(body) + 2) + body + jpeg[2:]


@pytest.mark.parametrize("orientation", range(1, 9))
def test_a_reduced_jpeg_has_opencvs_grid_and_pixels_in_every_orientation(tmp_path: Path, orientation: int) -> None:
    ok, enc = cv2.imencode(".jpg", _smooth(45, 70), [cv2.IMWRITE_JPEG_QUALITY, 95])
    assert ok
    data = _with_orientation(enc.tobytes(), orientation)
    path = tmp_path / "a.jpg"
    path.write_bytes(data)
    array = np.frombuffer(data, np.uint8)
    width, height, read_orientation = jpeg_header(array)  # type: ignore[misc]
    assert read_orientation == orientation
    jpegs = {0: dr.EncodedJpeg(torch.from_numpy(array.copy()), orientation)}
    for f in (1, 2, 4, 8):
        want = read_image(str(path), f)
        assert want is not None
        shape, extent = reduced_jpeg_grid(width, height, orientation, f)
        assert shape == want.shape[:2] and np.allclose(extent, pixel_extent(want)), (f, shape, extent)
        got = dr.source_pixels(jpegs, {}, {(0, f): shape}, torch.device("cpu"))[(0, f)]
        rgb = torch.from_numpy(want[..., ::-1].copy()).permute(2, 0, 1).float()
        diff = (got - rgb).abs()
        assert got.shape == rgb.shape and diff.mean() < 2.5 and diff.max() < 40, (f, diff.mean(), diff.max())


def test_hsv_follows_opencvs_8_bit_hsv() -> None:
    img = _smooth(40, 50, seed=3)
    img[:5, :5] = (0, 0, 0)  # black and greys: no hue, no saturation
    img[5:10, :5] = (128, 128, 128)
    rgb = torch.from_numpy(img[..., ::-1].copy()).permute(2, 0, 1).float()
    for gains in ([0.015, 0.7, 0.4], [-0.015, -0.7, -0.4], [0.0, 0.5, -0.2], [0.01, 0.0, 0.0]):
        want = torch.from_numpy(apply_hsv(img, np.array(gains), to_rgb=True)).permute(2, 0, 1).float()
        diff = (dr.apply_hsv_torch(rgb[None], torch.tensor([gains]))[0] - want).abs()
        assert diff.mean() < 0.2 and diff.max() <= 8, (gains, diff.mean(), diff.max())  # hue rounding, now and then
    assert torch.equal(dr.apply_hsv_torch(rgb[None], torch.zeros(1, 3))[0], rgb)
    two = dr.apply_hsv_torch(torch.stack((rgb, rgb)), torch.tensor([[0.0, 0.0, 0.0], [0.01, 0.2, 0.3]]))
    assert torch.equal(two[0], rgb) and not torch.equal(two[1], rgb)  # each image its own gains


def _rotation(deg: float, s: float) -> np.ndarray:
    a = math.radians(deg)
    return np.array([[s * math.cos(a), s * math.sin(a), 0], [-s * math.sin(a), s * math.cos(a), 0], [0, 0, 1.0]])


WARPS = {
    "scale and shift": translation(7.3, -4.6) @ scaling(1.37, 0.81),
    "flipped": flip_matrix(64, 56, True, True) @ translation(3.2, 5.9) @ scaling(0.62, 0.62),
    "rotation": translation(32, 28) @ _rotation(21, 1.1) @ translation(-35, -22),
    "perspective": translation(32, 28) @ np.array([[1, 0.1, 0], [0, 1, 0], [6e-4, -4e-4, 1.0]]) @ translation(-35, -22),
}


@pytest.mark.parametrize("name", WARPS)
def test_a_warp_draws_what_apply_warp_draws(name: str) -> None:
    src = _smooth(44, 70, seed=1)
    rect = (3, 2, 66, 40)
    canvas = np.full((56, 64, 3), 114, np.uint8)
    plan = plan_warp((44, 70), (56, 64), WARPS[name], rect)
    assert plan is not None and (plan.dst is not None) == (name in ("scale and shift", "flipped"))
    apply_warp(canvas, src, plan)
    got = torch.full((3, 56, 64), 114.0)
    dr.draw_warp(got, torch.from_numpy(src[..., ::-1].copy()).permute(2, 0, 1).float(), plan)
    want = torch.from_numpy(canvas[..., ::-1].copy()).permute(2, 0, 1).float()
    diff = (got - want).abs()
    assert (want != 114).any(dim=0).float().mean() > 0.2  # the source covers a good part of the canvas
    assert diff.mean() < 0.5 and diff.max() <= 8, (diff.mean(), diff.max())


def test_a_jpeg_torchvision_refuses_is_read_by_opencv_or_drawn_grey() -> None:
    _, enc = cv2.imencode(".jpg", _smooth(40, 60))
    good = enc.ravel()
    garbled = good.copy()
    garbled[len(good) // 2 : -2] = 0  # OpenCV still reads it (with its warnings), torchvision does not
    truncated = good[: len(good) // 3].copy()  # neither reads it
    jpegs = {i: dr.EncodedJpeg(torch.from_numpy(b.copy()), 1) for i, b in enumerate((good, garbled, truncated))}
    shapes = {(0, 1): (40, 60), (1, 1): (40, 60), (2, 1): (40, 60)}
    with pytest.warns(UserWarning, match="cannot be decoded: drawn grey"):
        pixels = dr.source_pixels(jpegs, {}, shapes, torch.device("cpu"))
    want = cv2.imdecode(garbled, cv2.IMREAD_COLOR)
    assert torch.equal(pixels[(1, 1)], torch.from_numpy(want[..., ::-1].copy()).permute(2, 0, 1).float())
    assert (pixels[(2, 1)] == 114).all() and pixels[(2, 1)].shape == (3, 40, 60)
    assert (pixels[(0, 1)] - torch.from_numpy(_smooth(40, 60)[..., ::-1].copy()).permute(2, 0, 1)).abs().mean() < 3
