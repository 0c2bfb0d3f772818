"""The label cache: one `.npz` per split (read with `allow_pickle=False`), beside the labels or, for a
read-only dataset, under `~/.cache/detrain/labels`. It carries a hash of the file list, every file's size and
mtime and `nc`, so any change to the dataset rebuilds it; it is written atomically, and the other ranks of a
node wait for the one their first process writes.

Where it goes is decided by the dataset's folder (``root``), never by a line of an image list or a COCO json: a
label folder outside the dataset does not choose the place (the cache then goes to `~/.cache/detrain/labels`). It
only ever replaces an earlier label cache: a symbolic link, a special file or any file that is not a detrain label
cache at its path is left as it is, and the cache is not written (:class:`CacheRefused`).

Example (no cache written yet: None, the labels are verified):
    >>> path = default_cache_path(["data/labels/train/a.txt"])
    >>> read_cache(path, dataset_hash(["data/images/train/a.jpg"], ["data/labels/train/a.txt"], 80)) is None
    True
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from detrain.config.keys import MAX_PIXELS
from detrain.data.labels.record import LabelRecord, LabelReport
from detrain.errors import DatasetError
from detrain.system.input_file import kind_of
from detrain.system.tempfiles import temp_beside

# Part of every cache's hash: raise it whenever the checks change what a label file yields (2: boxes reaching
# outside the image are clipped, with a 1 % tolerance, and counted; 3: only regular files are read, label files
# are capped, images above max_pixels are skipped; 4: an image with more than MAX_BOXES_PER_IMAGE boxes is skipped; 5:
# the file of each message is kept, for the report's reasons per file).
CACHE_VERSION = 5


def default_cache_path(label_files: list[str], root: str | Path | None = None) -> Path:
    """Where the cache for these labels goes: `labels/<split>.cache` beside the first label folder in the dataset.

    `root` is the dataset's folder (the yaml's `path`): only a label folder whose parent lies inside it (links
    resolved) chooses the place, so a line of an image list or a COCO json that points elsewhere never does. Without
    `root` the first label's folder is taken (a caller naming its own files). Falls back to
    `$DETRAIN_CACHE_DIR/labels` (default `~/.cache/detrain/labels`), under a name hashed from where the cache would
    have gone, when no label folder is inside `root` or that folder's parent is missing or read-only, e.g. a dataset
    on a shared read-only mount.

    Example:
        >>> os.makedirs("data/labels/train")
        >>> default_cache_path(["data/labels/train/a.txt"], root="data").as_posix()
        'data/labels/train.cache'
        >>> default_cache_path(["/no/such/labels/train/a.txt"]).relative_to(Path.home()).parent.as_posix()
        '.cache/detrain/labels'
        >>> default_cache_path(["/etc/x/a.txt", "data/labels/train/b.txt"], root="data").as_posix()
        'data/labels/train.cache'
        >>> default_cache_path(["/etc/x/a.txt"], root="data").relative_to(Path.home()).parent.as_posix()
        '.cache/detrain/labels'
    """
    label_dir, inside = _label_dir(label_files, root)
    beside = label_dir.parent / f"{label_dir.name}.cache"
    # the mode bits too: root passes os.access everywhere, yet a folder marked read-only should stay untouched
    if (
        inside
        and label_dir.parent.is_dir()
        and os.access(label_dir.parent, os.W_OK)
        and label_dir.parent.stat().st_mode & stat.S_IWUSR
    ):
        return beside
    base = Path(os.environ.get("DETRAIN_CACHE_DIR") or Path.home() / ".cache" / "detrain").expanduser()
    digest = hashlib.sha256(str(beside).encode()).hexdigest()[:12]
    name = re.sub(r"[^\w.-]", "_", label_dir.name).lstrip(".") or "labels"
    return base / "labels" / f"{name}-{digest}.cache"


def _label_dir(label_files: list[str], root: str | Path | None) -> tuple[Path, bool]:
    """(the folder of the first label file whose folder's parent lies inside `root`, True); without one, (the first
    label's folder, False). Without `root`, (the first label's folder, True). Each folder is resolved once."""
    first = Path(label_files[0]).parent if label_files else Path("labels")
    if root is None:
        return first, True
    top = os.path.realpath(root)
    seen: set[str] = set()
    for label_file in label_files:
        folder = os.path.dirname(label_file)
        if folder in seen:
            continue
        seen.add(folder)
        above = os.path.realpath(Path(folder).parent)  # where the cache file would lie
        if os.path.commonpath([top, above]) == top:
            return Path(folder), True
    return first, False


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


class CacheRefused(OSError):
    """The label cache is not written: something other than a label cache is at its path (left as it is)."""


def write_cache(path: Path, digest: str, records: list[LabelRecord], report: LabelReport) -> None:
    """Write the cache atomically at `path`, replacing only an earlier label cache: :class:`CacheRefused` when a
    symbolic link, a special file or a file that is not a detrain label cache is there (it is left as it is)."""
    meta = {
        "version": CACHE_VERSION,
        "hash": digest,
        "im_files": [r.im_file for r in records],
        "counts": {k: getattr(report, k) for k in ("total", "found", "missing", "empty", "corrupt", "clipped")},
        "messages": report.messages,
        "files": report.files,
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
    problem = occupant_problem(path)
    if problem is not None:
        raise CacheRefused(f"{problem}; left as it is")
    fd, tmp = temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
        # checked again just before: what a hostile dataset holds is static, and this narrows a live race to nothing
        # a rename could avoid without renameat2's RENAME_NOREPLACE
        problem = occupant_problem(path)
        if problem is not None:
            raise CacheRefused(f"{problem}; left as it is")
        os.replace(tmp, path)  # readers see the old cache or the new one, never half of one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def occupant_problem(path: str | Path) -> str | None:
    """What is at `path` that a label cache must not replace, in a few words; None when nothing is there or an
    earlier label cache (any version) is.

    Example:
        >>> _ = Path("notes.cache").write_text("mine")
        >>> occupant_problem("notes.cache"), occupant_problem("nothing.cache")
        ('a file that is not a detrain label cache is there', None)
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"it cannot be checked ({e.strerror or e})"
    if stat.S_ISLNK(info.st_mode):
        return "a symbolic link is there"
    if not stat.S_ISREG(info.st_mode):
        return f"{kind_of(info.st_mode)} is there"
    try:
        with _open_npz(Path(path)) as npz:
            meta = _load_meta(npz)
    except _UNREADABLE:
        meta = None
    if meta is None or "version" not in meta or "hash" not in meta:
        return "a file that is not a detrain label cache is there"
    return None


