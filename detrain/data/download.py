"""Fetch dataset archives once per node and extract them safely and atomically.

The flow for each URL: take a lock beside the target folder (so concurrent ranks on one node download
once), stream the file into a temporary file in the target's parent, check every archive member stays
inside the target, extract into a temporary folder there, and rename that folder into place. A marker
file inside the target records which URLs are done, so a second call is a no-op.

Example:
    >>> from detrain.data.download import download_dataset
    >>> download_dataset("https://example.com/coco8.zip", "~/.cache/detrain/datasets/coco8")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import posixpath
import re
import shutil
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath

from detrain.errors import DatasetError

try:  # POSIX only; elsewhere concurrent downloads are not coordinated.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = ["download_dataset", "file_lock", "is_url", "marker_name"]

_CHUNK = 1 << 20
# Archive junk that macOS adds at the top level; dropped so it neither lands in the dataset nor stops
# the single top folder from being recognised.
_JUNK = {"__MACOSX", ".DS_Store"}


def is_url(value: object) -> bool:
    """True when `value` is a string naming an http, https, ftp or file URL.

    Example:
        >>> is_url("https://x.org/a.zip"), is_url("images/train")
        (True, False)
    """
    return isinstance(value, str) and urllib.parse.urlparse(value.strip()).scheme in {"http", "https", "ftp", "file"}


def marker_name(url: str) -> str:
    """Name of the file that marks `url` as downloaded and extracted inside its target folder.

    Example:
        >>> marker_name("https://x.org/a.zip").startswith(".detrain-download-")
        True
    """
    return ".detrain-download-" + hashlib.sha256(url.encode()).hexdigest()[:16]


@contextlib.contextmanager
def file_lock(path: str | Path, timeout_s: float | None = None, what: str = "the lock") -> Iterator[None]:
    """Hold an exclusive advisory lock on `path` (created if missing) for the `with` block.

    Locks are per open file, so threads and processes alike exclude each other; the kernel releases
    the lock if the holder dies, so a crashed rank never blocks the others for good.

    Example:
        >>> import tempfile, pathlib
        >>> with file_lock(pathlib.Path(tempfile.mkdtemp()) / ".lock"):
        ...     pass
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        if fcntl is not None:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline is not None and time.monotonic() > deadline:
                        raise DatasetError(
                            f"timed out after {timeout_s:.0f}s waiting for {what} ({path}); another process holds it"
                        ) from None
                    time.sleep(0.2)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def download_dataset(
    url_or_urls: str | Sequence[str],
    dest_dir: str | Path,
    progress: bool = True,
    timeout_s: float = 60.0,
) -> Path:
    """Download each URL once and extract it into `dest_dir`; return `dest_dir`.

    Archives (zip, tar, tar.gz/bz2/xz) are extracted; whose members all sit under one top folder have
    that folder stripped, so `coco8.zip` (holding `coco8/...`) fills `dest_dir` itself. Any other file is
    placed in `dest_dir` under its URL's file name. A member that would land outside the target
    (absolute path, `..`, a link pointing out, a device file) makes the whole archive refused before
    anything is written. Failures leave no partial folder behind and raise `DatasetError`.

    Example:
        >>> download_dataset(["https://example.com/a.zip"], "/data/a", progress=False)  # doctest: +SKIP
        PosixPath('/data/a')
    """
    urls = [url_or_urls] if isinstance(url_or_urls, str) else list(url_or_urls)
    dest = Path(dest_dir).expanduser().absolute()
    for url in urls:
        if not is_url(url):
            raise DatasetError(
                f"download: {url!r} is not a URL (http, https, ftp or file); put the files in {dest} by hand"
            )
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock = dest.parent / f".{dest.name}.download.lock"
    with file_lock(lock, what=f"the download into {dest}"):
        for url in urls:
            if (dest / marker_name(url)).exists():
                continue  # done earlier, maybe by another rank while we waited on the lock
            _download_one(url.strip(), dest, progress, timeout_s)
    return dest


def _download_one(url: str, dest: Path, progress: bool, timeout_s: float) -> None:
    fd, part_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    os.close(fd)
    part = Path(part_name)
    stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.extract-", dir=dest.parent))
    stage.chmod(0o755)  # mkdtemp makes it private, and it may become the dataset folder itself
    try:
        _fetch(url, part, dest, progress, timeout_s)
        content = _extract(part, stage, url, dest)
        (content / marker_name(url)).write_text(url + "\n")
        _place(content, dest, marker_name(url))
    finally:
        part.unlink(missing_ok=True)
        shutil.rmtree(stage, ignore_errors=True)


