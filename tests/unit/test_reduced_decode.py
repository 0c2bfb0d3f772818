"""JPEGs decoded at 1/2, 1/4 and 1/8 land where the full decode lands, also when f does not divide a side.

libjpeg's reduced decode has ceil(W / f) pixels of f file pixels each, the last one partly beyond the file: it must be
placed by that scale (``image_io.ReducedImage``), not stretched onto the file's width, which moved content against
its labels by up to (f - 1) / W of the image (1.6 px of a 1601 px file shown at 800 px, decoded at 1/8).
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import cv2
import numpy as np
import pytest

from detrain.data.image_io import ReducedImage, jpeg_header, load_size, pixel_extent, read_image
from detrain.data.samples.affine import scaling, translation
from detrain.data.samples.instances import Labels
from detrain.data.samples.train_sample import LayerPlan, SamplePlan, TilePlan, render_geometry

COCO128 = Path(__file__).resolve().parents[3] / "shared" / "data" / "coco128" / "images" / "train2017"


def _with_orientation(data: bytes, orientation: int) -> bytes:
    """The JPEG ``data`` with an EXIF APP1 segment saying ``orientation`` right after its start marker."""
    tiff = b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", 1)
    tiff += struct.pack("<HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack("<I", 0)
    app1 = b"Exif\x00\x00" + tiff
    return data[:2] + b"\xff\xe1" + struct.pack(">H", len(app1) + 2) + app1 + data[2:]


def _marker_jpeg(path: Path, h: int, w: int, centre_xy: tuple[float, float], orientation: int = 1) -> str:
    """A black ``w`` x ``h`` JPEG with one smooth bright spot (Gaussian, sigma 8 px) at ``centre_xy``."""
    ys, xs = np.mgrid[:h, :w]
    # pixel j is centred at j + 0.5 (continuous coordinates, as the warps use)
    spot = 255 * np.exp(-((xs + 0.5 - centre_xy[0]) ** 2 + (ys + 0.5 - centre_xy[1]) ** 2) / (2 * 8.0**2))
    img = np.repeat(spot.round().astype(np.uint8)[..., None], 3, axis=2)
    ok, enc = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 100])
    assert ok
    data = enc.tobytes()
    path.write_bytes(data if orientation == 1 else _with_orientation(data, orientation))
    return str(path)


def _miss(
    file: str,
    centre_xy: tuple[float, float],
    reduce: int,
    m: np.ndarray,
    imgsz: int,
    out_wh: tuple[int, int],
    old_placement: bool = False,
) -> np.ndarray:
    """How far (x, y output pixels) the spot lands from the centre of its label, a box centred on ``centre_xy``
    (file pixels, as displayed), with the file as one training tile (the dataset's plan and render path) decoded at
    1/``reduce``. ``old_placement`` stretches the decode onto the load size, as before ``ReducedImage``."""
    h0, w0 = cv2.imread(file).shape[:2]
    lh, lw = load_size((h0, w0), imgsz)
    cx, cy = centre_xy[0] * lw / w0, centre_xy[1] * lh / h0
    label = Labels([0], [[cx - 20, cy - 20, cx + 20, cy + 20]])
    plan = SamplePlan(
        0, [LayerPlan([TilePlan(0, (lw, lh), (0, 0), reduce)], (lw, lh), m, 1.0)], out_wh, hsv=np.zeros(3)
    )

    def pixels(index: int, r: int) -> np.ndarray:
        img = read_image(file, r)
        assert img is not None
        return np.asarray(img) if old_placement else img

    img, labels = render_geometry(plan, pixels, lambda index: label)
    (box,) = labels.boxes_xyxy
    centre = (box[:2] + box[2:]) / 2
    return _centroid(img, centre) - centre


def _centroid(img: np.ndarray, near_xy: np.ndarray, radius: int = 30) -> np.ndarray:
    """The brightness-weighted centre of the pixels within ``radius`` of ``near_xy`` (the spot on black)."""
    x0, y0 = int(near_xy[0]) - radius, int(near_xy[1]) - radius
    g = img[y0 : y0 + 2 * radius, x0 : x0 + 2 * radius, 1].astype(np.float64)
    ys, xs = np.mgrid[: g.shape[0], : g.shape[1]]
    return np.array([((xs + x0 + 0.5) * g).sum(), ((ys + y0 + 0.5) * g).sum()]) / g.sum()


def _rotation(deg: float, cx: float, cy: float) -> np.ndarray:
    c, s = math.cos(math.radians(deg)), math.sin(math.radians(deg))
    return translation(cx, cy) @ np.array([[c, s, 0.0], [-s, c, 0.0], [0.0, 0.0, 1.0]]) @ translation(-cx, -cy)


@pytest.mark.parametrize("f", [2, 4, 8])
def test_reduced_decode_size_and_extent(tmp_path, f):
    file = _marker_jpeg(tmp_path / "a.jpg", 203, 301, (150, 100))
    img = read_image(file, f)
    assert img.shape[:2] == (math.ceil(203 / f), math.ceil(301 / f))  # libjpeg rounds up
    assert type(img) is ReducedImage
    np.testing.assert_allclose(pixel_extent(img), (0, 0, math.ceil(301 / f) * f / 301, math.ceil(203 / f) * f / 203))
    assert pixel_extent(img[1:]) == (0.0, 0.0, 1.0, 1.0)  # a crop is no longer the whole decode
    exact = read_image(_marker_jpeg(tmp_path / "b.jpg", 200, 296, (150, 100)), f)
    assert type(exact) is np.ndarray and exact.shape[:2] == (200 // f, 296 // f)


def test_extent_of_a_rotated_jpeg_starts_before_the_file_on_reversed_axes(tmp_path):
    file = _marker_jpeg(tmp_path / "a.jpg", 203, 301, (150, 100), orientation=6)  # 90 deg clockwise: x reversed
    assert jpeg_header(np.fromfile(file, np.uint8)) == (301, 203, 6)
    img = read_image(file, 8)
    assert img.shape[:2] == (38, 26)
    np.testing.assert_allclose(pixel_extent(img), (1 - 26 * 8 / 203, 0, 1, 38 * 8 / 301))


def test_png_is_not_decoded_at_reduced_scale(tmp_path):
    path = tmp_path / "a.png"
    cv2.imwrite(str(path), np.zeros((203, 301, 3), np.uint8))
    img = read_image(str(path), 4)
    assert type(img) is np.ndarray and img.shape[:2] == (203, 301)


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
@pytest.mark.parametrize("f", [2, 4, 8])
def test_marker_lands_where_the_full_decode_puts_it(tmp_path, f, orientation):
    """Odd sizes (1 more than a multiple of 8: the most overhang) and every kind of EXIF axis reversal."""
    file = _marker_jpeg(tmp_path / "m.jpg", 1203, 1601, (1361.0, 1023.0), orientation)
    shown = {
        1: (1361.0, 1023.0),
        3: (1601 - 1361.0, 1203 - 1023.0),
        6: (1203 - 1023.0, 1361.0),
        8: (1023.0, 1601 - 1361.0),
    }[orientation]  # where the spot is once OpenCV has turned the image
    for m, out_wh in [
        (np.eye(3), (800, 800)),
        (translation(20, 10) @ scaling(0.6, 0.6), (600, 600)),
        (_rotation(10, 400, 300), (800, 800)),
    ]:
        assert np.abs(_miss(file, shown, 1, m, 800, out_wh)).max() < 0.05  # the full decode, for reference
        miss = _miss(file, shown, f, m, 800, out_wh)
        assert np.abs(miss).max() < 0.05, (f, orientation, miss)
        # the stretched placement (before) misses by far more: this test would have caught it
        assert np.abs(_miss(file, shown, f, m, 800, out_wh, old_placement=True)).max() > 0.2


@pytest.mark.skipif(not COCO128.is_dir(), reason="coco128 not present")
def test_real_jpegs_decode_to_the_rounded_up_size():
    files = sorted(COCO128.glob("*.jpg"))[:24]
    odd = 0
    for file in files:
        h, w = read_image(str(file)).shape[:2]
        for f in (2, 4, 8):
            img = read_image(str(file), f)
            assert img.shape[:2] == (math.ceil(h / f), math.ceil(w / f))
            x0, y0, x1, y1 = pixel_extent(img)
            assert (x0, y0) == (0.0, 0.0)
            np.testing.assert_allclose((x1 * w, y1 * h), (img.shape[1] * f, img.shape[0] * f))
        odd += h % 8 != 0 or w % 8 != 0
    assert odd > 0  # the case that matters is there


def test_jpeg_header_reader_survives_hostile_bytes(tmp_path):
    """Fuzz: truncations, byte flips and random bytes around a real JPEG with an EXIF block; the header reader
    returns None or (width, height, orientation 1-8) and ``read_image`` a picture or None, never an exception."""
    from detrain.data.image_io import jpeg_header, read_image

    ok, enc = cv2.imencode(".jpg", np.full((37, 53, 3), 90, np.uint8))
    assert ok
    body = enc.ravel().tobytes()
    # APP1 Exif with a little-endian TIFF header whose IFD0 holds one Orientation tag (6)
    tiff = (
        b"II*\x00"
        + (8).to_bytes(4, "little")
        + (1).to_bytes(2, "little")
        + (0x0112).to_bytes(2, "little")
        + (3).to_bytes(2, "little")
        + (1).to_bytes(4, "little")
        + (6).to_bytes(2, "little")
        + b"\x00\x00"
        + (0).to_bytes(4, "little")
    )
    payload = b"Exif\x00\x00" + tiff
    seed = body[:2] + b"\xff\xe1" + (len(payload) + 2).to_bytes(2, "big") + payload + body[2:]
    assert jpeg_header(np.frombuffer(seed, np.uint8)) == (53, 37, 6)
    rng = np.random.default_rng(0)
    cases = [seed[:k] for k in range(64)]
    for _ in range(300):
        b = bytearray(seed)
        for pos in rng.integers(0, 80, size=int(rng.integers(1, 6))):
            b[int(pos)] = int(rng.integers(256))
        cases.append(bytes(b))
    cases += [
        b"\xff\xd8" + rng.integers(0, 256, int(rng.integers(0, 200)), dtype=np.uint8).tobytes() for _ in range(100)
    ]
    for k, data in enumerate(cases):
        out = jpeg_header(np.frombuffer(data, np.uint8))
        assert out is None or (len(out) == 3 and all(isinstance(v, int) for v in out) and 1 <= out[2] <= 8)
        if k % 10 == 0:
            path = tmp_path / f"f{k}.jpg"
            path.write_bytes(data)
            for f in (1, 2, 8):
                img = read_image(str(path), f)
                assert img is None or (img.ndim == 3 and img.shape[2] == 3)
