"""Fetch dataset archives once per node and put them in place without touching anything already there.

The flow for each URL: refuse a destination that exists and was not made by a detrain download (before
anything is fetched or created), take a lock beside it (so concurrent ranks on one node download once),
stream the file into a temporary file with a cap on its size, check its sha256 when one is given, check
every archive member (names, links, kinds, their count and total unpacked size) before extracting any,
extract into a fresh temporary folder, and only then put the result in place:

- a destination that does not exist (or is empty) receives the extracted folder by one rename;
- a folder that holds earlier detrain downloads (a ``.detrain-download-*`` marker) receives the new top-level
  entries by rename, and only when none of them exists there yet: nothing is ever replaced, merged into or
  deleted. Anything else is an error naming the folder.

A marker file inside the target records which URLs are done, so a second call is a no-op.

Example (over the network, so not run as a test): ``download_dataset("https://example.com/coco8.zip",
"~/.cache/detrain/datasets/coco8")``.
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
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

from detrain.errors import DatasetError
from detrain.system import net

try:  # POSIX only; elsewhere concurrent downloads are not coordinated.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = ["DownloadLimits", "download_dataset", "file_lock", "is_url", "marker_name"]

GB = 1_000_000_000
RATIO_FLOOR = 100_000_000  # an archive may always unpack to 100 MB, whatever its own size
MARKER_PREFIX = ".detrain-download-"
_MARKER = re.compile(r"\.detrain-download-[0-9a-f]{16}")
_PARTIAL = ".detrain-partial-"  # temporaries inside a folder being added to; ignored when judging it
# Archive junk that macOS adds at the top level; dropped so it neither lands in the dataset nor stops
# the single top folder from being recognised.
_JUNK = {"__MACOSX", ".DS_Store"}


@dataclass(frozen=True)
class DownloadLimits:
    """How large a dataset download may be: the file fetched, its unpacked files together (at most download_max_
    unpacked_gb, and ``max_ratio`` times the archive), their number; and whether it may go anywhere.

    Defaults as cfg/default.yaml's download_max_gb, download_max_unpacked_gb, download_max_files and
    download_anywhere.

    Example:
        >>> DownloadLimits.from_gb(1, 4, 1000).max_unpacked_bytes
        4000000000
    """

    max_bytes: int = 50 * GB
    max_unpacked_bytes: int = 200 * GB
    max_members: int = 2_000_000
    # unpacked bytes per byte of archive, above RATIO_FLOOR: images barely compress, label text some 10x; a
    # 1.6 KB tar that unpacks to 2 GB (a ratio of a million) is a bomb
    max_ratio: int = 200
    # download: may fill a path: outside the yaml's own folder and the datasets folder (download_anywhere=true)
    anywhere: bool = False

    @classmethod
    def from_gb(cls, max_gb: float, max_unpacked_gb: float, max_files: int, anywhere: bool = False) -> DownloadLimits:
        """The limits from the cfg keys (sizes in GB, 10^9 bytes)."""
        return cls(int(max_gb * GB), int(max_unpacked_gb * GB), int(max_files), anywhere=bool(anywhere))


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
    return MARKER_PREFIX + hashlib.sha256(url.encode()).hexdigest()[:16]


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
    *,
    sha256: str | None = None,
    limits: DownloadLimits | None = None,
    inside: str | Path | None = None,
) -> Path:
    """Download each URL once and extract it into `dest_dir`; return `dest_dir`.

    Archives (zip, tar, tar.gz/bz2/xz) are extracted; whose members all sit under one top folder have
    that folder stripped, so `coco8.zip` (holding `coco8/...`) fills `dest_dir` itself. Any other file is
    placed in `dest_dir` under its URL's file name. `sha256` (one URL only) is the hash the fetched file
    must have; `inside` is a folder that `dest_dir`, symlinks resolved, must lie in. Failures leave no
    partial folder and no temporary file behind and raise `DatasetError`.

    Example (over the network): ``download_dataset(["https://example.com/a.zip"], "/data/a", progress=False)``
    returns ``PosixPath('/data/a')``.
    """
    urls = [url_or_urls] if isinstance(url_or_urls, str) else list(url_or_urls)
    if sha256 is not None and len(urls) != 1:
        raise ValueError("sha256 names the hash of one URL; call download_dataset once per URL")
    limits = limits or DownloadLimits()
    dest = Path(dest_dir).expanduser().absolute()
    for url in urls:
        if not is_url(url):
            raise DatasetError(
                f"download: {url!r} is not a URL (http, https, ftp or file); put the files in {dest} by hand"
            )
    urls = [url.strip() for url in urls]
    if inside is not None:
        _check_inside(dest, Path(inside).expanduser().absolute(), urls[0])
    todo = [url for url in urls if not (dest / marker_name(url)).exists()]
    if not todo:
        return dest
    _check_target(dest, todo[0])  # before anything is fetched or created beside it
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock = dest.parent / f".{dest.name}.download.lock"
    with file_lock(lock, what=f"the download into {dest}"):
        for url in todo:
            if (dest / marker_name(url)).exists():
                continue  # done meanwhile by another rank, while we waited on the lock
            _check_target(dest, url)
            _download_one(url, dest, sha256, limits, progress, timeout_s)
    return dest


# ---- where the files may go ------------------------------------------------------------------------------


def _check_inside(dest: Path, base: Path, url: str) -> None:
    """`dest`, symlinks resolved, must be `base` or lie inside it."""
    real_dest, real_base = os.path.realpath(dest), os.path.realpath(base)
    if os.path.commonpath([real_dest, real_base]) != real_base:
        raise DatasetError(
            f"refusing to download {url} into {dest}: it resolves to {real_dest}, outside {base}; "
            f"download it by hand, or link the whole dataset folder rather than a folder inside it"
        )


def _empty_or_ours(folder: Path) -> bool:
    """Whether `folder` holds nothing (but our temporaries), or a marker of a completed detrain download."""
    empty = True
    with os.scandir(folder) as entries:
        for e in entries:
            if _MARKER.fullmatch(e.name) and e.is_file(follow_symlinks=False):
                return True
            empty = empty and e.name.startswith(_PARTIAL)
    return empty


def _check_target(dest: Path, url: str) -> None:
    """`dest` must be new, empty, or a folder holding earlier detrain downloads; anything else is refused."""
    if not os.path.lexists(dest):
        return
    if not dest.is_dir():
        what = "a broken link" if dest.is_symlink() else "not a folder"
        raise DatasetError(f"cannot download {url} into {dest}: it exists and is {what}; move it away")
    if _empty_or_ours(dest):
        return
    raise DatasetError(
        f"refusing to download {url} into {dest}: the folder exists and holds no completed detrain download "
        f"(no {MARKER_PREFIX}* file), so it is never written into; move it away to download anew, "
        f"or complete it by hand"
    )


# ---- one URL -----------------------------------------------------------------------------------------------


def _download_one(
    url: str, dest: Path, sha256: str | None, limits: DownloadLimits, progress: bool, timeout_s: float
) -> None:
    # Temporaries on the final place's filesystem, so that putting the result in place is a rename: beside a
    # new folder, inside one being added to (which may be a link to another disk).
    work, prefix = (dest, _PARTIAL) if dest.exists() else (dest.parent, f".{dest.name}.")
    fd, part_name = tempfile.mkstemp(prefix=prefix, suffix=".part", dir=work)
    os.close(fd)
    part = Path(part_name)
    stage = Path(tempfile.mkdtemp(prefix=f"{prefix}extract-", dir=work))
    stage.chmod(0o755)  # mkdtemp makes it private, and it may become the dataset folder itself
    try:
        got = _fetch(url, part, dest, progress, timeout_s, limits.max_bytes)
        if sha256 is not None and got != sha256.lower():
            raise DatasetError(f"download of {url} has sha256 {got}, expected {sha256.lower()}: deleted it")
        content = _extract(part, stage, url, dest, limits)
        (content / marker_name(url)).write_text(url + "\n")
        _place(content, dest, marker_name(url), url)
    finally:
        part.unlink(missing_ok=True)
        shutil.rmtree(stage, ignore_errors=True)


def _fetch(url: str, part: Path, dest: Path, progress: bool, timeout_s: float, max_bytes: int) -> str:
    """Stream `url` into `part`; return its sha256."""
    from detrain import __version__

    by_hand = f"download it by hand and extract it into {dest}"
    too_big = f"over download_max_gb ({max_bytes / GB:g} GB); raise download_max_gb or {by_hand}"
    headers = {"User-Agent": f"detrain/{__version__}"}
    try:
        with net.open_url(url, timeout_s, headers) as response, open(part, "wb") as out:
            total = net.content_length(response)
            if total is not None and total > max_bytes:
                raise DatasetError(f"refusing to download {url}: the server announces {total} bytes, {too_big}")
            received, digest = _copy_with_progress(response, out, total, url, progress, max_bytes)
    except net.BodyTooLarge:
        raise DatasetError(
            f"refusing to download {url}: the server sent more than {max_bytes} bytes, {too_big}"
        ) from None
    except urllib.error.HTTPError as e:
        raise DatasetError(f"cannot download {url}: the server answered HTTP {e.code} {e.reason}; {by_hand}") from None
    except net.RedirectRefused as e:
        raise DatasetError(f"cannot download {url}: {e.reason}; {by_hand}") from None
    except (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError) as e:
        reason = getattr(e, "reason", None) or e
        raise DatasetError(f"cannot download {url} ({reason}; offline?); {by_hand}") from None
    except OSError as e:
        raise DatasetError(f"cannot write the download of {url} to {part} ({e.strerror or e}); {by_hand}") from None
    if total is not None and received != total:
        raise DatasetError(f"download of {url} stopped after {received} of {total} bytes; try again or {by_hand}")
    return digest


def _copy_with_progress(
    response: Any, out: IO[bytes], total: int | None, url: str, progress: bool, max_bytes: int
) -> tuple[int, str]:
    if not progress:
        return net.copy_body(response, out, max_bytes)
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    name = posixpath.basename(urllib.parse.urlparse(url).path) or url
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, TimeRemainingColumn()) as bar:
        task = bar.add_task(f"downloading {name}", total=total)
        return net.copy_body(response, out, max_bytes, lambda n: bar.update(task, advance=n))


# ---- archives ----------------------------------------------------------------------------------------------


def _extract(archive: Path, stage: Path, url: str, dest: Path, limits: DownloadLimits) -> Path:
    """Extract into `stage` after checking every member; return the folder whose contents go to `dest`."""
    if zipfile.is_zipfile(archive):
        names = _checked_zip(archive, url, dest, limits)
        with zipfile.ZipFile(archive) as zf:
            try:
                zf.extractall(stage, members=names)
            except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
                raise DatasetError(f"cannot extract {url}: {e}; {_by_hand(dest)}") from None
    elif tarfile.is_tarfile(archive):
        with tarfile.open(archive) as tf:
            members = _checked_tar(tf, url, dest, limits, archive)
            try:
                if hasattr(tarfile, "data_filter"):  # second line of defence where Python has it
                    tf.extractall(stage, members=members, filter="data")
                else:  # pragma: no cover
                    tf.extractall(stage, members=members)
            except (tarfile.TarError, OSError, EOFError) as e:
                raise DatasetError(f"refusing to extract {url}: {e}") from None
    else:
        name = posixpath.basename(urllib.parse.urlparse(url).path)
        if name in ("", ".", "..") or name.startswith(".detrain-"):
            name = "download"
        shutil.move(archive, stage / name)
        return stage
    entries = [p for p in stage.iterdir() if p.name not in _JUNK]
    if len(entries) == 1 and entries[0].is_dir() and not entries[0].is_symlink():
        return entries[0]
    return stage


def _by_hand(dest: Path) -> str:
    return f"download it by hand and extract it into {dest}"


def _zip_entry_count(archive: Path) -> int | None:
    """The entry count the zip's end record declares, read before the central directory is loaded."""
    end_record = getattr(zipfile, "_EndRecData", None)
    if end_record is None:  # pragma: no cover
        return None
    with open(archive, "rb") as fh:
        record = end_record(fh)
    return None if not record else int(record[getattr(zipfile, "_ECD_ENTRIES_TOTAL", 4)])


