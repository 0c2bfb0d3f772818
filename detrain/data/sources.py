"""What ``detrain predict source=...`` names, as a list of items to read and where each one's outputs go.

A source is one of: an image file; a video file; a folder (its images and videos, recursively); a glob
(``imgs/**/*.jpg``); a ``.txt`` list of paths (one a line, each an image, a video or a folder; relative lines are
found from the working directory, then from the list's folder); a camera index (``0``); a stream URL
(``rtsp://``, ``rtmp://``, ``http(s)://``, ``tcp://``, ``udp://``, ``srt://``), read by OpenCV. From Python, a list of
paths and in-memory BGR images (numpy arrays, as ``cv2.imread`` gives them) too.

Every item carries ``rel``: the path of its outputs under the run folder, the source's own path relative to the
folder, the glob's fixed part or the list's common folder, so that same-named files in different folders
keep different outputs. ``rel`` never leaves the run folder (no ``..``, never absolute).

Hostile input, and what happens:

* files that are neither images nor videos in a folder, glob or list: skipped, summarised in one warning;
  hidden files and folders (``.name``) and the predict project folder (earlier results) are not entered;
* a folder that links back into itself: each real folder is walked once;
* a ``.txt`` list that is not UTF-8 text, or names a path that does not exist: one line naming the list and
  the line; a list naming another ``.txt`` does not recurse (it is skipped as a non-image);
* a URL with a password: the password never appears in messages, in ``Results.path`` or in file names;
  other URL schemes (``file://``, ``ftp://``...) are refused;
* a file of another kind named directly (``source=notes.pdf``): one line naming the suffixes that work.

>>> [(i.kind, str(i.rel)) for i in parse_source("0").items]
[('camera', 'camera0')]
>>> mask_url("rtsp://admin:secret@10.0.0.2/live")
'rtsp://admin:***@10.0.0.2/live'
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Literal
from urllib.parse import urlsplit

import numpy as np

from detrain.data.dataset_yaml import IMG_FORMATS, MAX_LIST_BYTES
from detrain.errors import ConfigError
from detrain.system.input_file import read_input_text, reason_of
from detrain.system.text import shown

IMAGE_SUFFIXES = frozenset("." + s for s in IMG_FORMATS)
VIDEO_SUFFIXES = frozenset(
    {".asf", ".avi", ".gif", ".m4v", ".mkv", ".mov", ".mp4", ".mpeg", ".mpg", ".ts", ".webm", ".wmv"}
)
STREAM_SCHEMES = ("rtsp", "rtsps", "rtmp", "rtmps", "http", "https", "tcp", "udp", "srt")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_GLOB_MAGIC = re.compile(r"[*?[]")
Kind = Literal["image", "video", "camera", "stream", "array"]
SOURCE_KINDS = "an image, a video, a folder, a glob, a .txt list, a camera index (0) or a stream URL (rtsp://...)"


@dataclass(frozen=True, eq=False)
class SourceItem:
    """One thing to read: an image or video file, a camera, a stream, or an in-memory image.

    ``target`` is what is opened (a path, the camera index, the URL); ``name`` is how it is shown and what
    ``Results.path`` holds (the URL without its password); ``rel`` is where its outputs go under the run folder.
    """

    kind: Kind
    target: str
    rel: PurePosixPath
    name: str
    pixels: np.ndarray | None = field(default=None, repr=False)

    @property
    def live(self) -> bool:
        """A camera or a stream: frames are taken one at a time, as they come."""
        return self.kind in ("camera", "stream")

    @property
    def is_video(self) -> bool:
        """Read frame by frame (a video file, a camera or a stream); the annotated frames make one video."""
        return self.kind in ("video", "camera", "stream")


@dataclass(frozen=True)
class Source:
    """The items of a source, in order, and the files left out (neither image nor video).

    ``single`` says the user named exactly one image, video, camera or stream: if it cannot be read, that is an
    error; from a folder, glob or list an unreadable file is skipped with a warning.
    """

    items: tuple[SourceItem, ...]
    skipped: tuple[str, ...] = ()
    single: bool = False


def mask_url(url: str) -> str:
    """The URL with any password replaced by ``***`` (for messages, results and file names)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return shown(url)
    if parts.password is None:
        return shown(url)
    userinfo, host = parts.netloc.rsplit("@", 1)
    user = userinfo.split(":", 1)[0]
    return shown(url.replace(parts.netloc, f"{user}:***@{host}", 1))


