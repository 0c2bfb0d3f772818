"""The declared size of an image, read from its header before decoding (issue 25, item 5): it agrees with what
OpenCV decodes for every format a dataset may use, and hostile bytes give a size or None, never an exception."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from detrain.data.image_header import declared_size, pixel_problem

# every suffix of IMG_FORMATS that OpenCV writes here, and the other formats OpenCV reads by their bytes
ENCODINGS = [
    (".png", []),
    (".jpg", []),
    (".bmp", []),
    (".tif", []),
    (".webp", [cv2.IMWRITE_WEBP_QUALITY, 80]),
    (".webp", [cv2.IMWRITE_WEBP_QUALITY, 101]),  # lossless: VP8L
    (".ppm", []),
    (".pgm", []),
    (".pfm", []),
    (".pam", []),
]


@pytest.mark.parametrize(("suffix", "params"), ENCODINGS)
@pytest.mark.parametrize(("h", "w"), [(1, 1), (37, 53), (480, 17)])
def test_declared_size_is_what_opencv_decodes(suffix: str, params: list[int], h: int, w: int) -> None:
    img = np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    if suffix == ".pgm":
        img = img[..., 0]
    if suffix == ".pfm":
        img = img.astype(np.float32) / 255
    ok, enc = cv2.imencode(suffix, img, params)
    assert ok
    data = enc.ravel()
    decoded = cv2.imdecode(data, cv2.IMREAD_UNCHANGED)
    assert declared_size(data) == (decoded.shape[1], decoded.shape[0]) == (w, h)
    assert pixel_problem(data, h * w) is None
    assert f"declares {w}x{h} = {w * h} pixels, over max_pixels={h * w - 1}" in str(pixel_problem(data, h * w - 1))


def test_extended_webp_and_bigtiff_and_old_bmp_headers() -> None:
    """Headers OpenCV does not write here, built by hand: WebP VP8X canvas, BigTIFF, BITMAPCOREHEADER BMP,
    a negative (top-down) BMP height, and a PNM with a comment."""
    vp8x = b"RIFF\x00\x00\x00\x00WEBPVP8X\x0a\x00\x00\x00\x00\x00\x00\x00" + (29999).to_bytes(3, "little")
    vp8x += (1).to_bytes(3, "little")
    assert declared_size(np.frombuffer(vp8x, np.uint8)) == (30000, 2)
    big = b"II+\x00\x08\x00\x00\x00" + (16).to_bytes(8, "little") + (2).to_bytes(8, "little")
    for tag, value in ((256, 70000), (257, 3)):
        big += tag.to_bytes(2, "little") + (16).to_bytes(2, "little") + (1).to_bytes(8, "little")
        big += value.to_bytes(8, "little")
    assert declared_size(np.frombuffer(big, np.uint8)) == (70000, 3)
    core = b"BM" + bytes(12) + (12).to_bytes(4, "little") + (640).to_bytes(2, "little") + (480).to_bytes(2, "little")
    assert declared_size(np.frombuffer(core + bytes(8), np.uint8)) == (640, 480)
    info = b"BM" + bytes(12) + (40).to_bytes(4, "little") + (64).to_bytes(4, "little", signed=True)
    info += (-32).to_bytes(4, "little", signed=True)
    assert declared_size(np.frombuffer(info + bytes(8), np.uint8)) == (64, 32)
    assert declared_size(np.frombuffer(b"P6\n# made by hand\n 1200 900\n255\n", np.uint8)) == (1200, 900)


def test_jpeg_with_stray_bytes_between_segments_is_still_measured() -> None:
    """libjpeg skips garbage before a marker (with a warning) and decodes: so must the size reader, or such a
    file, kept before, would now be refused."""
    ok, enc = cv2.imencode(".jpg", np.full((21, 34, 3), 50, np.uint8))
    assert ok
    data = enc.ravel().tobytes()
    cut = 4 + int.from_bytes(data[4:6], "big")  # after the APP0 segment
    stray = data[:cut] + b"\x00\x12\x34" + data[cut:]
    assert cv2.imdecode(np.frombuffer(stray, np.uint8), cv2.IMREAD_COLOR).shape[:2] == (21, 34)
    assert declared_size(np.frombuffer(stray, np.uint8)) == (34, 21)


def test_unknown_formats_are_refused_as_unreadable() -> None:
    for data in (b"GIF89a\x10\x00\x10\x00", b"definitely not an image", b"\x89PNG\r\n\x1a\n", b"", b"\xff\xd8"):
        problem = pixel_problem(np.frombuffer(data, np.uint8), 10**9)
        assert problem is not None and problem.startswith("not a readable image (no JPEG, PNG")


def test_hostile_headers_give_a_size_or_none_quickly() -> None:
    """Fuzz: truncations and byte flips of every format's header, and a JPEG made of fill bytes (10 MB): a size
    (two ints) or None, never an exception, never a long walk."""
    rng = np.random.default_rng(0)
    seeds = []
    for suffix, params in ENCODINGS:
        img = np.zeros((9, 7), np.float32) if suffix == ".pfm" else np.zeros((9, 7, 3), np.uint8)
        ok, enc = cv2.imencode(suffix, img[..., 0] if suffix == ".pgm" else img, params)
        assert ok
        seeds.append(enc.ravel().tobytes())
    cases = [s[:k] for s in seeds for k in range(0, 64, 3)]
    for s in seeds:
        for _ in range(150):
            b = bytearray(s)
            for pos in rng.integers(0, min(len(b), 64), size=int(rng.integers(1, 5))):
                b[int(pos)] = int(rng.integers(256))
            cases.append(bytes(b))
    cases.append(b"\xff\xd8" + b"\xff" * (10 << 20))
    cases.append(b"\xff\xd8" + b"\x00\xff" * (5 << 20))
    for data in cases:
        out = declared_size(np.frombuffer(data, np.uint8))
        assert out is None or (len(out) == 2 and all(isinstance(v, int) and v >= 0 for v in out))
