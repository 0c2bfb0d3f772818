"""Checks of one image and its YOLO label file, and running them over a split in parallel.

Images are fully decoded with `cv2.imdecode(IMREAD_COLOR)`: about 3 ms for a COCO image on one core, done
once per dataset, threads in parallel (OpenCV releases the GIL). A reduced or header-only read would be
cheaper but gives neither the exact size after EXIF rotation nor certainty that the pixels decode, and
both are what the data loader relies on. JPEGs without their end marker get a closer look (see `_check_jpeg`).

Example:
    >>> verify_one("/data/images/train/a.jpg", "/data/labels/train/a.txt", nc=80).status  # doctest: +SKIP
    'found'
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np

# Label coordinates this far outside [0, 1] are rounding noise and get clipped; beyond it the file is bad.
COORD_TOLERANCE = 1e-3

FOUND, MISSING, EMPTY, CORRUPT = "found", "missing", "empty", "corrupt"


@dataclass
class FileCheck:
    """The verdict on one image: its status (one of FOUND, MISSING, EMPTY, CORRUPT), size, boxes, messages."""

    status: str
    shape_hw: tuple[int, int] = (0, 0)
    cls: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    bboxes: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.float32))
    messages: list[str] = field(default_factory=list)


def verify_files(img_files: list[str], label_files: list[str], nc: int, workers: int,
                 progress: bool) -> list[FileCheck]:
    """:func:`verify_one` for each (image, label file) pair on ``workers`` threads, in order, with a progress bar."""
    jobs = list(zip(img_files, label_files))
    run = lambda job: verify_one(job[0], job[1], nc)  # noqa: E731
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


def verify_one(im_file: str, label_file: str, nc: int) -> FileCheck:
    """Decode the image and parse its labels; a missing label file makes a background image, a bad one CORRUPT."""
    shape, messages, problem = _check_image(im_file)
    if problem is not None:
        return FileCheck(CORRUPT, messages=[f"{im_file}: {problem}; image skipped"])
    try:
        text = Path(label_file).read_text(encoding="utf-8")
    except FileNotFoundError:
        return FileCheck(MISSING, shape, messages=messages)
    except (OSError, UnicodeDecodeError) as e:
        reason = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else (e.strerror or str(e))
        problem = f"{label_file}: unreadable label file ({reason}); image skipped"
        return FileCheck(CORRUPT, messages=[*messages, problem])
    cls, boxes, label_problem, notes = parse_labels(text, nc)
    messages += [f"{label_file}: {n}" for n in notes]
    if label_problem is not None:
        return FileCheck(CORRUPT, messages=[*messages, f"{label_file}: {label_problem}; image skipped"])
    return FileCheck(FOUND if len(cls) else EMPTY, shape, cls, boxes, messages)


def _check_image(im_file: str) -> tuple[tuple[int, int], list[str], str | None]:
    """(shape_hw, warnings, reason it is unusable or None)."""
    try:
        data = np.fromfile(im_file, dtype=np.uint8)
    except FileNotFoundError:
        return (0, 0), [], "image file not found"
    except OSError as e:
        return (0, 0), [], f"unreadable image file ({e.strerror or e})"
    if data.size == 0:
        return (0, 0), [], "empty image file (0 bytes)"
    if data.size >= 2 and data[0] == 0xFF and data[1] == 0xD8:
        return _check_jpeg(data)
    img = cv2.imdecode(data, cv2.IMREAD_COLOR)
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


def parse_labels(text: str, nc: int) -> tuple[np.ndarray, np.ndarray, str | None, list[str]]:
    """(cls, boxes, reason the file is unusable or None, warnings) of a YOLO label file's text: rows of
    ``class x y w h`` or polygons (their extent), coordinates clipped to [0, 1] within COORD_TOLERANCE,
    zero-size boxes and duplicate rows removed with a warning."""
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
            return _none(), _none4(), f"line {lineno}: {bad!r} is not a number", notes
        if not all(math.isfinite(v) for v in values):
            return _none(), _none4(), f"line {lineno}: non-finite value (nan or inf)", notes
        if len(values) == 5:
            box = values[1:]
        elif len(values) >= 7 and len(values) % 2 == 1:  # a polygon, as in segment labels: use its extent
            xs, ys = values[1::2], values[2::2]
            box = [(min(xs) + max(xs)) / 2, (min(ys) + max(ys)) / 2, max(xs) - min(xs), max(ys) - min(ys)]
            if any(not -COORD_TOLERANCE <= v <= 1 + COORD_TOLERANCE for v in values[1:]):
                return _none(), _none4(), f"line {lineno}: polygon coordinate outside [0, 1]", notes
        else:
            return (
                _none(),
                _none4(),
                f"line {lineno}: {len(values)} columns; expected 5 (class x_center y_center width height) "
                "or a polygon (class x1 y1 x2 y2 x3 y3 ...)",
                notes,
            )
        c = values[0]
        if c != int(c) or not 0 <= c < nc:
            reason = f"line {lineno}: class id {c:g} out of range for nc={nc} (valid 0-{nc - 1})"
            return _none(), _none4(), reason, notes
        bad = next((v for v in box if not -COORD_TOLERANCE <= v <= 1 + COORD_TOLERANCE), None)
        if bad is not None:
            return (
                _none(),
                _none4(),
                f"line {lineno}: coordinate {bad:g} outside [0, 1] "
                "(boxes are normalised x_center y_center width height)",
                notes,
            )
        rows.append([c, *box])
    if not rows:
        return _none(), _none4(), None, notes
    arr = np.clip(np.array(rows, np.float64), 0.0, [np.inf, 1.0, 1.0, 1.0, 1.0])
    keep = (arr[:, 3] > 0) & (arr[:, 4] > 0)
    if not keep.all():
        notes.append(f"{int((~keep).sum())} zero-size box(es) removed")
        arr = arr[keep]
    _, first = np.unique(arr, axis=0, return_index=True)
    if len(first) < len(arr):
        notes.append(f"{len(arr) - len(first)} duplicate row(s) removed")
        arr = arr[np.sort(first)]
    return arr[:, 0].astype(np.int64), arr[:, 1:].astype(np.float32), None, notes


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

