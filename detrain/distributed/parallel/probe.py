"""Every DTensor question the rest of detrain asks - is a tensor sharded, is a model, which rows of a whole tensor
this rank holds, a sharded value's plain one - answered without importing torch's sharding packages:
``torch.distributed.tensor`` and ``torch.distributed.fsdp`` cost every process ~0.6 s of CPU to import (they pull
in sympy), and a DDP or single-process run never needs them. No DTensor and no ``fully_shard`` model can exist
before its module is imported, so a module missing from ``sys.modules`` answers "no" by itself, and the row helpers
import :mod:`detrain.distributed.parallel.fsdp` only when handed a DTensor (imported already by then). For a plain
tensor each helper is the identity: engine code calls them without asking first.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeGuard

import torch
from torch import nn

if TYPE_CHECKING:  # for the type checker only: importing it is what this module avoids
    from torch.distributed.tensor import DTensor


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    """Whether ``t`` is a DTensor (a sharded parameter, its gradient or its optimizer state).

    >>> is_dtensor(torch.zeros(1))
    False
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def any_sharded(tensors: Iterable[object]) -> bool:
    """Whether any of ``tensors`` (an iterable) is sharded.

    >>> any_sharded([torch.zeros(1)])
    False
    """
    return any(is_dtensor(t) for t in tensors)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is a ``fully_shard`` root (its parameters DTensors).

    >>> is_sharded(nn.Linear(1, 1))
    False
    """
    module = sys.modules.get("torch.distributed.fsdp")
    return module is not None and isinstance(model, module.FSDPModule)


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (a replicated one's is its whole value), or ``t`` itself.

    >>> local_value(torch.ones(1))
    tensor([1.])
    """
    return t.to_local() if is_dtensor(t) else t


def own_rows(whole: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows of ``whole`` this rank holds of sharded ``like``, as a view; ``like``'s local shard): what an
    element-wise update of a whole tensor from a sharded one touches here. ``(whole, like)`` when ``like`` is plain.
    """
    if not is_dtensor(like):
        return whole, like
    from detrain.distributed.parallel import fsdp

    return fsdp.own_rows(whole, like)


def local_rows(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's rows of ``whole`` (the same on every rank) sharded as ``like`` is, no communication; ``whole``
    itself when ``like`` is plain."""
    if not is_dtensor(like):
        return whole
    from detrain.distributed.parallel import fsdp

    return fsdp.local_part(whole, like)


def gather_rows(whole: torch.Tensor, like: torch.Tensor) -> None:
    """Where ``like`` is sharded, every rank's rows of ``whole`` (each rank's own current) put together on every
    rank, in place: a collective (one all-gather), called alike on every rank; nothing for a plain ``like``."""
    if is_dtensor(like):
        from detrain.distributed.parallel import fsdp

        fsdp.gather_rows(whole, like)