def _checked_zip(archive: Path, url: str, dest: Path, limits: DownloadLimits) -> list[str]:
    """The names to extract, after checking the count, every name and the declared sizes together."""
    declared = _zip_entry_count(archive)
    if declared is not None and declared > limits.max_members:
        raise _too_many(url, declared, limits)
    try:
        with zipfile.ZipFile(archive) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise DatasetError(f"cannot read the archive from {url}: {e}; {_by_hand(dest)}") from None
    if len(infos) > limits.max_members:
        raise _too_many(url, len(infos), limits)
    total, cap = 0, _unpacked_cap(archive, limits)
    for info in infos:
        _check_member(info.filename, url, dest)
        total += info.file_size  # zipfile stops each member at its declared size (and checks its CRC)
    if total > cap:
        raise _too_large(url, total, limits, archive)
    return [info.filename for info in infos if not _is_junk(info.filename)]


def _checked_tar(
    tf: tarfile.TarFile, url: str, dest: Path, limits: DownloadLimits, archive: Path
) -> list[tarfile.TarInfo]:
    """The members to extract, read one header at a time so a bomb is refused before it is decompressed: the
    declared sizes are summed as they come and checked against the absolute cap and the ratio cap."""
    members: list[tarfile.TarInfo] = []
    total, cap = 0, _unpacked_cap(archive, limits)
    try:
        for m in tf:
            members.append(m)
            if len(members) > limits.max_members:
                raise _too_many(url, len(members), limits)
            _check_member(m.name, url, dest)
            if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
                raise DatasetError(f"refusing to extract {url}: member {m.name!r} is a device or pipe, not a file")
            total += m.size if m.isfile() else 0
            if total > cap:
                raise _too_large(url, total, limits, archive)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DatasetError(f"cannot read the archive from {url}: {e}; {_by_hand(dest)}") from None
    _check_links(members, url, dest)
    return [m for m in members if not _is_junk(m.name)]


