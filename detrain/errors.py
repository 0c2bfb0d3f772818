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
