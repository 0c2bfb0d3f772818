"""Temporary files beside their target, for atomic writes (write, then ``os.replace``), with the permissions an
ordinary ``open()`` would give: ``tempfile.mkstemp`` creates files 0600, and a renamed temporary file would leave
``results.csv``, ``last.pt`` or an export readable by its owner only, unlike every other file a user makes.

>>> import pathlib, tempfile as t
>>> folder = pathlib.Path(t.mkdtemp())
>>> fd, tmp = temp_beside(folder / "results.csv")
>>> oct(os.stat(tmp).st_mode & 0o777) == oct(0o666 & ~umask())
True
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

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
