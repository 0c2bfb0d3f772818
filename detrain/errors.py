"""Errors a user can cause. The CLI prints their one-line message and exits with code 2. Also the one way an old
usage is announced as deprecated (:func:`deprecated`).
"""

from __future__ import annotations

import warnings


class DetrainError(Exception):
    """A usage error: bad arguments, a bad file, a missing dataset. One clear line, no traceback."""


class ConfigError(DetrainError):
    """An unknown key or a bad value in the arguments."""


class DatasetError(DetrainError):
    """A dataset yaml, image folder or label file that cannot be used."""


class CheckpointError(DetrainError):
    """A missing, unreadable, unsafe or incompatible weights file."""


class DistributedError(DetrainError):
    """A launch or rendezvous problem: bad devices, a busy port, an unreachable master, a dead worker."""


_ANNOUNCED: set[str] = set()


def deprecated(topic: str, message: str, stacklevel: int = 3) -> None:
    """Say once per process (one ``DeprecationWarning`` line, pointing at the caller's code) that ``topic`` goes
    away in the next release; later uses stay silent, so a loop over old code does not flood the console.

    ``stacklevel``: how many frames up the user's line is (3: the caller of the function that calls this).
    """
    if topic in _ANNOUNCED:
        return
    _ANNOUNCED.add(topic)
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel)


EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: a temporary failure; the same command may be run again


class Preempted(Exception):
    """Training stopped on a preemption signal after saving where it stands (``grace``): one line, exit code
    :data:`EXIT_PREEMPTED`. Not a :class:`DetrainError`: nothing was wrong with what the user asked."""
