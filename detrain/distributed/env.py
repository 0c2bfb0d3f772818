"""Integers from the environment (launcher and scheduler variables), with a clear error for a bad one.

>>> env_int("DETRAIN_SURELY_UNSET", 3)
3
"""

from __future__ import annotations

import os

from detrain.errors import DistributedError


def env_int(key: str, default: int) -> int:
    """``int(os.environ[key])``, ``default`` when unset or empty; DistributedError naming the variable if not an int."""
    value = os.environ.get(key, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise DistributedError(f"environment variable {key}={value!r} is not an integer") from None
