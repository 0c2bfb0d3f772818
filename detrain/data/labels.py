"""Verify every image and YOLO label file once, in parallel, and cache the result beside the labels.

A bad file never stops training: it is reported with its reason and skipped. The cache (`labels/<split>.cache`,
an `.npz` read with `allow_pickle=False`) carries a hash of the file list, every file's size and mtime and
`nc`, so any change to the dataset rebuilds it.

Images are fully decoded with `cv2.imdecode(IMREAD_COLOR)`: about 3 ms for a COCO image on one core, done
once per dataset, threads in parallel (OpenCV releases the GIL). A reduced or header-only read would be
cheaper but gives neither the exact size after EXIF rotation nor certainty that the pixels decode, and
both are what the data loader relies on. JPEGs without their end marker get a closer look (see `_check_jpeg`).

Example:
    >>> records, report = load_labels(info.train, nc=len(info.names))  # doctest: +SKIP
    >>> print(report.summary("train"))  # doctest: +SKIP
    train: 128 images, 126 with labels, 2 missing, 0 empty, 0 corrupt (cache: .../labels/train2017.cache)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np

from detrain.errors import DatasetError

__all__ = [
    "LabelRecord",
    "LabelReport",
    "load_labels",
    "img2label_path",
    "default_cache_path",
    "dataset_hash",
    "wait_for_cache",
]

CACHE_VERSION = 1
# Label coordinates this far outside [0, 1] are rounding noise and get clipped; beyond it the file is bad.
COORD_TOLERANCE = 1e-3

_FOUND, _MISSING, _EMPTY, _CORRUPT = "found", "missing", "empty", "corrupt"


@dataclass
class LabelRecord:
    """One usable image and its boxes.

    Example:
        >>> r = LabelRecord("a.jpg", (480, 640), np.zeros(0, np.int64), np.zeros((0, 4), np.float32))
        >>> r.shape_hw
        (480, 640)
    """

    im_file: str
    shape_hw: tuple[int, int]  # as cv2.imread returns it, i.e. after EXIF rotation
    cls: np.ndarray  # (n,) int64
    bboxes_xywhn: np.ndarray  # (n, 4) float32, normalised x_center y_center width height


@dataclass
class LabelReport:
    """What verification found: counts per kind, one message per problem, and where the cache lives.

    `found + missing + empty + corrupt == total`; corrupt images are the ones left out of the records.

    Example:
        >>> LabelReport(total=2, found=1, missing=1).summary("val")
        'val: 2 images, 1 with labels, 1 missing, 0 empty, 0 corrupt (no cache)'
    """

    total: int = 0
    found: int = 0
    missing: int = 0
    empty: int = 0
    corrupt: int = 0
    messages: list[str] = field(default_factory=list)
    cache_path: Path | None = None
    from_cache: bool = False

    def summary(self, prefix: str = "") -> str:
        """One line for the log, e.g. `train: 128 images, 126 with labels, 2 missing, 0 empty, 0 corrupt (cache: ...)`.

        Example:
            >>> LabelReport(total=1, found=1).summary()
            '1 images, 1 with labels, 0 missing, 0 empty, 0 corrupt (no cache)'
        """
        where = f"cache: {self.cache_path}" if self.cache_path is not None else "no cache"
        head = f"{prefix}: " if prefix else ""
        return (
            f"{head}{self.total} images, {self.found} with labels, {self.missing} missing, {self.empty} empty, "
            f"{self.corrupt} corrupt ({where})"
        )


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


def default_cache_path(label_files: list[str]) -> Path:
    """Where the cache for these labels goes: `labels/<split>.cache` beside the first label's folder.

    Falls back to `$DETRAIN_CACHE_DIR/labels` (default `~/.cache/detrain/labels`) when that folder's
    parent is missing or read-only, e.g. a dataset on a shared read-only mount.

    Example:
        >>> str(default_cache_path(["/tmp/labels/train/a.txt"]))  # doctest: +SKIP
        '/tmp/labels/train.cache'
    """
    label_dir = Path(label_files[0]).parent if label_files else Path("labels")
    beside = label_dir.parent / f"{label_dir.name}.cache"
    # the mode bits too: root passes os.access everywhere, yet a folder marked read-only should stay untouched
    if (label_dir.parent.is_dir() and os.access(label_dir.parent, os.W_OK)
            and label_dir.parent.stat().st_mode & stat.S_IWUSR):
        return beside
    base = Path(os.environ.get("DETRAIN_CACHE_DIR") or Path.home() / ".cache" / "detrain").expanduser()
    digest = hashlib.sha256(str(beside).encode()).hexdigest()[:12]
    return base / "labels" / f"{label_dir.name}-{digest}.cache"


def dataset_hash(img_files: list[str], label_files: list[str], nc: int) -> str:
    """A hash of the file list, each image's and label's size and mtime, `nc` and the cache version.

    Example:
        >>> len(dataset_hash([], [], 80))
        64
    """
    h = hashlib.sha256(f"detrain-labels v{CACHE_VERSION} nc={nc}\n".encode())
    for im, lb in zip(img_files, label_files):
        h.update(f"{im}\t{_stat_key(im)}\t{lb}\t{_stat_key(lb)}\n".encode())
    return h.hexdigest()


def _stat_key(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return "-"
    return f"{st.st_size}:{st.st_mtime_ns}"


def load_labels(
    img_files: list[str],
    nc: int,
    cache: bool = True,
    workers: int = 4,
    progress: bool = True,
    build: bool = True,
    timeout_s: float = 1800.0,
    cache_path: str | Path | None = None,
) -> tuple[list[LabelRecord], LabelReport]:
    """Verify `img_files` and their YOLO labels; return the usable records and a report.

    With `cache`, a cache whose hash matches is loaded instead of verifying again, and a fresh one is
    written atomically after verifying. Under DDP let local rank 0 call with `build=True` and the other
    ranks with `build=False`: they wait (up to `timeout_s`) for the cache the lead writes, then load it.

    Example:
        >>> records, report = load_labels(["/data/images/train/a.jpg"], nc=80, progress=False)  # doctest: +SKIP
        >>> report.summary("train")  # doctest: +SKIP
        'train: 1 images, 1 with labels, 0 missing, 0 empty, 0 corrupt (cache: /data/labels/train.cache)'
    """
    if isinstance(nc, bool) or not isinstance(nc, (int, np.integer)) or nc < 1:
        raise DatasetError(f"load_labels: nc={nc!r} is invalid; it must be a positive integer")
    nc = int(nc)
    img_files = [os.fspath(f) for f in img_files]
    label_files = [img2label_path(f) for f in img_files]
    path = (Path(cache_path) if cache_path is not None else default_cache_path(label_files)) if cache else None
    if path is not None and img_files:
        digest = dataset_hash(img_files, label_files, nc)
        cached = _read_cache(path, digest)
        if cached is None and not build:
            wait_for_cache(path, timeout_s, digest)
            cached = _read_cache(path, digest)
        if cached is not None:
            return cached
    results = _verify_all(img_files, label_files, nc, workers, progress)
    records, report = _assemble(img_files, label_files, results)
    if path is not None and img_files:
        try:
            _write_cache(path, digest, records, report)
            report.cache_path = path
        except OSError as e:
            report.messages.append(
                f"cannot write label cache {path} ({e.strerror or e}); verification runs again next time"
            )
    return records, report


def wait_for_cache(path: str | Path, timeout_s: float, expected_hash: str | None = None, poll_s: float = 0.5) -> None:
    """Block until `path` holds a readable label cache (with `expected_hash`, if given).

    Raises `DatasetError` naming the file after `timeout_s`. Used by the non-building ranks of a node.

    Example:
        >>> wait_for_cache("/data/labels/train.cache", timeout_s=600)  # doctest: +SKIP
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


