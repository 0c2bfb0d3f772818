"""Reading a file the run folder may hold without trusting what is there: a link is not followed, a FIFO or device
does not block or stream forever, and a file larger than expected is cut to its last whole lines or refused."""

from __future__ import annotations

import os
import stat
from pathlib import Path

_OPEN = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def read_regular(path: str | Path, limit: int, tail: bool) -> bytes | None:
    """A regular file's bytes; None when it is missing, a link, not a regular file, unreadable, or over ``limit``
    bytes and not ``tail``. With ``tail``, a larger file gives its last ``limit`` bytes from the first whole line.

    >>> _ = Path("lines.txt").write_bytes(b"one\\ntwo\\nthree\\n")
    >>> read_regular("lines.txt", 100, tail=False), read_regular("lines.txt", 8, tail=False)
    (b'one\\ntwo\\nthree\\n', None)
    >>> read_regular("lines.txt", 8, tail=True), read_regular("missing.txt", 8, tail=True)
    (b'three\\n', None)
    """
    try:
        fd = os.open(path, _OPEN)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        size = info.st_size
        if size > limit and not tail:
            return None
        start = max(0, size - limit)
        chunks, got = [], 0
        while got < size - start:
            chunk = os.pread(fd, min(1 << 24, size - start - got), start + got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        data = b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)
    if start:
        data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""  # from the first whole line
    return data
