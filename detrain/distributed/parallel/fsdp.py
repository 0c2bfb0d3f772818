"""Sharded data parallelism (``parallel=fsdp``, ``parallel=hsdp``): torch's ``fully_shard`` on every layer of the
detection model and on the model itself. ``fsdp``: a 1-D mesh of the W ranks, each keeping 1/W of every parameter,
of its gradient and of the optimizer state, and all-gathering a layer's weights just before that layer runs
(forward and backward). ``hsdp`` (hybrid sharding): a 2-D mesh (nodes x ranks of a node), replicated across the
nodes and sharded within one: each rank keeps 1/L of each parameter (L ranks a node), the all-gathers stay inside a
node, and the gradients are reduce-scattered within a node then all-reduced across the nodes. Either way every rank
still reads its own images: the data-parallel group is the whole world.

What :mod:`detrain.distributed.parallel` needs beyond ``fully_shard`` itself, so that a sharded run trains the
same weights as DDP and writes the same checkpoints:

* the start: rank 0's weights and buffers on every rank before sharding (DDP's own start does the same);
* BatchNorm buffers: ``fully_shard`` leaves buffers whole and unsynchronised; :class:`BufferSync` sends rank 0's
  to every rank before a training forward that follows a synchronised backward, which is when DDP sends them;
* gradients are reduce-scattered in every backward, also in the batches that only accumulate (sharded gradients
  add up across batches: the sum of the means is the mean of the sums). Skipping the reduce-scatter there
  (``set_requires_gradient_sync(False)``) would keep whole unsharded gradients on every rank until the update,
  which is the memory sharding is for, and would hide them where a checkpoint cannot read them;
* rows: a parameter of shape (n, ...) is split on its first dimension in ``ceil(n / S)``-row chunks over the S
  ranks of the mesh's shard dimension (W for fsdp, L for hsdp), the rank at place r of it holding chunk r
  (torch.chunk's split; the last ranks may hold fewer rows or none). :func:`own_rows` and
  :func:`local_part` give a whole tensor's rows of this rank, :func:`gather_rows` puts every rank's rows back;
* whole tensors for checkpoints (:func:`full_state_dict`, :func:`full_optimizer_state`, :func:`full_gradients`),
  each a collective on every rank: the checkpoints keep the format of a DDP run's, so either resumes the other
  at any world size, and :func:`local_optimizer_state` turns a whole optimizer state back into this rank's rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from detrain.distributed import dist

_SYNC = "_detrain_buffer_sync"  # the attribute of the sharded model that holds its BufferSync


def shard(model: nn.Module, device: torch.device, mesh_shape: tuple[int, ...]) -> nn.Module:
    """``model`` (on ``device``) sharded in place over a mesh of ``mesh_shape`` ranks, and returned: (W,) shards
    over all W ranks (fsdp); (N, L) replicates across its first dimension and shards along its second (hsdp).
    Each entry of its layer list (``model.model``, a DetectionModel's) is one ``fully_shard`` unit, the model itself
    the root. Parameters stay float32 (AMP stays autocast). Collective: every rank gets rank 0's weights and buffers
    first, and a 2-D mesh makes its groups (one per row and one per column)."""
    dist.broadcast_many_(list(model.parameters()) + list(model.buffers()))  # collective: rank 0's start, as DDP's
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.contiguous()  # fully_shard takes contiguous parameters only (not channels-last ones)
    names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=names)  # collective: 2-D, its subgroups
    for layer in getattr(model, "model", ()):
        fully_shard(layer, mesh=mesh)  # each layer all-gathers its weights just before it runs
    fully_shard(model, mesh=mesh)
    setattr(model, _SYNC, BufferSync(model))
    return model


class BufferSync:
    """Rank 0's buffers (BatchNorm statistics, and its batch counts) sent to every rank before a training forward
    that follows a synchronised backward, as DDP does (``broadcast_buffers``): without it each rank's statistics
    would only ever follow its own images. Forwards without autograd (an AMP check) neither send nor change when
    the next one sends, as DDP's wrapper never sees the bare model's."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.due = True  # DDP sends them before its first forward too
        self.syncing = True  # whether the current backward is synchronised (gradient_sync)
        model.register_forward_pre_hook(self._before)
        model.register_forward_hook(self._after)

    def _before(self, *_: Any) -> None:
        if self.due and torch.is_grad_enabled():
            dist.broadcast_many_(list(self.model.buffers()))  # collective: rank 0's buffers, one broadcast per dtype

    def _after(self, *_: Any) -> None:
        if torch.is_grad_enabled():
            self.due = self.syncing

    @contextlib.contextmanager
    def backward(self, enabled: bool) -> Iterator[None]:
        """The context of one batch's forward and backward: ``enabled`` False for a batch that only accumulates."""
        self.syncing = enabled
        try:
            yield
        finally:
            self.syncing = True


def buffer_sync(model: nn.Module) -> BufferSync:
    """The :class:`BufferSync` :func:`shard` gave ``model``."""
    sync = getattr(model, _SYNC)
    assert isinstance(sync, BufferSync)
    return sync


# ---------------------------------------------------------------------------------- rows of whole tensors


def mesh_of(model: nn.Module) -> tuple[int, ...]:
    """The shape of the mesh ``model``'s parameters are placed on: (W,) or (nodes, ranks of a node)."""
    for p in model.parameters():
        if isinstance(p, DTensor):
            return tuple(p.device_mesh.shape)
    return ()


def _rows(like: DTensor) -> slice:
    """The rows (first dimension) of the whole tensor that ``like``'s shard on this rank holds: replicated along
    every mesh dimension but one, sharded on dimension 0 along that one."""
    sharded = [i for i, p in enumerate(like.placements) if isinstance(p, Shard)]
    assert len(sharded) == 1 and like.placements[sharded[0]] == Shard(0), like.placements
    n, size = like.shape[0], like.device_mesh.size(sharded[0])
    step = -(-n // size)
    first = like.device_mesh.get_local_rank(sharded[0]) * step
    return slice(min(first, n), min(first + step, n))


def own_rows(whole: torch.Tensor, like: DTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows of ``whole`` this rank holds, as a view; ``like``'s local shard): what an element-wise update of
    a whole tensor from a sharded one touches here."""
    return whole[_rows(like)], like.to_local()


def local_part(whole: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's rows of ``whole`` (the same on every rank) as a DTensor sharded as ``like`` is (no
    communication: every rank cuts its own rows)."""
    part = whole[_rows(like)].to(like.device, like.dtype).contiguous()
    return DTensor.from_local(
        part, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def gather_rows(whole: torch.Tensor, like: DTensor) -> None:
    """Every rank's rows of ``whole`` (each rank's own rows current, the others' stale) put together on every
    rank, in place. Collective: one all-gather."""
    whole.copy_(local_part(whole, like).full_tensor())


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective: an all-gather), or ``t`` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


# ---------------------------------------------------------------------------------- whole state for checkpoints


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every sharded tensor whole, on the CPU (one whole tensor at a time on the
    device). Collective: every rank, in the same order (the state dict's)."""
    return {k: full(v).detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` as a DDP run's looks (keyed by parameter index, whole tensors), on the CPU.
    Collective: every rank (the same parameters have state on every rank)."""
    saved = optimizer.state_dict()
    state = {
        k: {n: full(v).detach().to("cpu", copy=True) if isinstance(v, DTensor) else v for n, v in s.items()}
        for k, s in saved["state"].items()
    }
    return {**saved, "state": state}


def local_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """A whole optimizer state (a checkpoint's, the same on every rank) with each tensor shaped like its sharded
    parameter cut to this rank's rows, for ``optimizer.load_state_dict`` (no communication). Other values (a
    step count) and state of parameters that are not sharded are kept."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[Any, Any] = {}
    for k, s in saved["state"].items():
        p = params[int(k)] if 0 <= int(k) < len(params) else None
        state[k] = {
            n: local_part(v, p) if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == p.shape else v
            for n, v in s.items()
        }
    return {**saved, "state": state}


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient, whole and on the CPU, by name (what ``last.pt`` keeps of gradients
    still waiting for an update). Collective: every rank (the same parameters have gradients on every rank)."""
    return {
        name: full(p.grad).detach().to("cpu", copy=True)
        for name, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    }
