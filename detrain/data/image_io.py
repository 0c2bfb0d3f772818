"""Reading images: YOLO's load-size rule, JPEG decoding at reduced scale, and the ``.npy`` disk cache.

``load_image`` reproduces YOLOv8's (Ultralytics 8.4) validation preprocessing bit for bit: BGR from
``cv2.imread``; if ``r = imgsz / max(h0, w0) != 1``, ``cv2.resize`` to
``(min(ceil(w0 * r), imgsz), min(ceil(h0 * r), imgsz))`` with ``INTER_LINEAR`` (8.4 uses linear both ways;
older releases used INTER_AREA to shrink for validation).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import cv2
import numpy as np

from detrain.errors import DatasetError

_REDUCED_FLAGS = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
                  8: cv2.IMREAD_REDUCED_COLOR_8}
RESIZE_INTERPOLATION = cv2.INTER_LINEAR


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


def read_image(path: str, reduce: int = 1) -> np.ndarray | None:
    """BGR uint8 (H, W, 3) decoded at 1/``reduce`` scale (DCT scaling for JPEG); None if unreadable.

    Bytes are read with numpy and decoded with ``cv2.imdecode``, as YOLOv8 does: the same pixels (EXIF
    orientation applied), non-ASCII paths work, and it is a little faster than ``cv2.imread``.
    ``read_image("missing.jpg")`` -> None.
    """
    try:
        data = np.fromfile(path, np.uint8)
    except OSError:
        return None
    if not data.size:
        return None
    try:
        img = cv2.imdecode(data, _REDUCED_FLAGS[reduce])
    except cv2.error:
        return None
    if img is not None and (img.ndim != 3 or img.shape[2] != 3):  # IMREAD_COLOR gives 3 channels; be sure
        img = cv2.cvtColor(img, cv2.COLOR_GRAY2BGR) if img.ndim == 2 else img[..., :3]
    return img


def npy_path(im_file: str) -> Path:
    """Where ``cache=disk`` keeps the decoded pixels of ``im_file``: beside it, suffix ``.npy``."""
    return Path(im_file).with_suffix(".npy")


def read_npy(im_file: str) -> np.ndarray | None:
    """The decoded image from the disk cache, decoding and storing it first if needed (None if unreadable).

    The file is written through a temporary name and a rename, so a reader (another rank or worker) never sees a
    half-written array; two writers of the same image write the same bytes. A read-only image folder only costs
    the cache (one warning), not the run.
    """
    path = npy_path(im_file)
    if path.exists() and path.stat().st_mtime >= _mtime(im_file):  # older than the image: stale
        try:
            arr = np.load(path, allow_pickle=False)
            if arr.dtype == np.uint8 and arr.ndim == 3 and arr.shape[2] == 3:
                return arr
        except (OSError, ValueError):
            pass  # a truncated or foreign file: decode again and replace it
    img = read_image(im_file)
    if img is None:
        return None
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".npy.tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.save(f, img, allow_pickle=False)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        warnings.warn(f"cache=disk: cannot write {path} ({e}); decoding that image every time", stacklevel=2)
    return img


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
    print(f"disk cache: {needed / 1e9:.1f} GB of .npy files to write beside the images, {free / 1e9:.1f} GB free "
          f"on {folder}", flush=True)
    if needed > free:
        raise DatasetError(f"cache=disk needs {needed / 1e9:.1f} GB for {len(missing)} decoded images beside "
                           f"{folder} but only {free / 1e9:.1f} GB are free; use cache=ram, cache=False or free space")
