"""Non-finite losses and gradients: every rank skips the same optimizer update, and too many in a row stop the run.

bfloat16 has no gradient scaler and float32 can blow up too: one NaN or infinity that reaches an update poisons the
weights, the EMA and every later checkpoint. So each rank notes, per batch, whether its loss is finite, and at an
update whether the gradients are (after the scaler's unscale, from the norm that clipping computes anyway: one fused
norm, :func:`gradient_norm`). The flags travel with the all-reduce every step already makes (the batch's loss items,
as :mod:`detrain.engine.train.state.preemption`'s flag does: :meth:`NonFinite.attach` / :meth:`NonFinite.read`), so
no collective is added and every rank reads the same verdict at the same step: the step reads the reduced flags and
losses to the host together, its one host sync, and :meth:`NonFinite.skip` decides from those numbers. An update is
decided as a whole: with gradient accumulation, one non-finite batch among those it gathers skips it (the flags are
kept from the update before). A skipped update steps neither the optimizer nor the EMA; the gradients are zeroed;
where a loss was non-finite the BatchNorm running statistics go back to what they were at the last decided update (a
NaN in the forward reaches them before the loss says so, and a poisoned running mean would make every later
checkpoint non-finite: :class:`RunningStats`, a copy per update, no host sync); the fp16 gradient scaler still lowers
its scale (its own inf check, as before) and such steps are counted like the others, towards ``nonfinite_limit`` too
(the first updates of an fp16 run often overflow a few times while the scaler finds its scale; ten in a row would
have lowered it 1024-fold).

Counted: the epoch's ``nonfinite_skipped`` column of results.csv, one ``nonfinite`` event per skipped update in
events.jsonl (epoch, batch, what was non-finite, how many ranks saw a non-finite loss) and one console line.
``nonfinite_limit`` skipped updates in a row (0: never) end the run on every rank at that same step with one line
(a :class:`detrain.errors.DetrainError`, exit code 2); the checkpoints hold the last finite weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from detrain.distributed.parallel import probe
from detrain.errors import DetrainError
from detrain.log import console

FLAGS = 2  # elements appended to the items: ranks whose loss was non-finite, ranks whose gradients were


class NonFinite:
    """The non-finite bookkeeping of one rank (see the module). ``limit``: updates skipped in a row that end the
    run (0: never); ``events``: where rank 0 writes its events (anything with ``write(kind, **fields)``, or None)."""

    def __init__(self, limit: int, events: Any = None, model: nn.Module | None = None) -> None:
        self.limit = limit
        self.events = events
        self.stats = RunningStats(model) if model is not None else None
        self.in_a_row = 0
        self.epoch_skipped = 0  # this epoch's skipped updates (results.csv)
        self._loss: torch.Tensor | None = None  # this batch's own flag, on the device (no host sync)
        self._grads: torch.Tensor | None = None
        self._seen: list[float] | None = None  # agreed flags of the batches since the last update (host numbers)

    def note_loss(self, loss: torch.Tensor) -> None:
        """This batch's loss (before backward): whether it is finite, kept on its device."""
        self._loss = (~torch.isfinite(loss.detach())).any().float().reshape(1)

    def note_gradients(self, norm: torch.Tensor) -> None:
        """At an update: the total gradient norm (after unscale); non-finite when any gradient is."""
        self._grads = (~torch.isfinite(norm.detach())).float().reshape(1)

    def attach(self, items: torch.Tensor) -> torch.Tensor:
        """``items`` with :data:`FLAGS` elements appended (1 where this rank saw a non-finite loss / gradient), for
        the step's all-reduce. An all-reduce works element by element: the items' values do not change."""
        zero = items.new_zeros(1)
        loss = zero if self._loss is None else self._loss.to(items)
        grads = zero if self._grads is None else self._grads.to(items)
        self._loss = self._grads = None
        return torch.cat((items, loss, grads))

    def read(self, reduced: list[float], world_size: int) -> list[float]:
        """The values before :meth:`attach`'s flags, from the all-reduced (mean) tensor as the step read it to the
        host (once, with the other flags: the trainer); the flags, as counts of ranks, are kept until the update
        (:meth:`skip`). A batch whose loss some rank found non-finite gives the items NaN, so the caller keeps them
        out of the epoch's mean (:func:`finite_items`)."""
        flags = [v * world_size for v in reduced[-FLAGS:]]
        self._seen = flags if self._seen is None else [max(a, b) for a, b in zip(self._seen, flags)]
        return reduced[:-FLAGS]

    def skip(self, epoch: int, batch: int, nb: int) -> bool:
        """At an update (batch ``batch`` of ``epoch``, both 0-based; ``nb`` batches an epoch): whether every rank
        skips it, the same answer on every rank. Counts it, says so (rank 0) and raises once ``limit`` in a row
        have been skipped (on every rank at this same step). No host sync: :meth:`read` holds the agreed flags."""
        seen = [0.0, 0.0] if self._seen is None else self._seen
        self._seen = None
        ranks, grads = round(seen[0]), seen[1] > 0
        if not ranks and not grads:
            self.in_a_row = 0
            return False
        if ranks and self.stats is not None:  # a forward went non-finite: its running statistics go too
            self.stats.restore()
        self.in_a_row += 1
        self.epoch_skipped += 1
        what = "loss" if ranks else "gradients"
        where = f"epoch {epoch + 1}, batch {batch + 1}/{nb}"
        if self.events is not None:
            self.events.write(
                "nonfinite", epoch=epoch + 1, batch=batch + 1, what=what, ranks=ranks, in_a_row=self.in_a_row
            )
            who = f" on {ranks} rank(s)" if ranks else ""
            console.print(f"non-finite {what}{who} at {where}: update skipped ({self.in_a_row} in a row)")
        if self.limit and self.in_a_row >= self.limit:
            raise DetrainError(
                f"{self.in_a_row} updates in a row had a non-finite {what} (nonfinite_limit={self.limit}), the last "
                f"at {where}; training stopped, the checkpoints hold the last finite weights (lower lr0, check the "
                "data, or amp=false)"
            )
        return True

    def remember(self) -> None:
        """After an update went through (and the ranks took rank 0's BatchNorm statistics: :func:`detrain.
        distributed.parallel.share_main_buffers`): the running statistics a skipped update will put back."""
        if self.stats is not None:
            self.stats.remember()

    def begin_epoch(self) -> None:
        """A new epoch's count (a skipped run of updates goes on counting across epochs); the running statistics
        remembered once, at this process's first epoch (after a resume has loaded them)."""
        self.epoch_skipped = 0
        if self.stats is not None and not self.stats.remembered:
            self.stats.remember()


