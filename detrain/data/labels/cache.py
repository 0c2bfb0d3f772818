"""The label cache: one `.npz` per split (read with `allow_pickle=False`), beside the labels or, for a
read-only dataset, under `~/.cache/detrain/labels`. It carries a hash of the file list, every file's size and
mtime and `nc`, so any change to the dataset rebuilds it; it is written atomically, and the other ranks of a
node wait for the one their first process writes.

Example (no cache written yet: None, the labels are verified):
    >>> path = default_cache_path(["data/labels/train/a.txt"])
    >>> read_cache(path, dataset_hash(["data/images/train/a.jpg"], ["data/labels/train/a.txt"], 80)) is None
    True
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import numpy as np

from detrain.config.keys import MAX_PIXELS
from detrain.data.labels.record import LabelRecord, LabelReport
from detrain.errors import DatasetError
from detrain.system.tempfiles import temp_beside

# Part of every cache's hash: raise it whenever the checks change what a label file yields (2: boxes reaching
# outside the image are clipped, with a 1 % tolerance, and counted; 3: only regular files are read, label files
# are capped, images above max_pixels are skipped).
CACHE_VERSION = 3


def default_cache_path(label_files: list[str]) -> Path:
    """Where the cache for these labels goes: `labels/<split>.cache` beside the first label's folder.

    Falls back to `$DETRAIN_CACHE_DIR/labels` (default `~/.cache/detrain/labels`) when that folder's
    parent is missing or read-only, e.g. a dataset on a shared read-only mount.

    Example:
        >>> os.makedirs("data/labels/train")
        >>> default_cache_path(["data/labels/train/a.txt"]).as_posix()
        'data/labels/train.cache'
        >>> default_cache_path(["/no/such/labels/train/a.txt"]).relative_to(Path.home()).parent.as_posix()
        '.cache/detrain/labels'
    """
    label_dir = Path(label_files[0]).parent if label_files else Path("labels")
    beside = label_dir.parent / f"{label_dir.name}.cache"
    # the mode bits too: root passes os.access everywhere, yet a folder marked read-only should stay untouched
    if (
        label_dir.parent.is_dir()
        and os.access(label_dir.parent, os.W_OK)
        and label_dir.parent.stat().st_mode & stat.S_IWUSR
    ):
        return beside
    base = Path(os.environ.get("DETRAIN_CACHE_DIR") or Path.home() / ".cache" / "detrain").expanduser()
    digest = hashlib.sha256(str(beside).encode()).hexdigest()[:12]
    return base / "labels" / f"{label_dir.name}-{digest}.cache"


def dataset_hash(img_files: list[str], label_files: list[str], nc: int, max_pixels: int = MAX_PIXELS) -> str:
    """A hash of the file list, each image's and label's size and mtime, `nc`, `max_pixels` and the cache version.

    Example:
        >>> len(dataset_hash([], [], 80))
        64
    """
    h = hashlib.sha256(f"detrain-labels v{CACHE_VERSION} nc={nc} max_pixels={max_pixels}\n".encode())
    for im, lb in zip(img_files, label_files):
        h.update(f"{im}\t{_stat_key(im)}\t{lb}\t{_stat_key(lb)}\n".encode())
    return h.hexdigest()


def _stat_key(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return "-"
    return f"{st.st_size}:{st.st_mtime_ns}"


def wait_for_cache(path: str | Path, timeout_s: float, expected_hash: str | None = None, poll_s: float = 0.5) -> None:
    """Block until `path` holds a readable label cache (with `expected_hash`, if given).

    Raises `DatasetError` naming the file after `timeout_s`. Used by the non-building ranks of a node.

    Example:
        >>> wait_for_cache("data/labels/train.cache", timeout_s=0)
        Traceback (most recent call last):
        ...
        detrain.errors.DatasetError: timed out after 0s waiting for the label cache data/labels/train.cache ...
    """
    path = Path(path)
    deadline = time.monotonic() + timeout_s
    while True:
        found = _cache_hash(path)
        if found is not None and (expected_hash is None or found == expected_hash):
            return
        if time.monotonic() >= deadline:
            raise DatasetError(
                f"timed out after {timeout_s:.0f}s waiting for the label cache {path} to be built by local rank 0 "
                "(did it fail? its log says why; or raise the timeout for a very large dataset)"
            )
        time.sleep(poll_s)


def write_cache(path: Path, digest: str, records: list[LabelRecord], report: LabelReport) -> None:
    meta = {
        "version": CACHE_VERSION,
        "hash": digest,
        "im_files": [r.im_file for r in records],
        "counts": {k: getattr(report, k) for k in ("total", "found", "missing", "empty", "corrupt", "clipped")},
        "messages": report.messages,
    }
    n = np.array([len(r.cls) for r in records], np.int64)
    arrays: dict[str, Any] = {
        "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8),
        "shapes": np.array([r.shape_hw for r in records], np.int64).reshape(-1, 2),
        "n": n,
        "cls": np.concatenate([r.cls for r in records]) if records else np.zeros(0, np.int64),
        "bboxes": np.concatenate([r.bboxes_xywhn for r in records]) if records else np.zeros((0, 4), np.float32),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(tmp, path)  # readers see the old cache or the new one, never half of one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load_meta(npz) -> dict:
    return json.loads(npz["meta"].tobytes().decode())


def _cache_hash(path: Path) -> str | None:
    try:
        with np.load(path, allow_pickle=False) as npz:
            meta = _load_meta(npz)
    except (OSError, ValueError, KeyError, EOFError):
        return None
    return meta.get("hash") if meta.get("version") == CACHE_VERSION else None


def read_cache(path: Path, digest: str) -> tuple[list[LabelRecord], LabelReport] | None:
    """The cached records and report, or None when the cache is missing, unreadable or stale."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            meta = _load_meta(npz)
            if meta.get("version") != CACHE_VERSION or meta.get("hash") != digest:
                return None
            shapes, n, cls, bboxes = npz["shapes"], npz["n"], npz["cls"], npz["bboxes"]
    except (OSError, ValueError, KeyError, EOFError):
        return None
    ends = np.cumsum(n)
    starts = ends - n
    records = [
        LabelRecord(f, (int(s[0]), int(s[1])), cls[a:b], bboxes[a:b])
        for f, s, a, b in zip(meta["im_files"], shapes, starts, ends)
    ]
    report = LabelReport(**meta["counts"], messages=list(meta["messages"]), cache_path=path, from_cache=True)
    return records, report