def _too_many(url: str, count: int, limits: DownloadLimits) -> DatasetError:
    return DatasetError(
        f"refusing to extract {url}: it holds at least {count} members, over download_max_files ({limits.max_members})"
    )


def _unpacked_cap(archive: Path, limits: DownloadLimits) -> int:
    """The most bytes ``archive`` may unpack to: download_max_unpacked_gb, and ``max_ratio`` times its own size
    (at least :data:`RATIO_FLOOR`), the same rule for zip and tar."""
    return min(limits.max_unpacked_bytes, max(RATIO_FLOOR, limits.max_ratio * archive.stat().st_size))


def _too_large(url: str, total: int, limits: DownloadLimits, archive: Path) -> DatasetError:
    if total > limits.max_unpacked_bytes:
        return DatasetError(
            f"refusing to extract {url}: its files unpack to at least {total} bytes, over "
            f"download_max_unpacked_gb ({limits.max_unpacked_bytes / GB:g} GB)"
        )
    packed = archive.stat().st_size
    return DatasetError(
        f"refusing to extract {url}: its {packed} bytes unpack to at least {total} bytes, over {limits.max_ratio} "
        "times its size (a decompression bomb?); extract it by hand if you trust it"
    )


def _is_junk(name: str) -> bool:
    parts = PurePosixPath(name.replace("\\", "/")).parts
    return bool(parts) and parts[0] in _JUNK