# what reading a file that is not a (complete) label cache raises
_UNREADABLE = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile)
# the cache's own name only: a symbolic link is not followed, a FIFO never waited on
_OPEN_CACHE = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0)


@contextmanager
def _open_npz(path: Path) -> Iterator[Any]:
    """The `.npz` at `path` (no pickles) when `path` itself is a regular file: OSError for a link or a special file,
    ValueError for a file that is not an `.npz`."""
    with os.fdopen(os.open(path, _OPEN_CACHE), "rb") as fh:
        mode = os.fstat(fh.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(f"{kind_of(mode)}, not a regular file")
        npz = np.load(fh, allow_pickle=False)
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise ValueError("an .npy array, not an .npz")
        with npz:
            yield npz


def _load_meta(npz: Any) -> dict:
    meta = json.loads(npz["meta"].tobytes().decode())
    if not isinstance(meta, dict):
        raise ValueError("the meta record is not a mapping")
    return meta


def _cache_hash(path: Path) -> str | None:
    try:
        with _open_npz(path) as npz:
            meta = _load_meta(npz)
    except _UNREADABLE:
        return None
    return meta.get("hash") if meta.get("version") == CACHE_VERSION else None


def read_cache(path: Path, digest: str) -> tuple[list[LabelRecord], LabelReport] | None:
    """The cached records and report, or None when the cache is missing, unreadable, stale or not a regular file
    (a link at its path is not followed)."""
    try:
        with _open_npz(path) as npz:
            meta = _load_meta(npz)
            if meta.get("version") != CACHE_VERSION or meta.get("hash") != digest:
                return None
            shapes, n, cls, bboxes = npz["shapes"], npz["n"], npz["cls"], npz["bboxes"]
    except _UNREADABLE:
        return None
    ends = np.cumsum(n)
    starts = ends - n
    records = [
        LabelRecord(f, (int(s[0]), int(s[1])), cls[a:b], bboxes[a:b])
        for f, s, a, b in zip(meta["im_files"], shapes, starts, ends)
    ]
    report = LabelReport(
        **meta["counts"],
        messages=list(meta["messages"]),
        files=list(meta.get("files", [])),
        cache_path=path,
        from_cache=True,
    )
    return records, report
