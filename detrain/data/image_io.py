"""Reading images: YOLO's load-size rule, JPEG decoding at reduced scale, and the ``.npy`` disk cache.

``load_image`` reproduces YOLOv8's (Ultralytics 8.4) validation preprocessing bit for bit: BGR from
``cv2.imread``; if ``r = imgsz / max(h0, w0) != 1``, ``cv2.resize`` to
``(min(ceil(w0 * r), imgsz), min(ceil(h0 * r), imgsz))`` with ``INTER_LINEAR`` (8.4 uses linear both ways;
older releases used INTER_AREA to shrink for validation).

A JPEG decoded at 1/f (``read_image(path, f)``, libjpeg's DCT scaling) has ceil(W / f) x ceil(H / f) pixels, pixel
i standing for file pixels [i f, (i + 1) f): when f does not divide a side, the array reaches past the file's edge
by up to f - 1 pixels, so it must be placed by its true scale, not stretched onto the file's size. Such a decode
comes back as a :class:`ReducedImage` that says which part of the file it spans (:func:`pixel_extent`).
"""

from __future__ import annotations

import math
import os
import shutil
import struct
import warnings
from pathlib import Path

import cv2
import numpy as np

from detrain.config.keys import MAX_PIXELS
from detrain.data.image_header import image_byte_limit, opencv_reason, pixel_problem
from detrain.errors import DatasetError
from detrain.system.input_file import open_input, read_input_array, reason_of
from detrain.system.tempfiles import temp_beside

_REDUCED_FLAGS = {
    1: cv2.IMREAD_COLOR,
    2: cv2.IMREAD_REDUCED_COLOR_2,
    4: cv2.IMREAD_REDUCED_COLOR_4,
    8: cv2.IMREAD_REDUCED_COLOR_8,
}
RESIZE_INTERPOLATION = cv2.INTER_LINEAR
FULL_EXTENT = (0.0, 0.0, 1.0, 1.0)
# EXIF orientation -> whether the displayed x and y axes run backwards through the stored pixel rows/columns
# (5 to 8 also swap the axes). OpenCV applies the orientation after decoding, so the short last block of a side
# lands first on a reversed axis.
_REVERSED_XY = {
    1: (False, False),
    2: (True, False),
    3: (True, True),
    4: (False, True),
    5: (False, False),
    6: (True, False),
    7: (True, True),
    8: (False, True),
}
# JPEG start-of-frame markers (they carry the size); C4, C8 and CC share the range but are not frames.
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


class ReducedImage(np.ndarray):
    """A JPEG decoded at reduced scale whose pixels do not tile the file exactly (see the module docstring).

    ``extent`` = (x0, y0, x1, y1): the rectangle the whole array spans, in fractions of the (EXIF-rotated) file's
    width and height, e.g. (0, 0, 1.00997, 1.02463) for a 301 x 203 file decoded at 1/8 as 38 x 26 pixels. Arrays
    derived from one (views, copies) are plain images again: their extent is the whole file.
    """

    extent: tuple[float, float, float, float] = FULL_EXTENT

    def __array_finalize__(self, obj: object) -> None:
        self.extent = FULL_EXTENT


def pixel_extent(pixels: np.ndarray) -> tuple[float, float, float, float]:
    """The part of its file that ``pixels`` spans, as fractions (x0, y0, x1, y1): (0, 0, 1, 1) for any image
    but a :class:`ReducedImage`, whose extent is its own.

    >>> pixel_extent(np.zeros((4, 4, 3), np.uint8))
    (0.0, 0.0, 1.0, 1.0)
    """
    return pixels.extent if type(pixels) is ReducedImage else FULL_EXTENT


def load_size(shape_hw: tuple[int, int], imgsz: int) -> tuple[int, int]:
    """(h, w) after :func:`resize_long_side` of an image of ``shape_hw``.

    >>> load_size((480, 640), 320)
    (240, 320)
    """
    h0, w0 = shape_hw
    r = imgsz / max(h0, w0)
    if r == 1:
        return h0, w0
    return min(math.ceil(h0 * r), imgsz), min(math.ceil(w0 * r), imgsz)


