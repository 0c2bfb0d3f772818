"""Checks of one image and its YOLO label file, and running them over a split in parallel.

Images are fully decoded with `cv2.imdecode(IMREAD_COLOR)`: about 3 ms for a COCO image on one core, done
once per dataset, threads in parallel (OpenCV releases the GIL). A reduced or header-only read would be
cheaper but gives neither the exact size after EXIF rotation nor certainty that the pixels decode, and
both are what the data loader relies on. JPEGs without their end marker get a closer look (see `_check_jpeg`).

Example:
    >>> _ = cv2.imwrite("a.png", np.zeros((48, 64, 3), np.uint8))
    >>> with open("a.txt", "w") as f:
    ...     _ = f.write("1 0.5 0.5 0.25 0.5")  # class x y w h, normalised
    >>> check = verify_one("a.png", "a.txt", nc=80); check.status, check.shape_hw, check.cls.tolist()
    ('found', (48, 64), [1])
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import cv2
import numpy as np

from detrain.config.keys import MAX_PIXELS
from detrain.data.image_header import image_byte_limit, opencv_reason, pixel_problem
from detrain.system.input_file import read_input_array, read_input_text, reason_of
from detrain.system.text import excerpt, shown

# A box's centre may lie this far outside [0, 1], and its width and height exceed 1 by as much (Ultralytics'
# tolerance, 1 %): its corners are clipped to the image. Beyond it the file is unusable.
COORD_TOLERANCE = 0.01
# Corners outside the image by at most this are rounding of the label text (6 decimals), clipped but not counted.
CLIP_NOISE = 1e-5

FOUND, MISSING, EMPTY, CORRUPT = "found", "missing", "empty", "corrupt"
# A label file larger than this is not read: 16 MiB is some 300,000 boxes (or long polygons) for one image.
MAX_LABEL_BYTES = 16 << 20
# An image with more boxes than this is skipped: the loss's assigner builds dense (boxes x anchors) tensors, and 30,000
# boxes (a 1 MB label file) are 252 M (box, anchor) pairs for one image at 640 px (8,400 anchors), which stopped
# training. COCO has under 100 boxes an image and the densest crowd datasets a few thousand at most; 4,096 boxes are
# 34 M pairs an image, a bounded cost.
MAX_BOXES_PER_IMAGE = 4096


@dataclass
class FileCheck:
    """The verdict on one image: its status (one of FOUND, MISSING, EMPTY, CORRUPT), size, boxes, messages."""

    status: str
    shape_hw: tuple[int, int] = (0, 0)
    cls: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    bboxes: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.float32))
    messages: list[str] = field(default_factory=list)
    clipped: int = 0  # boxes that reached outside the image, clipped to it


class ParsedLabels(NamedTuple):
    """A label file's boxes (cls (n,) int64, bboxes (n, 4) float32 normalised xywh), or the reason the file is
    unusable; warnings; how many boxes were clipped to the image."""

    cls: np.ndarray
    bboxes: np.ndarray
    problem: str | None
    notes: list[str]
    clipped: int = 0


def verify_files(
    img_files: list[str],
    label_files: list[str],
    nc: int,
    workers: int,
    progress: bool,
    max_pixels: int = MAX_PIXELS,
) -> list[FileCheck]:
    """:func:`verify_one` for each (image, label file) pair on ``workers`` threads, in order, with a progress bar."""
    jobs = list(zip(img_files, label_files))
    run = lambda job: guarded_verify(job[0], job[1], nc, max_pixels)  # noqa: E731
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = pool.map(run, jobs, chunksize=1)
        if not progress or len(jobs) < 2:
            return list(results)
        from rich.progress import Progress

        out: list[FileCheck] = []
        with Progress(transient=True) as bar:
            task = bar.add_task("verifying labels", total=len(jobs))
            for r in results:
                out.append(r)
                bar.advance(task)
        return out


def guarded_verify(im_file: str, label_file: str, nc: int, max_pixels: int = MAX_PIXELS) -> FileCheck:
    """:func:`verify_one`, with anything a file makes it raise turned into CORRUPT with the reason: a bad file
    never stops the verification of a dataset (and so never stops training)."""
    try:
        return verify_one(im_file, label_file, nc, max_pixels)
    except MemoryError:
        return FileCheck(CORRUPT, messages=[f"{shown(im_file)}: out of memory while checking it; image skipped"])
    except Exception as e:  # noqa: BLE001  (whatever a decoder or parser raises on a hostile file is a skip)
        return FileCheck(CORRUPT, messages=[f"{shown(im_file)}: {type(e).__name__}: {excerpt(str(e))}; image skipped"])


def verify_one(im_file: str, label_file: str, nc: int, max_pixels: int = MAX_PIXELS) -> FileCheck:
    """Decode the image and parse its labels; a missing label file makes a background image, a bad one CORRUPT.

    Only regular files are read (a FIFO, a device or a link to one is CORRUPT, never waited on), a label file of at
    most :data:`MAX_LABEL_BYTES`, an image whose header declares at most ``max_pixels`` pixels."""
    shape, messages, problem = _check_image(im_file, max_pixels)
    if problem is not None:
        return FileCheck(CORRUPT, messages=[f"{shown(im_file)}: {problem}; image skipped"])
    try:
        text = read_input_text(label_file, MAX_LABEL_BYTES)
    except FileNotFoundError:
        return FileCheck(MISSING, shape, messages=messages)
    except OSError as e:
        reason = reason_of(e)
        problem = f"{shown(label_file)}: unreadable label file ({reason}); image skipped"
        return FileCheck(CORRUPT, messages=[*messages, problem])
    parsed = parse_labels(text, nc)
    messages += [f"{shown(label_file)}: {n}" for n in parsed.notes]
    if parsed.problem is not None:
        return FileCheck(CORRUPT, messages=[*messages, f"{shown(label_file)}: {parsed.problem}; image skipped"])
    return FileCheck(FOUND if len(parsed.cls) else EMPTY, shape, parsed.cls, parsed.bboxes, messages, parsed.clipped)


def _check_image(im_file: str, max_pixels: int) -> tuple[tuple[int, int], list[str], str | None]:
    """(shape_hw, warnings, reason it is unusable or None)."""
    try:
        data = read_input_array(im_file, image_byte_limit(max_pixels))
    except FileNotFoundError:
        return (0, 0), [], "image file not found"
    except OSError as e:
        return (0, 0), [], f"unreadable image file ({reason_of(e)})"
    if data.size == 0:
        return (0, 0), [], "empty image file (0 bytes)"
    too_big = pixel_problem(data, max_pixels)
    if too_big is not None:
        return (0, 0), [], too_big
    try:
        if data.size >= 2 and data[0] == 0xFF and data[1] == 0xD8:
            return _check_jpeg(data)
        img = cv2.imdecode(data, cv2.IMREAD_COLOR)
    except cv2.error as e:
        return (0, 0), [], f"not a readable image ({opencv_reason(e)})"
    if img is None:
        return (0, 0), [], "not a readable image (OpenCV cannot decode it)"
    return (int(img.shape[0]), int(img.shape[1])), [], None


def _check_jpeg(data: np.ndarray) -> tuple[tuple[int, int], list[str], str | None]:
    """JPEGs missing their end marker: keep if the pixels are all there, skip if the bottom is lost.

    `cv2.imdecode` refuses a JPEG without its end-of-image marker while `cv2.imread` (the loader) fills the
    missing rows with grey and carries on. So decode with the marker appended, and if the last rows are
    exactly the grey (128) that libjpeg fills in, the scan data stopped early: skip rather than train on it.
    """
    complete = data[-2] == 0xFF and data[-1] == 0xD9
    img = cv2.imdecode(data if complete else np.concatenate([data, np.array([0xFF, 0xD9], np.uint8)]), cv2.IMREAD_COLOR)
    if img is None:
        return (0, 0), [], "corrupt JPEG (OpenCV cannot decode it)"
    shape = (int(img.shape[0]), int(img.shape[1]))
    if complete:
        return shape, [], None
    if bool((img[-min(8, img.shape[0]) :] == 128).all()):
        return (0, 0), [], "truncated JPEG (the bottom of the image is missing)"
    return shape, ["JPEG has no end-of-image marker but decodes fully; kept"], None


def parse_labels(text: str, nc: int) -> ParsedLabels:
    """The boxes of a YOLO label file's text: rows of ``class x y w h`` or polygons (their extent).

    A box whose centre lies within the image and whose size is at most the image's, each within COORD_TOLERANCE
    (1 %, Ultralytics' rule), is kept with its corners clipped to the image (counted in ``clipped`` when a corner
    moved by more than rounding noise); anything else (a negative size, NaN, coordinates in pixels) makes the file
    unusable. Zero-size boxes (also after clipping) and duplicate rows are removed with a warning. More than
    :data:`MAX_BOXES_PER_IMAGE` boxes left after that make it unusable too.

    >>> parsed = parse_labels("0 0.995 0.5 0.02 0.2", nc=1)  # reaches 0.005 past the right edge
    >>> parsed.bboxes.astype(float).round(4).tolist(), parsed.clipped
    ([[0.9925, 0.5, 0.015, 0.2]], 1)
    """
    rows: list[list[float]] = []
    notes: list[str] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        try:
            values = [float(v) for v in fields]
        except ValueError:
            bad = next(v for v in fields if not _is_float(v))
            return _unusable(f"line {lineno}: {excerpt(bad)} is not a number", notes)
        if not all(math.isfinite(v) for v in values):
            return _unusable(f"line {lineno}: non-finite value (nan or inf)", notes)
        if len(values) == 5:
            box, what = values[1:], "box"
        elif len(values) >= 7 and len(values) % 2 == 1:  # a polygon, as in segment labels: use its extent
            xs, ys = values[1::2], values[2::2]
            box = [(min(xs) + max(xs)) / 2, (min(ys) + max(ys)) / 2, max(xs) - min(xs), max(ys) - min(ys)]
            what = "polygon"
        else:
            return _unusable(
                f"line {lineno}: {len(values)} columns; expected 5 (class x_center y_center width "
                "height) or a polygon (class x1 y1 x2 y2 x3 y3 ...)",
                notes,
            )
        c = values[0]
        if c != int(c) or not 0 <= c < nc:
            return _unusable(f"line {lineno}: class id {c:g} out of range for nc={nc} (valid 0-{nc - 1})", notes)
        problem = _box_problem(box, what)
        if problem is not None:
            return _unusable(f"line {lineno}: {problem}", notes)
        rows.append([c, *box])
    parsed = _tidy_rows(rows, notes)
    if len(parsed.cls) > MAX_BOXES_PER_IMAGE:
        return _unusable(f"too many boxes: {len(parsed.cls)}, at most {MAX_BOXES_PER_IMAGE}", notes)
    return parsed


def _tidy_rows(rows: list[list[float]], notes: list[str]) -> ParsedLabels:
    """The parsed rows (class, box) of a label file, boxes clipped to the image, zero-size boxes and duplicate rows
    removed, each change said in ``notes``."""
    if not rows:
        return ParsedLabels(_none(), _none4(), None, notes)
    arr = np.array(rows, np.float64)
    corners = np.concatenate([arr[:, 1:3] - arr[:, 3:5] / 2, arr[:, 1:3] + arr[:, 3:5] / 2], 1)
    inside = corners.clip(0.0, 1.0)
    clipped_rows = np.abs(inside - corners).max(1) > CLIP_NOISE
    arr[:, 1:3], arr[:, 3:5] = (inside[:, :2] + inside[:, 2:]) / 2, inside[:, 2:] - inside[:, :2]
    keep = (arr[:, 3] > 0) & (arr[:, 4] > 0)
    if not keep.all():
        notes.append(f"{int((~keep).sum())} zero-size box(es) removed")
        arr, clipped_rows = arr[keep], clipped_rows[keep]
    _, first = np.unique(arr, axis=0, return_index=True)
    if len(first) < len(arr):
        notes.append(f"{len(arr) - len(first)} duplicate row(s) removed")
        first = np.sort(first)
        arr, clipped_rows = arr[first], clipped_rows[first]
    clipped = int(clipped_rows.sum())
    if clipped:
        notes.append(f"{clipped} box(es) reaching outside the image clipped to it")
    return ParsedLabels(arr[:, 0].astype(np.int64), arr[:, 1:].astype(np.float32), None, notes, clipped)


def _box_problem(box: list[float], what: str) -> str | None:
    """Why the normalised (x_center, y_center, width, height) of a row is unusable, or None."""
    x, y, w, h = box
    if w < 0 or h < 0:
        return f"negative {'width' if w < 0 else 'height'} {min(w, h):g}"
    bad = next((v for v in (x, y) if not -COORD_TOLERANCE <= v <= 1 + COORD_TOLERANCE), None)
    if bad is None:
        bad = next((v for v in (w, h) if v > 1 + COORD_TOLERANCE), None)
    if bad is None:
        return None
    if what == "polygon":
        return f"polygon extent {bad:g} outside [0, 1] (polygon coordinates are normalised x y pairs)"
    return f"coordinate {bad:g} outside [0, 1] (boxes are normalised x_center y_center width height)"


def _unusable(reason: str, notes: list[str]) -> ParsedLabels:
    return ParsedLabels(_none(), _none4(), reason, notes)


def _is_float(v: str) -> bool:
    try:
        float(v)
    except ValueError:
        return False
    return True


def _none() -> np.ndarray:
    return np.zeros(0, np.int64)


def _none4() -> np.ndarray:
    return np.zeros((0, 4), np.float32)
