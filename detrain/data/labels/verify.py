"""Verify every image and YOLO label file once, in parallel, and cache the result beside the labels.

A bad file never stops training: it is reported with its reason and skipped. The cache (`labels/<split>.cache`,
an `.npz` read with `allow_pickle=False`) carries a hash of the file list, every file's size and mtime and
`nc`, so any change to the dataset rebuilds it.

This module ties the parts together: the checks of each file are in :mod:`detrain.data.labels.check`, the cache
in :mod:`detrain.data.labels.cache`, the records and report in :mod:`detrain.data.labels.record`.

A dataset's verification (:func:`load_labels`) ends in one line of its report, e.g. ``train: 128 images, 126 with
labels, 2 missing, 0 empty, 0 corrupt (cache: .../labels/train2017.cache)``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from detrain.config.keys import MAX_PIXELS
from detrain.data.labels.cache import (
    dataset_hash,
    default_cache_path,
    occupant_problem,
    read_cache,
    wait_for_cache,
    write_cache,
)
from detrain.data.labels.check import CORRUPT, FileCheck, verify_files
from detrain.data.labels.reasons import no_labels_message
from detrain.data.labels.record import LabelRecord, LabelReport
from detrain.errors import DatasetError
from detrain.system.text import shown

__all__ = [
    "LabelRecord",
    "LabelReport",
    "dataset_hash",
    "default_cache_path",
    "img2label_path",
    "load_labels",
    "wait_for_cache",
]


def img2label_path(im_file: str | os.PathLike) -> str:
    """The label file for an image: the last `/images/` becomes `/labels/` and the suffix `.txt`.

    Example:
        >>> img2label_path("/data/coco/images/train2017/000000000009.jpg")
        '/data/coco/labels/train2017/000000000009.txt'
    """
    s = os.fspath(im_file)
    a, b = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    if a in s:
        head, tail = s.rsplit(a, 1)
        s = head + b + tail
    return os.path.splitext(s)[0] + ".txt"


def load_labels(
    img_files: list[str],
    nc: int,
    cache: bool = True,
    workers: int = 4,
    progress: bool = True,
    build: bool = True,
    timeout_s: float = 1800.0,
    cache_path: str | Path | None = None,
    max_pixels: int = MAX_PIXELS,
    root: str | Path | None = None,
) -> tuple[list[LabelRecord], LabelReport]:
    """Verify `img_files` and their YOLO labels; return the usable records and a report.

    With `cache`, a cache whose hash matches is loaded instead of verifying again, and a fresh one is
    written atomically after verifying. Under DDP let local rank 0 call with `build=True` and the other
    ranks with `build=False`: they wait (up to `timeout_s`) for the cache the lead writes, then load it.
    `max_pixels`: images whose header declares more are skipped as corrupt (part of the cache's hash).
    `root`: the dataset's folder; the cache goes inside it or to detrain's cache folder, never where a label
    folder outside it (a line of an image list) would put it (see :func:`default_cache_path`). A file at the cache's
    path that is not a label cache is never replaced: the cache is then not written, with a warning naming it.

    Example (two images, one of them labelled):
        >>> import cv2
        >>> for folder in ("data/images/train", "data/labels/train"):
        ...     os.makedirs(folder)
        >>> for name in ("a", "b"):
        ...     _ = cv2.imwrite(f"data/images/train/{name}.png", np.zeros((48, 64, 3), np.uint8))
        >>> with open("data/labels/train/a.txt", "w") as f:
        ...     _ = f.write("1 0.5 0.5 0.25 0.5")  # class x y w h, normalised
        >>> files = ["data/images/train/a.png", "data/images/train/b.png"]
        >>> records, report = load_labels(files, nc=2, progress=False, root="data")
        >>> report.summary("train")
        'train: 2 images, 1 with labels, 1 missing, 0 empty, 0 corrupt (cache: data/labels/train.cache)'
        >>> [r.cls.tolist() for r in records]
        [[1], []]
    """
    if isinstance(nc, bool) or not isinstance(nc, (int, np.integer)) or nc < 1:
        raise DatasetError(f"load_labels: nc={nc!r} is invalid; it must be a positive integer")
    nc = int(nc)
    img_files = [os.fspath(f) for f in img_files]
    label_files = [img2label_path(f) for f in img_files]
    path, digest = None, ""
    if cache and img_files:
        path = Path(cache_path) if cache_path is not None else default_cache_path(label_files, root)
        digest = dataset_hash(img_files, label_files, nc, max_pixels)
        cached = _cached(path, digest, build, timeout_s)
        if cached is not None:
            return cached
    results = verify_files(img_files, label_files, nc, workers, progress, max_pixels)
    records, report = _assemble(img_files, label_files, results)
    if path is not None:
        _save(path, digest, records, report)
    return records, report


def _cached(path: Path, digest: str, build: bool, timeout_s: float) -> tuple[list[LabelRecord], LabelReport] | None:
    """The records and report of the cache at `path` with `digest`, or None. Without `build` (a follower), wait for
    the lead's cache first, unless something else holds its place (the lead then writes none)."""
    cached = read_cache(path, digest)
    if cached is None and not build and occupant_problem(path) is None:
        wait_for_cache(path, timeout_s, digest)
        cached = read_cache(path, digest)
    return cached


def _save(path: Path, digest: str, records: list[LabelRecord], report: LabelReport) -> None:
    """Write the cache and note it in `report`; when it cannot be written (or must not: another file is there), one
    warning naming the file, and verification runs again next time."""
    try:
        write_cache(path, digest, records, report)
        report.cache_path = path
    except OSError as e:
        message = f"cannot write label cache {path} ({e.strerror or e}); verification runs again next time"
        report.add(message)
        warnings.warn(message, stacklevel=3)


def _assemble(
    img_files: list[str], label_files: list[str], results: list[FileCheck]
) -> tuple[list[LabelRecord], LabelReport]:
    report = LabelReport(total=len(results))
    records: list[LabelRecord] = []
    for im_file, label_file, r in zip(img_files, label_files, results):
        setattr(report, r.status, getattr(report, r.status) + 1)
        report.clipped += r.clipped
        for message in r.messages:
            report.add(message, _file_of(message, im_file, label_file))
        if r.status != CORRUPT:
            records.append(LabelRecord(im_file, r.shape_hw, r.cls, r.bboxes))
    none_labelled = no_labels_message(report, label_files)
    if none_labelled is not None:
        report.add(none_labelled)
    return records, report


def _file_of(message: str, im_file: str, label_file: str) -> str:
    """Which of an image's two files ``message`` is about (its ``<file>: `` prefix, as printed), "" for neither."""
    prefixes = sorted((shown(im_file), shown(label_file)), key=len, reverse=True)
    return next((p for p in prefixes if message.startswith(f"{p}: ")), "")