def resize_long_side(img: np.ndarray, imgsz: int) -> np.ndarray:
    """Resize so the long side is ``imgsz``, exactly as YOLOv8's ``load_image`` (see the module docstring).

    >>> resize_long_side(np.zeros((480, 640, 3), np.uint8), 320).shape
    (240, 320, 3)
    """
    h, w = load_size(img.shape[:2], imgsz)
    if (h, w) == img.shape[:2]:
        return img
    return cv2.resize(img, (w, h), interpolation=RESIZE_INTERPOLATION)


def reduce_factor(long_side: int, needed_long_side: float) -> int:
    """The largest JPEG decode reduction (1, 2, 4 or 8) that still leaves at least ``needed_long_side`` pixels.

    >>> reduce_factor(4000, 640), reduce_factor(1000, 640), reduce_factor(1280, 640)
    (4, 1, 2)
    """
    for f in (8, 4, 2):
        if long_side >= f * needed_long_side:
            return f
    return 1


def read_image(path: str, reduce: int = 1, max_pixels: int = MAX_PIXELS) -> np.ndarray | None:
    """BGR uint8 (H, W, 3) decoded at 1/``reduce`` scale (DCT scaling for JPEG); None if unreadable.

    Bytes are read as ``np.fromfile`` reads them and decoded with ``cv2.imdecode``, as YOLOv8 does: the same pixels
    (EXIF orientation applied), non-ASCII paths work, and it is a little faster than ``cv2.imread``.
    ``read_image("missing.jpg")`` -> None. So is a FIFO or a device (never waited on), a file whose header declares
    more than ``max_pixels`` pixels or cannot be read (:mod:`detrain.data.image_header`), and any decoder error.

    Only JPEGs are decoded at reduced scale: for other formats OpenCV decodes everything and then shrinks to
    floor(W / f) with a bilinear resize, a second resampling that saves nothing. A reduced JPEG decode whose
    pixels overhang the file is a :class:`ReducedImage` (see the module docstring).
    """
    return read_image_why(path, reduce, max_pixels)[0]


def read_image_why(path: str, reduce: int = 1, max_pixels: int = MAX_PIXELS) -> tuple[np.ndarray | None, str]:
    """:func:`read_image`'s pixels, or None and the reason in a few words (for predict's "skipped" lines)."""
    try:
        data = read_input_array(path, image_byte_limit(max_pixels))
    except OSError as e:
        return (
            None,
            f"unreadable image file ({reason_of(e) if not isinstance(e, FileNotFoundError) else 'no such file'})",
        )
    if not data.size:
        return None, "empty image file (0 bytes)"
    problem = pixel_problem(data, max_pixels)
    if problem is not None:
        return None, problem
    return _decoded(data, reduce)


def read_image_bytes(data: np.ndarray, reduce: int = 1) -> np.ndarray | None:
    """:func:`read_image` of a file's bytes already read (and checked against ``max_pixels``)."""
    return _decoded(data, reduce)[0]


def _decoded(data: np.ndarray, reduce: int) -> tuple[np.ndarray | None, str]:
    if reduce > 1 and not is_jpeg(data):
        reduce = 1
    try:
        img = cv2.imdecode(data, _REDUCED_FLAGS[reduce])
    except (cv2.error, MemoryError) as e:
        return None, f"not a readable image ({opencv_reason(e)})"
    if img is None:
        return None, "not a readable image (OpenCV cannot decode it)"
    if img.ndim != 3 or img.shape[2] != 3:  # IMREAD_COLOR gives 3 channels; be sure
        img = cv2.cvtColor(img, cv2.COLOR_GRAY2BGR) if img.ndim == 2 else img[..., :3]
    if reduce > 1:
        img = _placed(img, data, reduce)
    return img, ""


