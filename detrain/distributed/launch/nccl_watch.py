"""NCCL's watchdog as the launcher sees it: its words, and the workers' stderr relayed through the launcher so that a
worker it ended can be told from one that crashed.

On gloo a collective that waits in vain raises in Python, and the worker's own error names the rank that stopped
(:func:`detrain.distributed.dist.silent_peers_error`). On NCCL the collective runs on the GPU; torch's watchdog thread
finds it overdue, logs one line and takes the process down with SIGABRT (no Python error, no error file)::

    [rank0]:[E1126 10:00:00.000000000 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation
    timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=120000) ran for 120010
    milliseconds before timing out.

(one line; the wording is the same in torch 2.4 to 2.14, with the ``[rankN]:`` prefix and NumelIn/NumelOut in the
newer ones), and when the watchdog itself hangs, its monitor logs ``ProcessGroupNCCL's watchdog got stuck for 480
seconds ...`` before ending the process. A Python error of an NCCL collective whose peer went away says ``remote
process exited or there was a network error`` (``ncclRemoteError``) or that the communicator ``was aborted``.

Where the workers use NCCL, detrain's launcher passes their stderr (this process's descriptor 2, which spawned
workers inherit) through a pipe that a thread copies to the real stderr while it reads each line for those words
(:func:`relayed_stderr`), so the failure's one line can say that a rank was ended by the watchdog, and name the rank
that stopped (:func:`detrain.distributed.heartbeat.stopped_early`), instead of "killed by SIGABRT".

>>> watchdog_finding("[rank1]:[E1126 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation "
...     "timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, Timeout(ms)=120000) ran for 120010 milliseconds before "
...     "timing out.")
WatchdogFinding(rank=1, text="NCCL's watchdog: ALLREDUCE #5 waited 120s for the other ranks", waited=True)
>>> peer_gone("DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356, remote process exited or there was a "
...           "network error, NCCL version 2.21.5")
True
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

_TIMEOUT = re.compile(
    r"\[Rank (\d+)\] Watchdog caught collective operation timeout: WorkNCCL\((.*?)\) ran for (\d+) milliseconds"
)
_STUCK = re.compile(r"(?:\[rank(\d+)\]:|Rank (\d+)\]).*ProcessGroupNCCL's watchdog got stuck for (\d+) seconds")
_FIELD = re.compile(r"(SeqNum|OpType)=([^,)]+)")
# an NCCL collective's Python error when its peer went away (ncclRemoteError), or its communicator was aborted
_PEER_GONE = (
    "remote process exited",
    "remote process exiting",
    "communicator was aborted",
    "collective operation timeout",
)


@dataclass(frozen=True)
class WatchdogFinding:
    """What NCCL's watchdog logged before it ended a rank: ``waited`` when a collective timed out waiting for the
    other ranks (the rank only noticed that another stopped), not when the watchdog itself was stuck."""

    rank: int
    text: str
    waited: bool


def watchdog_finding(line: str) -> WatchdogFinding | None:
    """The finding of one line of a worker's stderr, or None when it is not the watchdog's."""
    m = _TIMEOUT.search(line)
    if m:
        fields = dict(_FIELD.findall(m.group(2)))
        what = fields.get("OpType", "a collective") + (f" #{fields['SeqNum']}" if "SeqNum" in fields else "")
        waited = f"{int(m.group(3)) / 1000:.0f}s"
        return WatchdogFinding(int(m.group(1)), f"NCCL's watchdog: {what} waited {waited} for the other ranks", True)
    m = _STUCK.search(line)
    if m:
        rank = int(m.group(1) or m.group(2))
        return WatchdogFinding(rank, f"NCCL's watchdog was stuck for {m.group(3)}s (a CUDA or NCCL call hung)", False)
    return None


def peer_gone(message: str) -> bool:
    """Whether a worker's error (``"Type: text"``) is an NCCL collective's that lost or waited in vain for a peer."""
    low = message.lower()
    return "nccl" in low and any(words in low for words in _PEER_GONE)


class StderrWatch:
    """The relay's reader: copies what the workers write to the real stderr, and keeps each rank's first finding of
    NCCL's watchdog (:attr:`findings`)."""

    def __init__(self) -> None:
        self.findings: dict[int, WatchdogFinding] = {}
        self._last = time.monotonic()
        self._thread: threading.Thread | None = None

    def start(self, source: int, sink: int) -> None:
        """Read ``source`` (the pipe) until every writer has closed it, copying to ``sink``; both are closed then."""
        self._thread = threading.Thread(target=self._relay, args=(source, sink), name="detrain-stderr", daemon=True)
        self._thread.start()

    def settle(self, quiet_s: float = 0.1, limit_s: float = 1.0) -> None:
        """Wait until nothing arrived for ``quiet_s`` (what the ended workers wrote has been read), at most
        ``limit_s``."""
        end = time.monotonic() + limit_s
        while self._thread is not None and self._thread.is_alive() and time.monotonic() < end:
            if time.monotonic() - self._last >= quiet_s:
                return
            time.sleep(quiet_s / 4)

    def _relay(self, source: int, sink: int) -> None:
        """Copy, then read for the watchdog's words; nothing here may stop the loop while the workers write (a
        full pipe would block them)."""
        rest = b""
        with contextlib.ExitStack() as close:
            close.callback(os.close, source)
            close.callback(os.close, sink)
            while chunk := _read(source):
                self._last = time.monotonic()
                sink = _write_all(sink, chunk)
                *lines, rest = (rest + chunk).split(b"\n")
                rest = rest[-8192:]  # a line without an end is kept only so far
                with contextlib.suppress(Exception):
                    for line in lines:
                        found = watchdog_finding(line.decode(errors="replace"))
                        if found is not None:
                            self.findings.setdefault(found.rank, found)
                self._last = time.monotonic()


def _read(fd: int) -> bytes:
    """What the pipe holds (waiting for it); b"" once every writer has closed it, or where reading fails."""
    try:
        return os.read(fd, 65536)  # retried by Python itself when a signal interrupts it
    except OSError:
        return b""


def _write_all(fd: int, data: bytes) -> int:
    """Write all of ``data`` to ``fd``; where that fails (the terminal went away) keep reading, without copying."""
    view = memoryview(data)
    while view and fd >= 0:
        try:
            view = view[os.write(fd, view) :]
        except OSError:
            return -1
    return fd


@contextlib.contextmanager
def relayed_stderr(enabled: bool) -> Iterator[StderrWatch]:
    """For the block: this process's stderr descriptor (which the workers it spawns inherit) is a pipe that a
    :class:`StderrWatch` reads and copies to the real stderr; afterwards the real one is back. Nothing changes when
    not ``enabled`` (the watch then sees nothing)."""
    watch = StderrWatch()
    if not enabled:
        yield watch
        return
    sys.stderr.flush()
    source, sink = os.pipe()
    saved = os.dup(2)
    watch.start(source, os.dup(saved))
    os.dup2(sink, 2)
    os.close(sink)
    try:
        yield watch
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        watch.settle()