def _parts(name: str) -> list[str]:
    return [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]


def _check_member(name: str, url: str, dest: Path) -> None:
    posix = name.replace("\\", "/")
    parts = _parts(name)
    if posix.startswith("/") or re.match(r"^[A-Za-z]:", posix) or ".." in parts:
        raise DatasetError(
            f"refusing to extract {url}: member {name!r} would land outside {dest} (absolute path or '..')"
        )
    if any(p.startswith(".detrain-") for p in parts):
        raise DatasetError(f"refusing to extract {url}: member {name!r} is named like detrain's own files")


def _single_top(members: list[tarfile.TarInfo]) -> bool:
    """Whether every member sits under one top folder (which :func:`_extract` strips)."""
    named = [(_parts(m.name), m) for m in members if _parts(m.name) and not _is_junk(m.name)]
    tops = {parts[0] for parts, _ in named}
    return len(tops) == 1 and all(len(parts) > 1 or m.isdir() for parts, m in named)


def _resolve(base: list[str], target: str, lowest: int, symlinks: set[str]) -> list[str] | None:
    """``target`` followed from the folder ``base``, by its text; None when it climbs under depth ``lowest``.

    Raises ValueError naming the symlink the path would go through (its text then says nothing about where
    it ends on disk).
    """
    if target.startswith("/") or re.match(r"^[A-Za-z]:", target):
        return None
    path = list(base)
    steps = _parts(target)
    for k, step in enumerate(steps):
        if step == "..":
            if len(path) <= lowest:
                return None
            path.pop()
            continue
        path.append(step)
        if k < len(steps) - 1 and "/".join(path) in symlinks:
            raise ValueError("/".join(path))
    return path