def is_jpeg(data: np.ndarray) -> bool:
    """Whether the bytes start with a JPEG's start-of-image marker."""
    return data.size >= 2 and data[0] == 0xFF and data[1] == 0xD8


def _placed(img: np.ndarray, data: np.ndarray, f: int) -> np.ndarray:
    """``img`` (a 1/``f`` decode of the JPEG ``data``) as a :class:`ReducedImage` when a side is not a multiple of
    ``f``; as it is when it tiles the file exactly, or when its header cannot be read (then it is stretched)."""
    header = jpeg_header(data)
    if header is None:
        return img
    width, height, orientation = header
    if orientation >= 5:  # OpenCV swaps the axes
        width, height = height, width
    h, w = img.shape[:2]
    if (w, h) != (-(-width // f), -(-height // f)):  # not libjpeg's scaled size: leave it to be stretched
        return img
    if w * f == width and h * f == height:
        return img
    rev_x, rev_y = _REVERSED_XY[orientation]
    (x0, x1), (y0, y1) = _span(w * f, width, rev_x), _span(h * f, height, rev_y)
    out = img.view(ReducedImage)
    out.extent = (x0, y0, x1, y1)
    return out


def _span(covered: int, size: int, reversed_axis: bool) -> tuple[float, float]:
    """Where ``covered`` file pixels' worth of decoded pixels lie along a side of ``size``, as fractions: from the
    start, or (reversed axis) ending at the far edge."""
    over = (covered - size) / size
    return (-over, 1.0) if reversed_axis else (0.0, 1.0 + over)


def reduced_jpeg_grid(
    width: int, height: int, orientation: int, f: int
) -> tuple[tuple[int, int], tuple[float, float, float, float]]:
    """(h, w) and :func:`pixel_extent` of the pixels :func:`read_image` gives for a JPEG stored as ``width`` x
    ``height`` with EXIF ``orientation`` at reduction ``f``, from the header alone (``augment_device=gpu``
    decodes elsewhere and needs the same grid).

    >>> reduced_jpeg_grid(301, 203, 1, 8)
    ((26, 38), (0.0, 0.0, 1.0099667774086378, 1.0246305418719213))
    """
    if orientation >= 5:  # OpenCV swaps the axes
        width, height = height, width
    w, h = -(-width // f), -(-height // f)
    if w * f == width and h * f == height:
        return (h, w), FULL_EXTENT
    rev_x, rev_y = _REVERSED_XY.get(orientation, (False, False))
    (x0, x1), (y0, y1) = _span(w * f, width, rev_x), _span(h * f, height, rev_y)
    return (h, w), (x0, y0, x1, y1)


def jpeg_header(data: np.ndarray) -> tuple[int, int, int] | None:
    """(width, height, EXIF orientation 1-8) as stored in a JPEG's header, before any rotation; None when no frame
    header comes before the image data. A missing or unreadable orientation counts as 1 (as OpenCV reads it).

    >>> ok, enc = cv2.imencode(".jpg", np.zeros((5, 7, 3), np.uint8))
    >>> jpeg_header(enc.ravel())
    (7, 5, 1)
    """
    n, pos, orientation = int(data.size), 2, 1
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return None
        marker = int(data[pos + 1])
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            pos += 2
            continue
        length = (int(data[pos + 2]) << 8) | int(data[pos + 3])
        if marker in _SOF_MARKERS and pos + 9 <= n:
            height = (int(data[pos + 5]) << 8) | int(data[pos + 6])
            width = (int(data[pos + 7]) << 8) | int(data[pos + 8])
            return width, height, orientation
        if marker in (0xDA, 0xD9):  # image data or its end before any frame header
            return None
        if marker == 0xE1 and orientation == 1:
            orientation = _exif_orientation(data[pos + 4 : pos + 2 + length].tobytes())
        pos += 2 + length
    return None


def _exif_orientation(segment: bytes) -> int:
    """The Orientation tag (0x0112) of IFD0 in an APP1 segment's payload; 1 if absent or invalid."""
    if not segment.startswith(b"Exif\x00\x00"):
        return 1
    tiff = segment[6:]
    order = {b"II": "<", b"MM": ">"}.get(tiff[:2])
    if order is None:
        return 1
    try:
        (ifd,) = struct.unpack_from(order + "I", tiff, 4)
        (count,) = struct.unpack_from(order + "H", tiff, ifd)
        for k in range(count):
            tag, kind = struct.unpack_from(order + "HH", tiff, ifd + 2 + 12 * k)
            if tag == 0x0112 and kind == 3:  # SHORT
                (value,) = struct.unpack_from(order + "H", tiff, ifd + 2 + 12 * k + 8)
                return value if 1 <= value <= 8 else 1
    except struct.error:
        return 1
    return 1


def npy_path(im_file: str) -> Path:
    """Where ``cache=disk`` keeps the decoded pixels of ``im_file``: beside it, suffix ``.npy``."""
    return Path(im_file).with_suffix(".npy")


def read_npy(im_file: str, max_pixels: int = MAX_PIXELS) -> np.ndarray | None:
    """The decoded image from the disk cache, decoding and storing it first if needed (None if unreadable).

    The file is written through a temporary name and a rename, so a reader (another rank or worker) never sees a
    half-written array; two writers of the same image write the same bytes. A read-only image folder only costs
    the cache (one warning), not the run.
    """
    path = npy_path(im_file)
    if path.exists() and path.stat().st_mtime >= _mtime(im_file):  # older than the image: stale
        cached = _load_npy(path, max_pixels)
        if cached is not None:
            return cached
    img = read_image(im_file, max_pixels=max_pixels)
    if img is None:
        return None
    tmp: str | None = None
    try:
        fd, tmp = temp_beside(path.with_name(path.stem), ".npy.tmp")
        with os.fdopen(fd, "wb") as f:
            np.save(f, img, allow_pickle=False)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        warnings.warn(f"cache=disk: cannot write {path} ({e}); decoding that image every time", stacklevel=2)
    return img


def _load_npy(path: Path, max_pixels: int) -> np.ndarray | None:
    """The (H, W, 3) uint8 array of a ``.npy`` cache file, or None for anything else: a truncated or foreign file,
    a FIFO or device (refused, not waited on), or a header declaring more than ``max_pixels`` pixels (checked
    before anything is allocated)."""
    try:
        with open_input(path, 3 * max_pixels + (1 << 20)) as f:
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                return None
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(f)
            if fortran or dtype != np.uint8 or len(shape) != 3 or shape[2] != 3 or math.prod(shape) > 3 * max_pixels:
                return None
            arr = np.empty(shape, np.uint8)
            return arr if f.readinto(arr.data.cast("B")) == arr.size else None
    except (OSError, ValueError, EOFError):
        return None


def _mtime(path: str) -> float:
    """Modification time of ``path``, or -inf if it is gone (then a cached copy is all there is)."""
    try:
        return os.stat(path).st_mtime
    except OSError:
        return float("-inf")


def check_disk_cache_fits(im_files: list[str], shapes_hw: list[tuple[int, int]]) -> None:
    """Refuse ``cache=disk`` if the missing ``.npy`` files would not fit on the image folder's disk.

    Prints one line: the GB still to write vs the GB free.
    """
    missing = [(f, s) for f, s in zip(im_files, shapes_hw) if not npy_path(f).exists()]
    needed = sum(h * w * 3 + 128 for _, (h, w) in missing)
    if not missing:
        return
    folder = Path(missing[0][0]).parent
    free = shutil.disk_usage(folder).free
    print(
        f"disk cache: {needed / 1e9:.1f} GB of .npy files to write beside the images, {free / 1e9:.1f} GB free "
        f"on {folder}",
        flush=True,
    )
    if needed > free:
        raise DatasetError(
            f"cache=disk needs {needed / 1e9:.1f} GB for {len(missing)} decoded images beside "
            f"{folder} but only {free / 1e9:.1f} GB are free; use cache=ram, cache=False or free space"
        )
