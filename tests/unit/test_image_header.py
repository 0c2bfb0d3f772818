"""The declared size of an image, read from its header before decoding (issue 25, item 5): it agrees with what
OpenCV decodes for every format a dataset may use, and hostile bytes give a size or None, never an exception."""

from __future__ import annotations

import struct
import zlib

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


def _tiff(sizes: list[tuple[int, int]], order: str = "<", pixels: int = 64 * 64) -> bytes:
    """A classic 8-bit grey TIFF whose IFD holds ImageWidth/ImageLength once per ``sizes`` entry, in that order
    (the entries after the first repeat both tags), then one strip of ``pixels`` bytes."""
    entries = [(tag, 4, value) for w, h in sizes for tag, value in ((256, w), (257, h))]
    n = len(entries) + 6
    strip_at = 8 + 2 + 12 * n + 4
    entries += [(258, 3, 8), (259, 3, 1), (262, 3, 1), (273, 4, strip_at), (277, 3, 1), (279, 4, pixels)]
    ifd = struct.pack(order + "H", n)
    for tag, kind, value in entries:
        packed = struct.pack(order + "HH", value, 0) if kind == 3 else struct.pack(order + "I", value)
        ifd += struct.pack(order + "HHI", tag, kind, 1) + packed
    magic = b"II*\x00" if order == "<" else b"MM\x00*"
    return magic + struct.pack(order + "I", 8) + ifd + bytes(4) + bytes(range(256)) * (pixels // 256)


def _decoded_wh(data: bytes) -> tuple[int, int] | None:
    """(width, height) OpenCV decodes ``data`` at, or None where it refuses it."""
    try:
        img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    except cv2.error:
        return None
    return None if img is None else (img.shape[1], img.shape[0])


@pytest.mark.parametrize("order", ["<", ">"])
def test_tiff_repeating_a_size_tag_is_refused(order: str) -> None:
    """Security finding: a 3.5 KB TIFF holding ImageWidth/ImageLength twice, first 20000 x 20000 and last 8 x 8,
    was measured by its last tags (64 pixels) while libtiff decodes it by its first (3.2 GB at RGB)."""
    data = np.frombuffer(_tiff([(20000, 20000), (8, 8)], order), np.uint8)
    assert declared_size(data) is None
    assert pixel_problem(data, 10**6) == "not a readable image (TIFF IFD repeats tag 256, ImageWidth)"
    once = np.frombuffer(_tiff([(8, 8)], order), np.uint8)  # the same file with the tags once: measured
    assert declared_size(once) == (8, 8) and pixel_problem(once, 64) is None
    big = b"II+\x00\x08\x00\x00\x00" + (16).to_bytes(8, "little") + (3).to_bytes(8, "little")
    for tag, value in ((256, 9), (257, 20000), (257, 3)):  # BigTIFF, only the height repeated
        big += tag.to_bytes(2, "little") + (16).to_bytes(2, "little") + (1).to_bytes(8, "little")
        big += value.to_bytes(8, "little")
    assert pixel_problem(np.frombuffer(big, np.uint8), 10**9) == (
        "not a readable image (TIFF IFD repeats tag 257, ImageLength)"
    )


def test_libtiff_decodes_the_first_of_repeated_size_tags() -> None:
    """Why a repeated size tag cannot be measured by the last one: libtiff keeps the first of a repeated tag (and
    only warns), whether the repeat follows it at once or after the other tags."""
    assert _decoded_wh(_tiff([(64, 64), (8, 8)])) == (64, 64)
    assert _decoded_wh(_tiff([(8, 8), (64, 64)])) == (8, 8)
    sorted_tags = _tiff([(64, 64), (8, 8)])  # 256, 256, 257, 257: ascending apart from the repeat
    n = 8 + 2
    entries = [sorted_tags[n + 12 * k : n + 12 * (k + 1)] for k in range(4)]
    sorted_tags = sorted_tags[:n] + b"".join([entries[0], entries[2], entries[1], entries[3]]) + sorted_tags[n + 48 :]
    assert _decoded_wh(sorted_tags) == (64, 64)
    assert declared_size(np.frombuffer(sorted_tags, np.uint8)) is None


def test_other_formats_naming_a_size_twice_are_measured_as_decoded() -> None:
    """JPEG, PNG and WebP can state a size twice too; the size read is the one the decoder uses, or the decoder
    refuses the file: libjpeg takes the first frame header (a second before the image data is an error, one after
    it is never read), libpng refuses a second IHDR, libwebp refuses a VP8X canvas unlike its frame."""
    ok, enc = cv2.imencode(".jpg", np.full((8, 8, 3), 90, np.uint8))
    assert ok
    jpg = enc.tobytes()
    at = jpg.index(b"\xff\xc0")
    sof = jpg[at : at + 2 + int.from_bytes(jpg[at + 2 : at + 4], "big")]
    sof64 = sof[:5] + (64).to_bytes(2, "big") * 2 + sof[9:]
    for data, decoded, measured in (
        (jpg[:at] + sof64 + jpg[at:], None, (64, 64)),
        (jpg[:at] + sof + sof64 + jpg[at + len(sof) :], None, (8, 8)),
        (jpg[:-2] + sof64 + jpg[-2:], (8, 8), (8, 8)),  # after the scan
    ):
        assert _decoded_wh(data) == decoded
        assert declared_size(np.frombuffer(data, np.uint8)) == measured
    ok, enc = cv2.imencode(".png", np.full((8, 8), 90, np.uint8))
    assert ok
    png = enc.tobytes()
    ihdr64 = png[8:16] + struct.pack(">II", 64, 64) + png[24:29]
    ihdr64 += struct.pack(">I", zlib.crc32(ihdr64[4:]) & 0xFFFFFFFF)
    for data, measured in (
        (png[:8] + ihdr64 + png[8:], (64, 64)),
        (png[:33] + ihdr64 + png[33:], (8, 8)),
        (png[:-12] + ihdr64 + png[-12:], (8, 8)),  # after the image data
    ):
        assert _decoded_wh(data) is None
        assert declared_size(np.frombuffer(data, np.uint8)) == measured
    ok, enc = cv2.imencode(".webp", np.full((8, 8, 3), 90, np.uint8), [cv2.IMWRITE_WEBP_QUALITY, 80])
    assert ok
    for canvas, decoded in ((8, (8, 8)), (64, None), (4, None)):
        body = b"WEBPVP8X" + struct.pack("<I", 10) + bytes(4) + (canvas - 1).to_bytes(3, "little") * 2
        data = b"RIFF" + struct.pack("<I", len(body) + len(enc) - 12) + body + enc.tobytes()[12:]
        assert _decoded_wh(data) == decoded
        assert declared_size(np.frombuffer(data, np.uint8)) == (canvas, canvas)


@pytest.mark.parametrize(
    ("header", "measured"),
    [
        (b"P5 #\r64 64\n255\n", (64, 64)),  # OpenCV ends a comment at a CR: read here as 1 x 1 before
        (b"P5 #\r64 64\n1\n1\n255\n", (64, 64)),
        (b"P7\nWIDTH 64\nHEIGHT 64\nDEPTH 1\nMAXVAL 255\nENDHDR\nWIDTH 8\nHEIGHT 8\n", (64, 64)),  # after ENDHDR
        (b"P7\nWIDTH \n64\nHEIGHT 64\nDEPTH 1\nMAXVAL 255\nENDHDR\n", (64, 64)),  # OpenCV reads on past a line break
        (b"P7\nWIDTH 8\nWIDTH 64\nHEIGHT 64\nDEPTH 1\nMAXVAL 255\nENDHDR\n", None),  # OpenCV refuses it too
        (b"Pf\n64# 64\n1\n-1.0\n", None),  # OpenCV reads 64 x 64 (atoi stops at #): refused, read as 64 x 1 before
        (b"Pf\n64 64\n-1.0\n", (64, 64)),
    ],
)
def test_pnm_pam_and_pfm_headers_are_read_as_opencv_reads_them(header: bytes, measured: tuple[int, int] | None) -> None:
    """Security finding: PNM, PAM and PFM headers OpenCV reads as 64 x 64 were measured smaller here (a comment
    ended by a CR, fields after ENDHDR, a ``#`` in a PFM number), so a file declaring 20000 x 20000 passed."""
    data = header + bytes(64 * 64 * 4)
    assert declared_size(np.frombuffer(data, np.uint8)) == measured
    decoded = _decoded_wh(data)
    assert measured is None or decoded == measured
    if measured is None and header.startswith(b"Pf"):
        assert decoded == (64, 64)
