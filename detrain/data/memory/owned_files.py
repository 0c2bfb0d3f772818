"""Files a process made in shared memory and must remove itself: nothing else frees ``/dev/shm``.

An :class:`OwnedFile` is removed by :func:`release` (its owner object dropped, or the interpreter exiting: the
caller ties it to ``weakref.finalize``), and on SIGINT/SIGTERM. Only the process that made the file removes it:
forked children (dataloader workers) inherit the registry and the handlers but never remove anything. A file is
removed only if the name still points to the file that was made (same device and inode), so a newer file put
under the same name by another process is left alone.

Signals: while this process owns a file, SIGINT and SIGTERM go through :func:`_on_signal`, installed over the
handler that was there (only from the main thread, and never over an ignored signal or a handler set outside
Python). If that handler was a Python function (SIGINT's ``KeyboardInterrupt``, a caller's own handler), it is
called and nothing else happens: the process may go on using its files, and if it ends, its exit removes them.
If it was the default action, which ends the process without running any exit code, the files are removed, the
default action is restored and the signal raised again, so the process still ends "killed by SIGTERM" for its
parent and shell. When the last file is released, the previous handlers are put back (if nobody replaced ours).
Python runs a handler when the main thread is next in the interpreter: while it is blocked inside native code
(a collective, a CUDA call), the signal takes effect when that returns. SIGKILL cannot be caught; what it leaves
is for the next run to reclaim (see :mod:`detrain.data.memory.process_owner`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_live: dict[int, OwnedFile] = {}
_previous: dict[int, Any] = {}  # signal -> the handler ours replaced


class OwnedFile:
    """The file ``name`` in the folder open as ``folder_fd`` (duplicated: this object closes its own copy)."""

    def __init__(self, folder_fd: int, name: str) -> None:
        self.pid = os.getpid()
        self.folder_fd = os.dup(folder_fd)
        self.name = name
        self.ident: tuple[int, int] | None = None  # (st_dev, st_ino) of the file made

    def made(self, st: os.stat_result) -> None:
        """Record which file is ours (from ``fstat`` of the descriptor that created it)."""
        self.ident = (st.st_dev, st.st_ino)

    def remove(self) -> None:
        """Unlink the file if this is the process that made it and the name still points to it."""
        if os.getpid() != self.pid or self.ident is None:
            return
        with contextlib.suppress(OSError):
            st = os.stat(self.name, dir_fd=self.folder_fd, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == self.ident:
                os.unlink(self.name, dir_fd=self.folder_fd)


def own(entry: OwnedFile) -> OwnedFile:
    """Remove ``entry`` on SIGINT/SIGTERM until it is released; returns it."""
    _live[id(entry)] = entry
    _install()
    return entry


def release(entry: OwnedFile) -> None:
    """Remove the file (in its owner process) and forget it; the last release puts the signal handlers back."""
    entry.remove()
    if _live.pop(id(entry), None) is not None:
        with contextlib.suppress(OSError):
            os.close(entry.folder_fd)
    if not _live:
        _restore()


def remove_all() -> None:
    """Remove every file this process owns (the files stay registered; their release finds them gone)."""
    for entry in list(_live.values()):
        entry.remove()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
        return
    remove_all()
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)  # delivered to this thread before it returns: the process ends here
    os._exit(128 + signum)  # not reached


def _install() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # signal.signal works in the main thread only
    for sig in SIGNALS:
        if sig in _previous:
            continue
        handler = signal.getsignal(sig)
        if handler is None or handler == signal.SIG_IGN or handler is _on_signal:
            continue  # set outside Python (cannot be chained) or ignored (the process does not end)
        signal.signal(sig, _on_signal)
        _previous[sig] = handler


def _restore() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, handler in list(_previous.items()):
        if signal.getsignal(sig) is _on_signal:
            signal.signal(sig, handler)
            del _previous[sig]
