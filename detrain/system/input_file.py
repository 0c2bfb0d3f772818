"""Reading a file a user's dataset names (an image, a label file, an image list, a yaml, a COCO json) without
trusting what it is: only a regular file is read (a symlink to one is followed, as datasets use them), a FIFO or a
device is refused without blocking on it or streaming from it, and a file over its cap is refused before a byte is
read. The kind and size are taken from the open descriptor (``fstat``), so what is checked is what is read.

Each refusal is an :class:`UnreadableFile` whose ``reason`` is a short phrase for a "skipped" or "cannot read"
message; a missing file raises ``FileNotFoundError`` as ``open`` would, so callers can tell "absent" from "bad".

>>> with open("a.txt", "wb") as f:
...     _ = f.write(b"0 0.5 0.5 0.2 0.2\\n")
>>> read_input("a.txt", 100)
b'0 0.5 0.5 0.2 0.2\\n'
>>> os.mkfifo("fifo.txt"); read_input("fifo.txt", 100)
Traceback (most recent call last):
...
detrain.system.input_file.UnreadableFile: a FIFO, not a regular file
>>> read_input("a.txt", 10)
Traceback (most recent call last):
...
detrain.system.input_file.UnreadableFile: too large: 18 bytes, at most 10 are read
"""

from __future__ import annotations

import io
import os
import stat

import numpy as np

# O_NONBLOCK: opening a FIFO for reading returns at once instead of waiting for a writer (it is then refused).
_OPEN = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)
_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
)


class UnreadableFile(OSError):
    """A file that is there but is not read: not a regular file, too large, or failing to read; ``reason`` says
    which in a few words (no path: the caller names the file)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


def reason_of(error: OSError) -> str:
    """A failed read in a few words: an :class:`UnreadableFile`'s reason, else the system's (``strerror``)."""
    if isinstance(error, UnreadableFile):
        return error.reason
    return error.strerror or str(error)


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words ("a FIFO", "a character device", ...)."""
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def read_input_array(path: str | os.PathLike, limit: int) -> np.ndarray:
    """The bytes of the regular file ``path`` as a uint8 array (what ``np.fromfile`` gives, read once into place);
    :class:`UnreadableFile` for a FIFO, a device, a folder, a file over ``limit`` bytes or a failed read,
    ``FileNotFoundError`` when it is missing."""
    fd = _open_regular(path, limit)
    try:
        size = os.fstat(fd).st_size
        out = np.empty(size, np.uint8)
        view, got = out.data, 0
        while got < size:  # a file that shrinks while read ends early: the decoder then sees what there is
            n = os.readv(fd, [view[got:]])
            if n == 0:
                break
            got += n
        return out[:got]
    except OSError as e:
        raise UnreadableFile(f"read failed ({e.strerror or e})") from None
    finally:
        os.close(fd)


def open_input(path: str | os.PathLike, limit: int) -> io.BufferedReader:
    """The regular file ``path`` opened for reading in binary, refused as :func:`read_input_array` refuses."""
    return os.fdopen(_open_regular(path, limit), "rb")


def read_input(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file ``path``, refused as :func:`read_input_array` refuses."""
    return read_input_array(path, limit).tobytes()


def read_input_text(path: str | os.PathLike, limit: int) -> str:
    """The UTF-8 text of the regular file ``path``; :class:`UnreadableFile` ("not UTF-8 text") when it is not."""
    try:
        return read_input(path, limit).decode("utf-8")
    except UnicodeDecodeError:
        raise UnreadableFile("not UTF-8 text") from None


def _open_regular(path: str | os.PathLike, limit: int) -> int:
    """A read-only descriptor of ``path`` once ``fstat`` shows a regular file of at most ``limit`` bytes."""
    try:
        fd = os.open(path, _OPEN)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(2, "No such file or directory", os.fspath(path)) from None
    except OSError as e:
        raise UnreadableFile(e.strerror or str(e)) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnreadableFile(f"{kind_of(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise UnreadableFile(f"too large: {info.st_size} bytes, at most {limit} are read")
    except BaseException:
        os.close(fd)
        raise
    return fd


__all__ = [
    "UnreadableFile",
    "kind_of",
    "open_input",
    "read_input",
    "read_input_array",
    "read_input_text",
    "reason_of",
]