def safe_name(text: str, fallback: str = "stream") -> str:
    """A file name made of ``text``'s letters, digits, ``.``, ``_`` and ``-`` (other characters become ``_``)."""
    name = re.sub(r"[^\w.-]", "_", text).strip("._")[:100]
    return name or fallback


def safe_rel(path: str, root: str) -> PurePosixPath:
    """``path`` relative to ``root`` for the run folder; its bare name if it would leave the folder."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    parts = PurePosixPath(Path(rel).as_posix()).parts
    if not parts or rel.startswith("..") or os.path.isabs(rel) or ".." in parts:
        return PurePosixPath(safe_name(os.path.basename(path), "image"))
    return PurePosixPath(*parts)


def file_kind(path: str) -> Kind | None:
    """``image`` or ``video`` by the file's suffix; None for anything else."""
    suffix = os.path.splitext(path)[1].lower()
    return "image" if suffix in IMAGE_SUFFIXES else "video" if suffix in VIDEO_SUFFIXES else None


def parse_source(
    source: str | int | Path | np.ndarray | Sequence[str | Path | np.ndarray], exclude: str | Path | None = None
) -> Source:
    """The items ``source`` names (see the module docstring). ``exclude``: a folder never entered (the predict
    project, where earlier results lie). Raises :class:`ConfigError` for an empty, missing or unusable source."""
    if isinstance(source, np.ndarray):
        return Source((_array_item(source, 0),), single=True)
    if isinstance(source, (list, tuple)):
        return _from_python_list(source, exclude)
    if isinstance(source, bool) or not isinstance(source, (str, int, Path)):
        raise ConfigError(
            f"source must be a path, a camera index, a URL or an image array, not {type(source).__name__}"
        )
    text = str(source).strip()
    if not text:
        raise ConfigError(f"predict needs source=<{SOURCE_KINDS}>")
    url = _URL.match(text)
    if url:
        return Source((_stream_item(text, url.group(1)),), single=True)
    path = Path(text)
    if text.isdigit() and not path.exists():
        return Source(
            (SourceItem("camera", text, PurePosixPath(f"camera{int(text)}"), f"camera {int(text)}"),), single=True
        )
    if path.is_dir():
        return _collect([str(path)], str(path), exclude, f"folder '{shown(text)}'")
    if path.is_file():
        if path.suffix.lower() == ".txt":
            return _from_txt_list(path, exclude)
        kind = file_kind(text)
        if kind is None:
            raise ConfigError(
                f"source '{shown(text)}' is not an image ({', '.join(sorted(IMAGE_SUFFIXES))}), a video "
                f"({', '.join(sorted(VIDEO_SUFFIXES))}) or a .txt list"
            )
        return Source((SourceItem(kind, text, PurePosixPath(path.name), shown(text)),), single=True)
    if _GLOB_MAGIC.search(text):
        matches = sorted(glob.glob(text, recursive=True))
        return _collect(matches, _glob_root(text), exclude, f"glob '{shown(text)}'", walk=False)
    raise ConfigError(f"source '{shown(text)}' does not exist; use {SOURCE_KINDS}")


def _stream_item(url: str, scheme: str) -> SourceItem:
    if scheme.lower() not in STREAM_SCHEMES:
        raise ConfigError(
            f"source '{mask_url(url)}': URL scheme '{shown(scheme)}' is not a stream OpenCV reads here; "
            f"use {', '.join(s + '://' for s in STREAM_SCHEMES)}"
        )
    parts = urlsplit(url)
    last = [p for p in parts.path.split("/") if p]
    stem = os.path.splitext(last[-1])[0] if last else (parts.hostname or "")
    return SourceItem("stream", url, PurePosixPath(safe_name(stem)), mask_url(url))


def _array_item(pixels: np.ndarray, index: int) -> SourceItem:
    bad_channels = pixels.ndim == 3 and pixels.shape[2] not in (1, 3, 4)
    if pixels.dtype != np.uint8 or pixels.ndim not in (2, 3) or bad_channels or not pixels.size:
        raise ConfigError(
            f"image array {index}: expected uint8 (H, W, 3) BGR as cv2.imread gives, got "
            f"{pixels.dtype} {tuple(pixels.shape)}"
        )
    return SourceItem("array", f"image{index}", PurePosixPath(f"image{index}.jpg"), f"image{index}", pixels)


