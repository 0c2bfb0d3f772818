"""Temporary files beside their target, for atomic writes (write, then ``os.replace``), with the permissions an
ordinary ``open()`` would give: ``tempfile.mkstemp`` creates files 0600, and a renamed temporary file would leave
``results.csv``, ``last.pt`` or an export readable by its owner only, unlike every other file a user makes.

Writes into a run folder never go through a planted symbolic link (:func:`atomic_file`, :func:`write_atomic`):
the target's folder is opened with ``O_NOFOLLOW`` (with ``root``, every folder from ``root`` down is), the
temporary file is created exclusively in that open folder and renamed over the target's name there, so a link
already at the target's name is replaced, never followed, and a folder that is a link is refused with
:class:`UnsafePath`. :func:`folder_problem` says why a run folder must not be used (a link, another user's).

>>> import pathlib, tempfile as t
>>> folder = pathlib.Path(t.mkdtemp())
>>> fd, tmp = temp_beside(folder / "results.csv")
>>> oct(os.stat(tmp).st_mode & 0o777) == oct(0o666 & ~umask())
True
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from detrain.system.procfs import status_value


def umask() -> int:
    """This process's umask: from /proc where Linux shows it (no change of state), else set and put back."""
    shown = status_value("self", "Umask")
    if shown is not None:
        try:
            return int(shown, 8)
        except ValueError:
            pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temp_beside(path: str | Path, suffix: str = ".tmp") -> tuple[int, str]:
    """``(fd, name)`` of a new, exclusively created file in ``path``'s folder (``.<name>.<random><suffix>``) whose
    mode is ``0666 & ~umask``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    return fd, tmp


_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(OSError):
    """A folder detrain was to write into is a symbolic link (or not a folder): nothing is written."""


def folder_problem(path: str | Path) -> str | None:
    """Why the existing folder ``path`` must not receive a run's files, in words, or None: it is a symbolic link,
    not a folder, or owned by another user (a shared ``runs/`` where someone planted it). Missing: None."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        return f"'{path}' is a symbolic link (to '{os.readlink(path)}'); detrain does not write through links"
    if not stat.S_ISDIR(info.st_mode):
        return f"'{path}' is not a folder"
    if info.st_uid != os.geteuid():
        return f"'{path}' belongs to another user (uid {info.st_uid})"
    return None


def open_folder(folder: str | Path, root: str | Path | None = None) -> int:
    """A descriptor of ``folder``, made if missing, reached without following a link: with ``root`` (an ancestor of
    ``folder``), every folder below ``root`` is opened with ``O_NOFOLLOW`` one by one; without it, ``folder``
    itself is (its ancestors are the user's own paths). :class:`UnsafePath` names the link found."""
    folder = Path(folder)
    parts: tuple[str, ...]
    if root is None and folder.name in ("", ".."):  # the working folder or a parent: the user's own
        base, parts = folder, ()
    elif root is None:
        folder.parent.mkdir(parents=True, exist_ok=True)
        base, parts = folder.parent, (folder.name,)
    else:
        base, parts = Path(root), folder.relative_to(root).parts
        base.mkdir(parents=True, exist_ok=True)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    where = base
    try:
        for part in parts:
            where = where / part
            child = _step(fd, part, where)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _step(fd: int, part: str, where: Path) -> int:
    """The descriptor of folder ``part`` inside the open folder ``fd`` (made if missing, never through a link)."""
    try:
        try:
            child = os.open(part, _FOLDER, dir_fd=fd)
        except FileNotFoundError:
            with suppress(FileExistsError):  # made by another process meanwhile
                os.mkdir(part, 0o777, dir_fd=fd)
            child = os.open(part, _FOLDER, dir_fd=fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            kind = "a symbolic link" if os.path.islink(where) else "not a folder"
            raise UnsafePath(f"'{where}' is {kind}; detrain writes no file through it") from None
        raise
    return child


@contextmanager
def atomic_file(
    path: str | Path, root: str | Path | None = None, mode: str = "wb", sync: bool = False
) -> Iterator[IO[Any]]:
    """A new file to write ``path``'s content into; on success it takes ``path``'s name (``sync``: flushed to disk
    first), on any error it is removed. See the module docstring for what is never followed."""
    path = Path(path)
    folder = open_folder(path.parent, root)
    tmp = f".{path.name}.{secrets.token_hex(6)}.tmp"
    try:
        fd = os.open(tmp, _NEW_FILE, 0o666, dir_fd=folder)  # the umask applies, as for open()
        try:
            with os.fdopen(fd, mode) as f:
                yield f
                f.flush()
                if sync:
                    os.fsync(f.fileno())
            os.replace(tmp, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            with suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=folder)
            raise
    finally:
        os.close(folder)


def keep_generation(path: str | Path, previous: str) -> bool:
    """Before ``path`` is replaced: make the file it is now also ``previous`` (a name in its folder), in place
    atomically, ``path`` untouched; returns False where there is no regular file at ``path``. A hard link costs
    neither time nor space until ``path`` is replaced; a filesystem without hard links gets a copy. Nothing is
    followed through a link (:func:`atomic_file`'s rules)."""
    path = Path(path)
    folder = open_folder(path.parent)
    try:
        try:
            info = os.stat(path.name, dir_fd=folder, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(info.st_mode):
            return False
        tmp = f".{previous}.{secrets.token_hex(6)}.tmp"  # remove_unfinished's pattern: a killed keep is cleaned
        try:
            try:
                os.link(path.name, tmp, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                _copy_in(folder, path.name, tmp)
            os.replace(tmp, previous, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            with suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=folder)
            raise
        return True
    finally:
        os.close(folder)


def _copy_in(folder: int, src: str, dst: str) -> None:
    """Copy the file ``src`` to the new file ``dst``, both in the open ``folder``, flushed to disk."""
    fin = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
    with os.fdopen(fin, "rb") as r, os.fdopen(os.open(dst, _NEW_FILE, 0o666, dir_fd=folder), "wb") as w:
        shutil.copyfileobj(r, w, 1 << 20)
        w.flush()
        os.fsync(w.fileno())


def write_atomic(path: str | Path, data: str | bytes, root: str | Path | None = None) -> Path:
    """Write ``data`` (text or bytes) to ``path`` whole or not at all, through no link (:func:`atomic_file`)."""
    with atomic_file(path, root, "w" if isinstance(data, str) else "wb") as f:
        f.write(data)
    return Path(path)


_TEMP_NAME = re.compile(r"\.(.+)\.[0-9a-f]{12}\.tmp")  # what atomic_file names its temporary files


def remove_unfinished(folder: str | Path) -> list[str]:
    """Remove the temporary files that writes killed before their rename left in ``folder`` (``atomic_file``'s
    ``.<name>.<12 hex>.tmp``; SIGKILL, a power loss or a full disk gives them no chance to clean up): regular files
    of this user only, never followed through a link; returns the names removed. Call where no write of this run
    can be under way (a run's start, on the rank that writes)."""
    try:
        fd = open_folder(folder)
    except OSError:
        return []  # no such folder yet, or one detrain writes nothing into
    removed = []
    try:
        for name in os.listdir(fd):
            if not _TEMP_NAME.fullmatch(name):
                continue
            with suppress(OSError):
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                    os.unlink(name, dir_fd=fd)
                    removed.append(name)
    finally:
        os.close(fd)
    return sorted(removed)