# ---- verification ---------------------------------------------------------------------------------------


@dataclass
class _Result:
    status: str
    shape_hw: tuple[int, int] = (0, 0)
    cls: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    bboxes: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.float32))
    messages: list[str] = field(default_factory=list)


def _verify_all(img_files: list[str], label_files: list[str], nc: int, workers: int, progress: bool) -> list[_Result]:
    jobs = list(zip(img_files, label_files))
    run = lambda job: _verify_one(job[0], job[1], nc)  # noqa: E731
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = pool.map(run, jobs, chunksize=1)
        if not progress or len(jobs) < 2:
            return list(results)
        from rich.progress import Progress

        out: list[_Result] = []
        with Progress(transient=True) as bar:
            task = bar.add_task("verifying labels", total=len(jobs))
            for r in results:
                out.append(r)
                bar.advance(task)
        return out


def _verify_one(im_file: str, label_file: str, nc: int) -> _Result:
    shape, messages, problem = _check_image(im_file)
    if problem is not None:
        return _Result(_CORRUPT, messages=[f"{im_file}: {problem}; image skipped"])
    try:
        text = Path(label_file).read_text(encoding="utf-8")
    except FileNotFoundError:
        return _Result(_MISSING, shape, messages=messages)
    except (OSError, UnicodeDecodeError) as e:
        reason = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else (e.strerror or str(e))
        return _Result(_CORRUPT, messages=[*messages, f"{label_file}: unreadable label file ({reason}); image skipped"])
    cls, boxes, label_problem, notes = _parse_labels(text, nc)
    messages += [f"{label_file}: {n}" for n in notes]
    if label_problem is not None:
        return _Result(_CORRUPT, messages=[*messages, f"{label_file}: {label_problem}; image skipped"])
    return _Result(_FOUND if len(cls) else _EMPTY, shape, cls, boxes, messages)


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


def _parse_labels(text: str, nc: int) -> tuple[np.ndarray, np.ndarray, str | None, list[str]]:
    """(cls, boxes, reason the file is unusable or None, warnings)."""
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


def _assemble(
    img_files: list[str], label_files: list[str], results: list[_Result]
) -> tuple[list[LabelRecord], LabelReport]:
    report = LabelReport(total=len(results))
    records: list[LabelRecord] = []
    for im_file, r in zip(img_files, results):
        setattr(report, r.status, getattr(report, r.status) + 1)
        report.messages.extend(r.messages)
        if r.status != _CORRUPT:
            records.append(LabelRecord(im_file, r.shape_hw, r.cls, r.bboxes))
    if report.total and report.found == 0:
        where = Path(label_files[0]).parent
        report.messages.append(
            f"no labels found for any of the {report.total} images (looked in {where} and alike); "
            "training on backgrounds only"
        )
    return records, report


# ---- cache ----------------------------------------------------------------------------------------------


def _write_cache(path: Path, digest: str, records: list[LabelRecord], report: LabelReport) -> None:
    meta = {
        "version": CACHE_VERSION,
        "hash": digest,
        "im_files": [r.im_file for r in records],
        "counts": {k: getattr(report, k) for k in ("total", "found", "missing", "empty", "corrupt")},
        "messages": report.messages,
    }
    n = np.array([len(r.cls) for r in records], np.int64)
    arrays = {
        "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8),
        "shapes": np.array([r.shape_hw for r in records], np.int64).reshape(-1, 2),
        "n": n,
        "cls": np.concatenate([r.cls for r in records]) if records else _none(),
        "bboxes": np.concatenate([r.bboxes_xywhn for r in records]) if records else _none4(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
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


def _read_cache(path: Path, digest: str) -> tuple[list[LabelRecord], LabelReport] | None:
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