def _from_python_list(entries: Sequence[str | Path | np.ndarray], exclude: str | Path | None) -> Source:
    if not entries:
        raise ConfigError(f"predict got an empty list as source; give {SOURCE_KINDS}")
    if all(isinstance(e, np.ndarray) for e in entries):
        return Source(tuple(_array_item(e, i) for i, e in enumerate(entries)))  # type: ignore[arg-type]
    paths = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, (str, Path)):
            raise ConfigError(
                f"source list entry {i}: expected a path, got {type(entry).__name__} (a list is either "
                "all paths or all image arrays)"
            )
        if not Path(entry).exists():
            raise ConfigError(f"source list entry {i}: '{shown(str(entry))}' does not exist")
        paths.append(str(entry))
    return _collect(paths, _common_folder(paths), exclude, "the source list")


def _from_txt_list(list_file: Path, exclude: str | Path | None) -> Source:
    try:
        lines = read_input_text(list_file, MAX_LIST_BYTES).splitlines()
    except OSError as e:  # a FIFO or device is refused, never waited on
        if reason_of(e) == "not UTF-8 text":
            raise ConfigError(f"source list '{shown(str(list_file))}' is not UTF-8 text (one path a line)") from None
        raise ConfigError(f"source list '{shown(str(list_file))}' cannot be read: {reason_of(e)}") from None
    paths = []
    for number, line in enumerate(lines, 1):
        entry = line.strip()
        if not entry:
            continue
        found = entry if os.path.exists(entry) else str(list_file.parent / entry)
        if not os.path.exists(found):
            raise ConfigError(
                f"source list '{shown(str(list_file))}' line {number}: '{shown(entry)}' does not exist "
                f"(relative paths are looked up from the working directory, then from the list's folder)"
            )
        paths.append(found)
    if not paths:
        raise ConfigError(f"source list '{shown(str(list_file))}' names no files (one image, video or folder a line)")
    return _collect(paths, _common_folder(paths), exclude, f"source list '{shown(str(list_file))}'")


def _common_folder(paths: Iterable[str]) -> str:
    folders = [os.path.abspath(p) if os.path.isdir(p) else os.path.dirname(os.path.abspath(p)) for p in paths]
    return os.path.commonpath(folders)


def _glob_root(pattern: str) -> str:
    """The folder a glob's matches lie under: its parts before the first one with a wildcard."""
    parts = Path(pattern).parts
    fixed = []
    for part in parts[:-1]:
        if _GLOB_MAGIC.search(part):
            break
        fixed.append(part)
    return str(Path(*fixed)) if fixed else "."


def _collect(paths: Iterable[str], root: str, exclude: str | Path | None, what: str, walk: bool = True) -> Source:
    """Items for ``paths`` (files, and folders walked when ``walk``), outputs placed relative to ``root``."""
    excluded = os.path.realpath(exclude) if exclude else None
    items: list[SourceItem] = []
    skipped: list[str] = []
    seen_dirs: set[str] = set()
    for path in paths:
        files = _walk(path, excluded, seen_dirs) if walk and os.path.isdir(path) else [path]
        for file in files:
            if not os.path.isfile(file):
                continue
            kind = file_kind(file)
            if kind is None:
                skipped.append(shown(file))
                continue
            items.append(SourceItem(kind, file, safe_rel(file, root), shown(file)))
    if not items:
        raise ConfigError(
            f"{what} has no images ({', '.join(sorted(IMAGE_SUFFIXES))}) or videos "
            f"({', '.join(sorted(VIDEO_SUFFIXES))})"
        )
    return Source(tuple(items), tuple(skipped))


def _walk(folder: str, excluded: str | None, seen_dirs: set[str]) -> list[str]:
    """Every file under ``folder``, sorted, not entering hidden folders, ``excluded`` or a folder twice."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen_dirs or (excluded and real == excluded):
            dirnames[:] = []
            continue
        seen_dirs.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out += [os.path.join(dirpath, f) for f in sorted(filenames) if not f.startswith(".")]
    return out
