"""Which values a checkpoint may use as dict keys and set items: the values the reader has to hash.

Hashing is where a pickle can make the reader work without bound for a few bytes:

- a tuple's hash is not cached and visits every element, so a tuple made of itself twice, 45 levels deep
  (1.5 KB of pickle), has 2**45 elements to visit;
- an int's hash reads every digit, and an int of a few MB hashed as a key again and again costs that each time;
- ints past 2**61, tuples, complex numbers and ``torch.Size`` can be chosen to collide, and a dict of n
  colliding keys costs n**2 / 2 comparisons to build (60,000 keys: 1.8e9).

Checkpoints key their dicts by text and small integers (state dicts, class names, optimizer state), so a
key must be one of: text or bytes (hashes randomized per process and cached), None, a bool, a float, an int
below 2**61 in size (its own hash, so no two collide), a numpy bool/integer/float scalar of such a value, or
an object hashed by identity (a data record, a tensor, a dtype, a device). Anything else is refused.

Example:
    >>> check_key("model.0.conv.weight"), check_key(79)
    (None, None)
    >>> check_key((1, 2))
    Traceback (most recent call last):
    ...
    detrain.weights.limits.Refused: a dict key or set item of type tuple (text, numbers and records only)
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from detrain.weights.limits import Refused

__all__ = ["check_key", "check_keys"]

_MODULUS = sys.hash_info.modulus  # 2**61 - 1: ints within it hash to themselves
_PLAIN = (str, bytes, bool, float, type(None))
_BY_IDENTITY = (torch.Tensor, torch.dtype, torch.device, np.dtype)


def check_key(value: Any) -> None:
    """Raise :class:`Refused` unless hashing ``value`` is cheap and cannot be made to collide."""
    kind = type(value)
    if kind in _PLAIN:
        return
    if kind is int or isinstance(value, np.integer):
        number = int(value)
        if -_MODULUS < number < _MODULUS:
            return
        raise Refused(f"a dict key or set item that is an integer of {number.bit_length()} bits")
    if isinstance(value, (np.floating, np.bool_, _BY_IDENTITY)):
        return
    kind_hash: object = kind.__hash__  # the function itself, compared by identity
    if kind_hash is object.__hash__:  # our records and reconstructors: hashed by identity
        return
    if isinstance(value, type) and kind_hash is type.__hash__:  # a record class
        return
    raise Refused(f"a dict key or set item of type {kind.__name__} (text, numbers and records only)")


def check_keys(values: Any) -> None:
    """:func:`check_key` for each value of an iterable."""
    for value in values:
        check_key(value)
