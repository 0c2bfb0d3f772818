"""Gradients that wait across an epoch boundary, and how they survive a checkpoint.

An optimizer update gathers ``accumulate`` batches, counted over the whole run and not per epoch (as
Ultralytics counts them): when an epoch's batch count is not a multiple of ``accumulate``, the batches after its
last update wait, as gradients, for the first batches of the next epoch. On a small dataset that matters: 6
batches per epoch and ``accumulate`` 4 make 45 updates in 30 epochs counted this way, but 60 (a third of them
built from only 2 batches) if every epoch ended with an update of whatever had gathered.

So that ``resume`` still continues exactly, the waiting gradients go into ``last.pt``. Under DDP they are local
to each rank until the update's all-reduce (the batches before it run under ``no_sync``), so at the end of an
epoch (and before a mid-epoch checkpoint) the trainer first averages them over the ranks
(:func:`average_over_ranks`: one all-reduce of :func:`flat_gradients` put back by :func:`load_flat_gradients`):
every rank then holds the same partial sum, and the update's all-reduce later averages ``partial + local`` to the
same result. A resumed run adds them to its first batch's gradients (:func:`add_saved`), wherever DDP keeps its
gradient buckets.

Under ``parallel=fsdp`` every backward reduce-scatters (:mod:`detrain.distributed.parallel.fsdp`): the waiting
gradients are each rank's rows of the mean already, nothing is averaged at an epoch's end, and the checkpoint's
whole gradients are gathered for it (:func:`detrain.distributed.parallel.fsdp.full_gradients`); a resumed run adds its
own rows of them.
"""

from __future__ import annotations

import torch
from torch import nn

from detrain.distributed import dist
from detrain.distributed.parallel import probe


def pending_batches(last_batch: int, last_update: int) -> int:
    """Batches whose gradients have gathered since the last update (global batch indices).

    >>> pending_batches(last_batch=11, last_update=7)  # batches 8 to 11 wait
    4
    """
    return max(last_batch - last_update, 0)


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def flat_gradients(model: nn.Module) -> torch.Tensor:
    """Every trainable parameter's gradient (zeros where a parameter has none), flattened into one tensor: what one
    all-reduce averages over the ranks (see the module).

    >>> net = nn.Linear(2, 1); net(torch.ones(1, 2)).sum().backward(); flat_gradients(net)
    tensor([1., 1., 1.])
    """
    params = [p for _, p in _trainable(model)]
    if not params:
        return torch.zeros(0)
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def load_flat_gradients(model: nn.Module, flat: torch.Tensor) -> None:
    """Make ``flat`` (laid out as :func:`flat_gradients` lays it) the gradients, in place; a parameter without a
    gradient gets one.

    >>> net = nn.Linear(2, 1); load_flat_gradients(net, torch.tensor([1.0, 2.0, 3.0])); net.bias.grad
    tensor([3.])
    """
    offset = 0
    for _, p in _trainable(model):
        part = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
        if p.grad is None:
            p.grad = part.clone()
        else:
            p.grad.copy_(part)


def average_over_ranks(model: nn.Module) -> None:
    """Make the waiting gradients of ``model`` (the bare model, not its DDP wrapper) their mean over the ranks, the
    same on every rank: one all-reduce of :func:`flat_gradients`, put back by :func:`load_flat_gradients`. Done at an
    epoch's end and before a mid-epoch checkpoint (see the module). A collective: call it on every rank."""
    if probe.is_sharded(model):
        return  # reduce-scattered in every backward: each rank holds its rows of the mean (see the module)
    load_flat_gradients(model, dist.reduce_mean(flat_gradients(model)))  # collective: one all-reduce


def saved(model: nn.Module) -> dict[str, torch.Tensor]:
    """The waiting gradients by parameter name, on the CPU (for ``last.pt``).

    >>> net = nn.Linear(2, 1); net(torch.ones(1, 2)).sum().backward(); sorted(saved(net))
    ['bias', 'weight']
    """
    return {name: p.grad.detach().to("cpu", copy=True) for name, p in _trainable(model) if p.grad is not None}


def add_saved(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """Add gradients saved by :func:`saved` to the model's current ones (call after a backward pass, before the
    update: a sum does not care when its terms arrive). Names must match the model's trainable parameters.

    >>> net = nn.Linear(2, 1); net(torch.ones(1, 2)).sum().backward(); kept = saved(net)
    >>> add_saved(net, kept); net.bias.grad
    tensor([2.])
    """
    params = dict(_trainable(model))
    missing = sorted(set(grads) - set(params))
    if missing:
        raise KeyError(f"saved gradients for parameters the model does not train: {missing[:3]}")
    with torch.no_grad():
        for name, g in grads.items():
            p = params[name]
            g = probe.local_rows(g, p)  # parallel=fsdp/hsdp: this rank's rows of the whole gradient
            if p.grad is None:
                p.grad = g.to(p.device, p.dtype).clone()
            else:
                p.grad.add_(g.to(p.grad.device, p.grad.dtype))
