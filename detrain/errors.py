"""Errors a user can cause. The CLI prints their one-line message and exits with code 2."""

from __future__ import annotations


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


EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: a temporary failure; the same command may be run again


class Preempted(Exception):
    """Training stopped on a preemption signal after saving where it stands (``grace``): one line, exit code
    :data:`EXIT_PREEMPTED`. Not a :class:`DetrainError`: nothing was wrong with what the user asked."""
