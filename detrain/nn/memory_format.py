"""The memory format a tensor is stored in, so that a copy or a gradient can keep it (channels_last on CPU and CUDA
is what makes the convolutions fast; an op that silently turns it contiguous costs a layout change per layer)."""

from __future__ import annotations

import torch
from torch import Tensor


def memory_format_of(x: Tensor) -> torch.memory_format:
    """channels_last for a 4-D tensor stored that way (and not also plain contiguous), else contiguous.

    >>> memory_format_of(torch.zeros(1, 3, 2, 2).contiguous(memory_format=torch.channels_last))
    torch.channels_last
    """
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return torch.channels_last
    return torch.contiguous_format
