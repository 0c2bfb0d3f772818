"""Data parallelism across ranks: the one place that wraps a model so that every rank trains the same weights.
This ``__init__`` picks the wrapper by the ``parallel`` key and answers, whatever the wrapper, what the trainer asks;
each wrapper is a module behind it, and every DTensor question is :mod:`detrain.distributed.parallel.probe`'s.

``parallel=ddp`` (the default) is torch's ``DistributedDataParallel`` (:mod:`detrain.distributed.parallel.ddp`):
every rank holds the whole model, its gradients and its optimizer state. ``parallel=fsdp`` shards them over the
ranks (torch's ``fully_shard``, :mod:`detrain.distributed.parallel.fsdp`); ``parallel=hsdp`` shards them within a
node and replicates them across the nodes (a 2-D mesh, :func:`mesh_shape`). Any of them may have BatchNorm
synchronised over the ranks (``sync_bn``). Every rank reads its own images whichever is chosen: the data-parallel
group is the world (:attr:`detrain.distributed.world.World.dp_rank`). The trainer asks this module, never the
wrapper's class, for:

* :func:`wrap` the model once it is on its device (a collective: every rank starts from rank 0's weights and
  buffers);
* :func:`unwrap` the bare model, for the optimizer, the EMA, checkpoints and hooks (a sharded model is its own
  bare model: its parameters are DTensors);
* :func:`gradient_sync` around a backward pass, off for the batches that only accumulate before an update;
* :func:`share_main_buffers` at each update: rank 0's BatchNorm statistics on every rank before the EMA takes
  them, so every rank's EMA (what it validates with) is rank 0's, the one the checkpoint holds;
* :func:`sync_buffers_next_forward` on resume: whether the next forward sends rank 0's buffers, as it stood;
* :func:`full_state_dict`, :func:`gathered_state` and :func:`local_optimizer_state`: whole tensors for the EMA and
  for checkpoints (collectives when sharded), and a whole optimizer state cut back to this rank's rows; so a
  checkpoint has one format whatever wrote it, and a DDP run resumes a sharded one and the other way round;
* :func:`check_optimizer`: MuSGD is refused when sharded (its Newton-Schulz step needs whole matrices).

:mod:`detrain.distributed.parallel.fsdp` is imported inside the sharded branches only: it imports torch's fsdp and
DTensor packages, which a DDP run never needs (:mod:`detrain.distributed.parallel.probe` says what they cost).

>>> from torch import nn
>>> from detrain.distributed.world import World
>>> m = nn.Linear(2, 2)
>>> wrap(m, World(), torch.device("cpu"), sync_bn=True) is m   # one process: nothing to wrap
True
>>> unwrap(m) is m
True
>>> mesh_shape(World(rank=0, world_size=4, local_world_size=2), "hsdp")
(2, 2)
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from detrain.distributed import dist
from detrain.distributed.parallel import ddp, probe
from detrain.distributed.parallel.sync_bn import convert_sync_batchnorm_cpu
from detrain.distributed.world import World
from detrain.errors import ConfigError

KINDS = ("ddp", "fsdp", "hsdp")  # the values of the parallel key


def mesh_shape(world: World, kind: str) -> tuple[int, ...]:
    """The device mesh a sharded ``kind`` places parameters on: (W,) for fsdp; for hsdp (nodes, ranks of a node),
    replicated across the first and sharded along the second (every node must run as many ranks); () for ddp."""
    if kind == "fsdp":
        return (world.world_size,)
    if kind != "hsdp":
        return ()
    per_node = world.local_world_size
    if world.world_size % per_node:
        raise ConfigError(
            f"parallel=hsdp needs the same number of workers on every node: {world.world_size} workers do not "
            f"split into nodes of {per_node}"
        )
    return (world.world_size // per_node, per_node)


def wrap(model: nn.Module, world: World, device: torch.device, *, sync_bn: bool, kind: str = "ddp") -> nn.Module:
    """``model`` (on ``device``) made data-parallel over ``world``'s ranks (``kind``: one of :data:`KINDS`), or
    ``model`` itself in one process.

    ``sync_bn``: BatchNorm normalises with the statistics of the global batch (torch's ``SyncBatchNorm`` on GPUs;
    on CPU, where torch's runs on no device, :mod:`detrain.distributed.parallel.sync_bn`'s). Collective: every rank
    gets rank 0's weights and buffers here, and the sync BatchNorms all-reduce at every training forward."""
    if not world.distributed:
        return model
    if sync_bn and device.type == "cpu":
        # torch's SyncBatchNorm (and DDP with it) runs on GPUs only; gloo CPU workers sync through ours
        model = convert_sync_batchnorm_cpu(model)  # collective: an all-reduce per BatchNorm
    elif sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # collective: torch's, per BatchNorm
    if kind in ("fsdp", "hsdp"):
        from detrain.distributed.parallel import fsdp

        # collective: rank 0's weights and buffers; then each layer all-gathers its weights where it runs
        return fsdp.shard(model, device, mesh_shape(world, kind))
    return ddp.wrap(model, device)  # collective: rank 0's weights and buffers


