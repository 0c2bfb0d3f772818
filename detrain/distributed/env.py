"""Integers from the environment (launcher and scheduler variables), with a clear error for a bad one.

>>> env_int("DETRAIN_SURELY_UNSET", 3)
3
>>> env_int("RANK", 0, {"RANK": "2"})
2
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from detrain.errors import DistributedError


def env_int(key: str, default: int, env: Mapping[str, str] | None = None) -> int:
    """``int(env[key])`` (``env``: ``os.environ`` unless given), ``default`` when unset or empty; DistributedError
    naming the variable if not an int."""
    value = (os.environ if env is None else env).get(key, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise DistributedError(f"environment variable {key}={value!r} is not an integer") from None
