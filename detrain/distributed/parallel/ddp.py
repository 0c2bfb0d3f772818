"""``parallel=ddp`` (the default): torch's ``DistributedDataParallel``, every rank holding the whole model, its
gradients and its optimizer state; gradients all-reduced in the backward of every batch that ends with an update
(``no_sync`` for the batches that only accumulate), and rank 0's buffers sent before the forward that follows one.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def wrap(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` (on ``device``) wrapped in DDP. Collective: every rank gets rank 0's weights and buffers."""
    ids = [device.index] if device.type == "cuda" else None
    # grads as views of the buckets: no copy, and no layout mismatch with channels-last 1x1 weights; DDP
    # all-reduces the gradients in the backward pass of every batch that ends with an update (gradient_sync)
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)


def is_ddp(model: nn.Module) -> bool:
    """Whether ``model`` is DDP's wrapper."""
    return isinstance(model, nn.parallel.DistributedDataParallel)


def gradient_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[object]:
    """DDP's ``no_sync`` where ``enabled`` is False (the gradients wait on this rank), else nothing."""
    assert isinstance(model, nn.parallel.DistributedDataParallel)
    return contextlib.nullcontext() if enabled else model.no_sync()


def sync_buffers_next_forward(model: nn.Module, due: bool) -> None:
    """Whether DDP's next forward sends rank 0's buffers to every rank (as it stood when a checkpoint was saved)."""
    assert isinstance(model, nn.parallel.DistributedDataParallel)
    model.require_forward_param_sync = due