class RunningStats:
    """A copy of a model's BatchNorm running statistics (mean, variance, batches seen), taken at each update that
    went through and put back when one is skipped for a non-finite loss. One fused copy per update, on the
    buffers' device; the buffers are read where they live, so a checkpoint loaded into the model in place is seen.

    >>> bn = nn.BatchNorm2d(2)
    >>> stats = RunningStats(bn)
    >>> stats.remember()
    >>> _ = bn(torch.full((2, 2, 1, 1), float("nan")))
    >>> bool(bn.running_mean.isnan().any())
    True
    >>> stats.restore()
    >>> bn.running_mean.tolist(), int(bn.num_batches_tracked)
    ([0.0, 0.0], 0)
    """

    def __init__(self, model: nn.Module) -> None:
        self._norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self._saved: list[torch.Tensor] | None = None

    @property
    def remembered(self) -> bool:
        return self._saved is not None

    def _buffers(self) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []
        for m in self._norms:
            found.extend(b for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None)
        return found

    @torch.no_grad()
    def remember(self) -> None:
        buffers = self._buffers()
        if self._saved is None or len(self._saved) != len(buffers):
            self._saved = [b.detach().clone() for b in buffers]
        elif buffers:
            torch._foreach_copy_(self._saved, buffers)

    @torch.no_grad()
    def restore(self) -> None:
        buffers = self._buffers()
        if self._saved is not None and len(self._saved) == len(buffers) and buffers:
            torch._foreach_copy_(buffers, self._saved)


def gradient_norm(parameters: Iterable[torch.Tensor], clip: float) -> torch.Tensor:
    """The total 2-norm of the gradients (one fused pass), clipping them to ``clip`` when > 0 (as
    ``clip_grad_norm_`` does, which returns the same norm): the check costs nothing where clipping is on.
    ``fully_shard``'s gradients (``parallel=fsdp``) give the norm over every rank's shard as a replicated DTensor:
    its plain value is returned (the same on every rank)."""
    params = [p for p in parameters if p.grad is not None]
    if clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=clip)
    elif not params:
        return torch.zeros(())
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])  # type: ignore[misc]
    return probe.local_value(norm)


def finite_items(items: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """``items``, or where any is not finite (a skipped batch's), ``mean`` itself: the running mean over the epoch
    then stays as it was (no host sync).

    >>> finite_items(torch.tensor([1.0, float("nan")]), torch.tensor([2.0, 3.0]))
    tensor([2., 3.])
    """
    return torch.where(torch.isfinite(items).all(), items, mean.to(items))