def _fetch(url: str, part: Path, dest: Path, progress: bool, timeout_s: float) -> None:
    from detrain import __version__

    by_hand = f"download it by hand and extract it into {dest}"
    request = urllib.request.Request(url, headers={"User-Agent": f"detrain/{__version__}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response, open(part, "wb") as out:
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            received = _copy_with_progress(response, out, total, url, progress)
    except urllib.error.HTTPError as e:
        raise DatasetError(f"cannot download {url}: the server answered HTTP {e.code} {e.reason}; {by_hand}") from None
    except (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError) as e:
        reason = getattr(e, "reason", None) or e
        raise DatasetError(f"cannot download {url} ({reason}; offline?); {by_hand}") from None
    except OSError as e:
        raise DatasetError(f"cannot write the download of {url} to {part} ({e.strerror or e}); {by_hand}") from None
    if total is not None and received != total:
        raise DatasetError(f"download of {url} stopped after {received} of {total} bytes; try again or {by_hand}")


def _copy_with_progress(response, out, total: int | None, url: str, progress: bool) -> int:
    received = 0
    if not progress:
        while chunk := response.read(_CHUNK):
            out.write(chunk)
            received += len(chunk)
        return received
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    name = posixpath.basename(urllib.parse.urlparse(url).path) or url
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, TimeRemainingColumn()) as bar:
        task = bar.add_task(f"downloading {name}", total=total)
        while chunk := response.read(_CHUNK):
            out.write(chunk)
            received += len(chunk)
            bar.update(task, advance=len(chunk))
    return received


def _extract(archive: Path, stage: Path, url: str, dest: Path) -> Path:
    """Extract into `stage` after checking every member; return the folder whose contents go to `dest`."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            names = [info.filename for info in zf.infolist()]
            for name in names:
                _check_member(name, url, dest)
            # zipfile writes links as plain files holding the target text, so names are all we check.
            zf.extractall(stage, members=[n for n in names if not _is_junk(n)])
    elif tarfile.is_tarfile(archive):
        with tarfile.open(archive) as tf:
            members = tf.getmembers()
            for m in members:
                _check_tar_member(m, url, dest)
            members = [m for m in members if not _is_junk(m.name)]
            try:
                if hasattr(tarfile, "data_filter"):  # second line of defence where Python has it
                    tf.extractall(stage, members=members, filter="data")
                else:  # pragma: no cover
                    tf.extractall(stage, members=members)
            except tarfile.TarError as e:
                raise DatasetError(f"refusing to extract {url}: {e}") from None
    else:
        name = posixpath.basename(urllib.parse.urlparse(url).path) or "download"
        shutil.move(archive, stage / name)
        return stage
    entries = [p for p in stage.iterdir() if p.name not in _JUNK]
    if len(entries) == 1 and entries[0].is_dir() and not entries[0].is_symlink():
        return entries[0]
    return stage


def _is_junk(name: str) -> bool:
    parts = PurePosixPath(name.replace("\\", "/")).parts
    return bool(parts) and parts[0] in _JUNK


def _check_member(name: str, url: str, dest: Path) -> None:
    posix = name.replace("\\", "/")
    parts = PurePosixPath(posix).parts
    if posix.startswith("/") or re.match(r"^[A-Za-z]:", posix) or ".." in parts:
        raise DatasetError(
            f"refusing to extract {url}: member {name!r} would land outside {dest} (absolute path or '..')"
        )


def _check_tar_member(m: tarfile.TarInfo, url: str, dest: Path) -> None:
    _check_member(m.name, url, dest)
    if m.issym() or m.islnk():
        # Symlink targets are relative to the link's folder, hard-link targets to the archive root.
        base = posixpath.dirname(m.name) if m.issym() else ""
        target = posixpath.normpath(posixpath.join(base, m.linkname))
        if m.linkname.startswith("/") or target == ".." or target.startswith("../"):
            raise DatasetError(
                f"refusing to extract {url}: link {m.name!r} -> {m.linkname!r} points outside {dest}"
            )
    elif not (m.isfile() or m.isdir()):
        raise DatasetError(f"refusing to extract {url}: member {m.name!r} is a device or pipe, not a file")


def _place(content: Path, dest: Path, marker: str) -> None:
    """Move `content` to `dest`: one rename when `dest` is new, else a merge that writes the marker last."""
    if not dest.exists() or (dest.is_dir() and not any(dest.iterdir())):
        os.replace(content, dest)  # atomic: the folder appears complete or not at all
        return
    _merge(content, dest, skip=marker)
    os.replace(content / marker, dest / marker)


def _merge(src: Path, dst: Path, skip: str = "") -> None:
    for child in src.iterdir():
        if child.name == skip:
            continue
        target = dst / child.name
        if child.is_dir() and target.is_dir() and not target.is_symlink():
            _merge(child, target)
            continue
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(child, target)
