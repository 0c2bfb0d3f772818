"""Whether a tensor or a model is sharded (``parallel=fsdp``), answered without importing torch's sharding
packages: ``torch.distributed.tensor`` and ``torch.distributed.fsdp`` cost every process ~0.6 s of CPU to import
(they pull in sympy), and a DDP or single-process run never needs them. No DTensor and no ``fully_shard`` model
can exist before its module is imported, so a module missing from ``sys.modules`` answers "no" by itself.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

from torch import nn

if TYPE_CHECKING:  # for the type checker only: importing it is what this module avoids
    from torch.distributed.tensor import DTensor


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    """Whether ``t`` is a DTensor (a sharded parameter, its gradient or its optimizer state).

    >>> import torch
    >>> is_dtensor(torch.zeros(1))
    False
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is a ``fully_shard`` root (its parameters DTensors).

    >>> is_sharded(nn.Linear(1, 1))
    False
    """
    module = sys.modules.get("torch.distributed.fsdp")
    return module is not None and isinstance(model, module.FSDPModule)
