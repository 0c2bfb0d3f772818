"""``events.jsonl``: a run folder's history, one JSON object per line (``time``, ``kind`` and the kind's fields).

Appended, never rewritten: each event is one ``write`` of one whole line to a file opened for appending, so a
crash leaves whole lines behind and a restarted run adds its own after them (after a newline of its own if an
earlier writer left a line unfinished); the file is flushed to disk
(fsync) when the run ends. Only rank 0 writes, on its own disk. The file is hostile input when read back
(for the previous start): only its last ``TAIL_BYTES`` are read, lines that are not JSON objects are skipped,
and a symlink, FIFO or other non-regular file there is refused rather than followed or blocked on.

>>> import tempfile, pathlib
>>> log = EventLog(pathlib.Path(tempfile.mkdtemp()) / "events.jsonl")
>>> log.write("start", world_size=1)
>>> log.last("start")["world_size"]
1
"""

from __future__ import annotations

import json
import math
import os
import stat
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from detrain.log import console
from detrain.system.file_tail import read_regular

TAIL_BYTES = 4 << 20  # how much of an old events.jsonl is read back to find the previous start
_OPEN = os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


class EventLog:
    """Appends events to ``path``; ``enabled=False`` (ranks other than 0) makes every call a no-op."""

    def __init__(self, path: str | Path, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled

    def write(self, kind: str, **fields: Any) -> None:
        """Append one event. A folder that cannot take it (a symlink or FIFO in the file's place, a full disk)
        turns event logging off for the run with one note; training goes on."""
        if not self.enabled:
            return
        event = {"time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"), "kind": kind, **fields}
        line = (json.dumps(_finite(event), separators=(",", ":"), default=str) + "\n").encode()
        try:
            fd = self._open()
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    line = b"\n" + line  # an earlier writer died mid-line: ours starts on a line of its own
                view = memoryview(line)
                while view:  # one write on a regular file; a short write (disk full) is finished, not split
                    view = view[os.write(fd, view) :]
                if kind == "end":
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            self.enabled = False
            console.print(f"{self.path}: cannot append events ({e.strerror or e}); event logging is off for this run")

    def _open(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | _OPEN, 0o644)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError("not a regular file")
        return fd

    def last(self, kind: str) -> dict[str, Any] | None:
        """The last well-formed event of ``kind`` in the file's last ``TAIL_BYTES`` (None if none, or unreadable)."""
        data = read_regular(self.path, TAIL_BYTES, tail=True)  # from the first whole line of the window
        if data is None:
            return None
        lines = data.split(b"\n")
        for raw in reversed(lines):
            try:
                event = json.loads(raw)
            except (ValueError, RecursionError):
                continue
            if isinstance(event, dict) and event.get("kind") == kind:
                return event
        return None


def _finite(value: Any) -> Any:
    """NaN and infinities as null: ``json.dumps`` would write bare ``NaN``, which strict JSON readers reject."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
