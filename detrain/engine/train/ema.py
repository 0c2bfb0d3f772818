"""Exponential moving average of the model weights, used for validation and checkpoints.

Under ``parallel=fsdp`` the EMA stays a whole model on every rank (as under DDP), but each rank averages only
the rows of each weight that its shard holds: no communication per update, the same arithmetic element by
element. :meth:`ModelEMA.gather` puts every rank's rows together before the EMA is validated or saved (one
all-gather per weight, once an epoch). A sharded EMA would save one model's worth of memory per rank, which beside
a detector's activations is little (docs/benchmarks.md, "Sharding"), and validation would gather it anyway."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable

import torch
from torch import nn

from detrain.distributed.parallel import probe, unwrap


class ModelEMA:
    """Keeps ``ema = d * ema + (1 - d) * model`` with d ramping up as ``decay * (1 - exp(-updates / tau))``.

    The ramp lets early epochs follow the fast-moving weights instead of averaging in the random start.

    >>> ema = ModelEMA(nn.Linear(2, 2)); ema.update(nn.Linear(2, 2)); ema.updates
    1
    """

    def __init__(
        self, model: nn.Module, decay: float = 0.9999, tau: float = 2000.0, updates: int = 0, fixed: Iterable[str] = ()
    ) -> None:
        self.ema = copy.deepcopy(unwrap(model)).eval()
        self.fixed = frozenset(fixed)  # state-dict names that training never changes (freeze=): copied, not averaged
        for p in self.ema.parameters():
            p.requires_grad_(False)
        self.decay, self.tau, self.updates = decay, tau, updates
        self.gathered_at: int | None = None  # parallel=fsdp: ``updates`` at the last gather (its rows then whole)
        # (model, EMA model, the tensor lists update averages): found at the first update (_pairs)
        self._cached: tuple[nn.Module, nn.Module, list[tuple[list[torch.Tensor], list[torch.Tensor]]]] | None = None

    def current_decay(self) -> float:
        return self.decay * (1 - math.exp(-self.updates / self.tau))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One step of the average over every floating-point tensor of the state (weights and BatchNorm's running
        statistics). Integer buffers (BatchNorm's ``num_batches_tracked``) keep the value they were copied with:
        an averaged count means nothing, and the EMA model only ever runs in eval mode, where it is unused.
        The ``fixed`` tensors (frozen layers' weights) are left as they are: averaging a constant with itself would
        only add rounding, and they stay bit-identical to the weights they were frozen at.

        No host sync and no state dict built: ``v.mul_(d).add_(s, alpha=1 - d)`` for every pair, as two
        ``torch._foreach_*`` calls per dtype over the pairs :meth:`_pairs` found once (the same two elementwise
        operations, so the same bits). ``parallel=fsdp``'s DTensors keep the per-tensor path (this rank's rows)."""
        self.updates += 1
        d = self.current_decay()
        bare = unwrap(model)
        if probe.is_sharded(bare):
            self._update_rows(bare, d)
            return
        for emas, sources in self._pairs(bare):
            torch._foreach_mul_(emas, d)
            torch._foreach_add_(emas, sources, alpha=1 - d)

    def _pairs(self, bare: nn.Module) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """The (EMA tensors, model tensors) that :meth:`update` averages, one pair of lists per (device, dtype),
        found once per model: parameters and buffers are changed in place (optimizer steps, ``load_state_dict``,
        rank 0's buffers), never replaced, and a Parameter is kept itself, so its ``.data`` is always the one read."""
        if self._cached is not None and self._cached[0] is bare and self._cached[1] is self.ema:
            return self._cached[2]
        model_state = bare.state_dict(keep_vars=True)
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for name, value in self.ema.state_dict(keep_vars=True).items():
            if value.dtype.is_floating_point and name not in self.fixed:
                emas, sources = groups.setdefault((value.device, value.dtype), ([], []))
                emas.append(value)
                sources.append(model_state[name])
        pairs = list(groups.values())
        self._cached = (bare, self.ema, pairs)
        return pairs

    def _update_rows(self, bare: nn.Module, d: float) -> None:
        """``parallel=fsdp``: each tensor's rows that this rank's shard holds (see the module), one at a time."""
        model_state = bare.state_dict()
        for name, value in self.ema.state_dict().items():
            if value.dtype.is_floating_point and name not in self.fixed:
                value, source = probe.own_rows(value, model_state[name].detach())  # this rank's rows
                value.mul_(d).add_(source, alpha=1 - d)

    @torch.no_grad()
    def gather(self, model: nn.Module) -> None:
        """Under ``parallel=fsdp``, every rank's averaged rows on every rank (a collective: call on every rank);
        otherwise nothing to do. Before the EMA is validated or saved."""
        bare = unwrap(model)
        if not probe.is_sharded(bare) or self.gathered_at == self.updates:
            return  # nothing sharded, or no update since the last gather (validation, then last.pt, per epoch)
        self.gathered_at = self.updates  # the same on every rank: every rank skips or gathers alike
        model_state = bare.state_dict()
        for name, value in self.ema.state_dict().items():
            if value.dtype.is_floating_point and name not in self.fixed:
                probe.gather_rows(value, model_state[name])  # collective: one all-gather where sharded