def _check_links(members: list[tarfile.TarInfo], url: str, dest: Path) -> None:
    """Links must resolve inside what becomes `dest`, and nothing may be reached through a symlink.

    With no path going through a symlink, following a path by its text is the same as following it on disk,
    so the text check is the whole truth. A symlink resolves from its folder and must stay under the single
    top folder when there is one (that folder becomes `dest`); a hard link resolves from the archive's root
    at extraction and must name a file, not a symlink (a hard-linked symlink would resolve from elsewhere).
    """
    symlinks = {"/".join(_parts(m.name)) for m in members if m.issym()}
    floor = 1 if _single_top(members) else 0
    for m in members:
        parts = _parts(m.name)
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in symlinks:
                raise DatasetError(
                    f"refusing to extract {url}: member {m.name!r} lies under the link {'/'.join(parts[:i])!r}"
                )
        if not (m.issym() or m.islnk()):
            continue
        base, lowest = (parts[:-1], floor) if m.issym() else ([], 0)
        try:
            resolved = _resolve(base, m.linkname.replace("\\", "/"), lowest, symlinks)
        except ValueError as through:
            raise DatasetError(
                f"refusing to extract {url}: link {m.name!r} -> {m.linkname!r} goes through the link {through}"
            ) from None
        if resolved is None or (m.islnk() and (not resolved or "/".join(resolved) in symlinks)):
            raise DatasetError(f"refusing to extract {url}: link {m.name!r} -> {m.linkname!r} points outside {dest}")


# ---- putting it in place -----------------------------------------------------------------------------------


def _place(content: Path, dest: Path, marker: str, url: str) -> None:
    """Move `content` to `dest`: one rename when `dest` is new, else add its entries, replacing nothing."""
    if not os.path.lexists(dest):
        os.replace(content, dest)  # atomic: the folder appears complete or not at all
        return
    entries = [c for c in content.iterdir() if c.name != marker]
    clash = next((c.name for c in entries if os.path.lexists(dest / c.name)), None)
    if clash is not None:
        raise DatasetError(
            f"refusing to extract {url} into {dest}: it already holds {clash!r}, which the archive would replace; "
            f"nothing was changed (move {dest / clash} away to let the download add it)"
        )
    for child in entries:
        os.rename(child, dest / child.name)
    os.replace(content / marker, dest / marker)  # last: the download counts as done only once all is there