def describe(model: nn.Module) -> str:
    """How ``model`` is spread over the ranks, for the log: ``ddp``, ``fsdp over 4 ranks``, ``hsdp on a 2x2 mesh
    (replicate x shard)``, or ``one process``."""
    bare = unwrap(model)
    if probe.is_sharded(bare):
        from detrain.distributed.parallel import fsdp

        shape = fsdp.mesh_of(bare)
        if len(shape) == 1:
            return f"fsdp over {shape[0]} ranks"
        return f"hsdp on a {shape[0]}x{shape[1]} mesh (replicate x shard)"
    return "ddp" if ddp.is_ddp(model) else "one process"


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
    if ddp.is_ddp(model):
        return ddp.gradient_sync(model, enabled)
    if probe.is_sharded(model):  # gradients reduce-scattered in every backward (fsdp.py says why)
        from detrain.distributed.parallel import fsdp

        return fsdp.buffer_sync(model).backward(enabled)
    return contextlib.nullcontext()


def share_main_buffers(model: nn.Module) -> nn.Module:
    """Rank 0's floating buffers (BatchNorm's running statistics) on every rank, in place (a collective in a group:
    one broadcast per dtype); returns ``model``. Called at each update, before the EMA takes the model's buffers.

    Each rank's forward passes update the running statistics from its own images (unless ``sync_bn``), and DDP
    sends rank 0's to the others only before the next forward; rank 0's are the ones that go on (and the ones every
    checkpoint holds). Taken at the update, every rank's EMA follows rank 0's, so the ranks validate with the
    weights ``best.pt`` holds, and a checkpoint needs no rank's buffers but rank 0's: what a rank's forward passes
    since the last update added to its own statistics is replaced at the next update whatever it was, and
    training-mode BatchNorm normalises with the batch's statistics, not the running ones.
    """
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return model
    dist.broadcast_many_([b for b in unwrap(model).buffers() if b.is_floating_point()])  # collective
    return model


def sync_buffers_next_forward(model: nn.Module, due: bool) -> None:
    """Whether the next forward sends rank 0's buffers to every rank (DDP does so only before a forward that
    follows an update): on resume, as it stood when the checkpoint was saved."""
    if ddp.is_ddp(model):
        ddp.sync_buffers_next_forward(model, due)
    elif probe.is_sharded(model):
        from detrain.distributed.parallel import fsdp

        fsdp.buffer_sync(model).due = due


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` (wrapped or bare) is sharded over the ranks (``parallel=fsdp`` or ``hsdp`` in a group)."""
    return probe.is_sharded(unwrap(model))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The bare model's state dict, whole: where sharded, a collective (call on every rank) giving CPU copies."""
    bare = unwrap(model)
    if not probe.is_sharded(bare):
        return bare.state_dict()
    from detrain.distributed.parallel import fsdp

    return fsdp.full_state_dict(bare)


def gathered_state(model: nn.Module, optimizer: torch.optim.Optimizer, pending: bool) -> dict[str, Any] | None:
    """Where sharded, what a checkpoint holds of the model, the optimizer and (``pending``) the gradients waiting
    for an update, whole and on the CPU, in the format of a DDP run's (a collective: call on every rank; only
    rank 0 writes it). None otherwise: rank 0 reads them from its own whole copies as it writes."""
    bare = unwrap(model)
    if not probe.is_sharded(bare):
        return None
    from detrain.distributed.parallel import fsdp

    return {
        "model": fsdp.full_state_dict(bare),  # collective: one all-gather per sharded tensor, in order
        "optimizer": fsdp.full_optimizer_state(optimizer),  # collective: per tensor of the state
        "pending_grads": fsdp.full_gradients(bare) if pending else None,  # collective: per gradient
    }


def local_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict:
    """A checkpoint's (whole) optimizer state for ``optimizer``: where sharded, each tensor cut to this rank's rows
    of its parameter (no communication); otherwise ``state`` itself."""
    if not is_sharded(model):
        return state
    from detrain.distributed.parallel import fsdp

    return fsdp.local_optimizer_state(optimizer, state)


def check_optimizer(model: nn.Module, name: str) -> None:
    """MuSGD orthogonalises whole weight matrices (Newton-Schulz), which no rank of a sharded model holds: refused
    with one line before training starts."""
    if name == "MuSGD" and is_sharded(model):
        kind = describe(model).split()[0]
        raise ConfigError(
            f"parallel={kind} cannot train with MuSGD (its Newton-Schulz step needs whole weight matrices; "
            "optimizer=auto picks it for runs of over 10000 updates): give optimizer=SGD or AdamW, or parallel=ddp"
        )
