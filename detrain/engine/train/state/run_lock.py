"""One run at a time in a run folder: rank 0 holds ``run.lock`` in it for the run's life.

Two runs writing one folder interleave their ``results.csv`` rows, replace each other's ``last.pt`` and, at a start,
remove each other's unfinished writes (:func:`detrain.system.tempfiles.remove_unfinished`): a second
``detrain train resume=true`` of a run still going, or ``exist_ok=True`` into a live folder. So rank 0 takes an
exclusive ``fcntl.flock`` on ``<run folder>/run.lock`` before it writes anything there and keeps it until the run
ends, however it ends; a run that finds it taken stops with one line naming the folder and the holder (its pid and
host, which the holder writes into the file).

The kernel releases a lock when its process dies (SIGKILL, a crash): the next run takes it at once. The holder's
record then still stands in the file (a run that ends empties it), so the taker says in one line whose lock it took
over. Forked children (the data loader's workers) would keep the lock alive after the holder died, as they share
its open file: they close their copy as they start (``os.register_at_fork``). ``flock`` works across the hosts
of a network disk as far as the disk supports it (NFS maps it to its own locks).

>>> import tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> first = RunLock.take(folder)
>>> RunLock.take(folder)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
detrain.errors.ConfigError: run folder ... is in use by another run (pid ... on ...); ...
>>> first.release(); RunLock.take(folder).release()
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

from detrain.errors import ConfigError
from detrain.system.tempfiles import open_folder

NAME = "run.lock"
_OPEN = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
_HELD: list[RunLock] = []  # the locks this process holds, which a forked child lets go of


class RunLock:
    """The lock of one run folder, held by this process (:meth:`take`) until :meth:`release`."""

    def __init__(self, folder: Path, fd: int, note: str | None = None) -> None:
        self.folder, self.fd = folder, fd
        self.note = note  # a line to say: whose lock this took over (its holder died), or why there is none

    @classmethod
    def take(cls, folder: str | Path) -> RunLock:
        """Lock ``folder`` (made if missing) for this process; the folder in use by a live run is one line
        (ConfigError) naming it and the holder. A disk that cannot lock gives an unheld lock with a note."""
        folder = Path(folder)
        fd = _open(folder)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # a disk without locks (ENOLCK): go on unguarded
                os.close(fd)
                return cls(
                    folder,
                    -1,
                    f"run folder {folder} cannot be locked here ({e.strerror or e}); a second run "
                    "into it would not be stopped",
                )
            holder = _holder(fd)
            os.close(fd)
            raise ConfigError(
                f"run folder {folder} is in use by another run ({holder}); wait for it to end, or choose another "
                "name= or project="
            ) from None
        previous = _read(fd)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        with contextlib.suppress(OSError):  # the record only names the holder: a full disk does not stop the run
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
        took = None
        if previous:  # its holder died with it (a run that ends empties the record)
            took = f"run folder {folder}: took over the lock of {_describe(previous)}, which ended without releasing it"
        lock = cls(folder, fd, took)
        _HELD.append(lock)
        return lock

    def release(self) -> None:
        """Empty the record (the run ended: nobody's lock to take over) and let go. Twice is once."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        os.close(self.fd)  # the lock goes with the last descriptor of the open file
        self.fd = -1
        if self in _HELD:
            _HELD.remove(self)


def _open(folder: Path) -> int:
    """The lock file's descriptor, never reached through a link; anything but a regular file there is refused."""
    try:
        dir_fd = open_folder(folder)
        try:
            fd = os.open(NAME, _OPEN, 0o666, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:
        raise ConfigError(f"cannot lock the run folder {folder}: {e.strerror or e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"cannot lock the run folder {folder}: {folder / NAME} is not a regular file")
    return fd


def _read(fd: int) -> dict[str, object] | None:
    """The record in the lock file (None: empty or not one of ours)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _holder(fd: int) -> str:
    """The live holder, in words; its record is written right after it locks, so an empty one is waited for a
    little."""
    deadline = time.monotonic() + 2.0
    record = _read(fd)
    while record is None and time.monotonic() < deadline:
        time.sleep(0.05)
        record = _read(fd)
    return _describe(record) if record else "a process that has not written its pid yet"


def _describe(record: dict[str, object]) -> str:
    """``pid 123 on host, since ...`` from a record.

    >>> _describe({"pid": 7, "host": "n1", "since": "2026-01-02T03:04:05"})
    'pid 7 on n1, since 2026-01-02T03:04:05'
    """
    since = f", since {record['since']}" if record.get("since") else ""
    return f"pid {record.get('pid', '?')} on {record.get('host', '?')}{since}"


def _close_in_child() -> None:
    """In a forked child: close its copies of the held locks' files, so that the lock dies with the holder."""
    for lock in _HELD:
        with contextlib.suppress(OSError):
            os.close(lock.fd)
        lock.fd = -1
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)
