"""Data parallelism across ranks: the one place that wraps a model so that every rank trains the same weights.

Today that is torch's ``DistributedDataParallel`` (with BatchNorm synchronised over the ranks when ``sync_bn``);
a sharded choice (torch FSDP's ``fully_shard``) would be another branch of :func:`wrap` and of the helpers below,
and the trainer would not change. The trainer asks this module, never the wrapper's class, for:

* :func:`wrap` the model once it is on its device (a collective: DDP broadcasts rank 0's weights and buffers);
* :func:`unwrap` the bare model, for the optimizer, the EMA, checkpoints and hooks;
* :func:`gradient_sync` around a backward pass, off for the batches that only accumulate before an update;
* :func:`sync_buffers_next_forward` on resume: whether the next forward sends rank 0's buffers, as it stood.

>>> from torch import nn
>>> from detrain.distributed.world import World
>>> m = nn.Linear(2, 2)
>>> wrap(m, World(), torch.device("cpu"), sync_bn=True) is m   # one process: nothing to wrap
True
>>> unwrap(m) is m
True
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from detrain.distributed.sync_bn import convert_sync_batchnorm_cpu
from detrain.distributed.world import World


def wrap(model: nn.Module, world: World, device: torch.device, *, sync_bn: bool) -> nn.Module:
    """``model`` (on ``device``) made data-parallel over ``world``'s ranks, or ``model`` itself in one process.

    ``sync_bn``: BatchNorm normalises with the statistics of the global batch (torch's ``SyncBatchNorm`` on GPUs;
    on CPU, where torch's runs on no device, :mod:`detrain.distributed.sync_bn`'s). Collective: DDP gives every
    rank rank 0's weights and buffers here, and the sync BatchNorms all-reduce at every training forward."""
    if not world.distributed:
        return model
    if sync_bn and device.type == "cpu":
        # torch's SyncBatchNorm (and DDP with it) runs on GPUs only; gloo CPU workers sync through ours
        model = convert_sync_batchnorm_cpu(model)  # collective: an all-reduce per BatchNorm
    elif sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # collective: torch's, per BatchNorm
    ids = [device.index] if device.type == "cuda" else None
    # grads as views of the buckets: no copy, and no layout mismatch with channels-last 1x1 weights; DDP
    # all-reduces the gradients in the backward pass of every batch that ends with an update (gradient_sync)
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model inside DDP and/or ``torch.compile``'s wrapper (``_orig_mod``), or the model itself. The
    trainer compiles in place (``nn.Module.compile``), which leaves no wrapper; this also sees through one made
    by ``torch.compile(model)``, so that no checkpoint ever holds its ``_orig_mod.`` names."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def gradient_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[object]:
    """The context of a backward pass: with ``enabled`` False the gradients stay on this rank (DDP's ``no_sync``),
    to be all-reduced with those of the backward that ends the accumulation. A bare model has nothing to sync."""
    if isinstance(model, nn.parallel.DistributedDataParallel) and not enabled:
        return model.no_sync()
    return contextlib.nullcontext()


def sync_buffers_next_forward(model: nn.Module, due: bool) -> None:
    """Whether the next forward sends rank 0's buffers to every rank (DDP does so only before a forward that
    follows an update): on resume, as it stood when the checkpoint was saved."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model.require_forward_param_sync = due
