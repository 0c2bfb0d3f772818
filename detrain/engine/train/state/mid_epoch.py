"""Checkpoints within an epoch (``save_interval`` minutes), so that a restart loses minutes of training, not an epoch.

``weights/mid.pt`` holds what ``last.pt`` holds, as it stands after the step just taken (``epoch`` is still the
last finished one), plus where the epoch stands: ``mid_epoch = {next_batch, step_images, mean_items, n_images}``.
A run resumed from it starts the epoch's sampler at ``next_batch``
(:meth:`detrain.data.loader.GlobalBatchSampler.start_at`), so it sees the samples an uninterrupted run would (the
augmentation draws from (seed, epoch, index)), and the epoch's running losses go on from the saved means. When the
epoch ends, ``last.pt`` supersedes it and it is removed. Written atomically, like every checkpoint.

When to save is read on rank 0's clock and travels with the all-reduce every step already makes (the batch's loss
items, as :mod:`.preemption`'s flag does: :meth:`MidEpoch.attach`, :meth:`MidEpoch.read`; only when
``save_interval`` > 0), because every rank must save at the same step: saving needs collectives. :meth:`MidEpoch.due`
then answers from that agreed word, with no collective or host sync of its own. The trainer then makes the checkpoint,
as at an epoch's end: gradients still waiting for an update averaged over the ranks
(:mod:`detrain.engine.train.accumulation`), what differs between ranks (random generators) gathered;
:meth:`MidEpoch.stamp` adds where the epoch stands, and the checkpointer's writer writes it while training goes on
(:mod:`.writer`). This module never sees the trainer: it is told the batch, the plan's step and the running losses.
Under elastic membership a mid-epoch checkpoint of another world size continues at the batch of this run's plan that
its images reach (a few images may be seen twice).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from detrain.engine.train.state.resume_state import MID

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from detrain.distributed.world import World


class MidEpoch:
    """Saves ``mid.pt`` every ``minutes`` (0: never) and puts a resumed epoch back where ``mid.pt`` left it, on every
    rank of ``world`` (rank 0's clock decides; rank 0 writes)."""

    def __init__(self, minutes: float, save: bool, wdir: Path, device: torch.device, world: World) -> None:
        self.interval_s = float(minutes) * 60.0
        self.enabled = minutes > 0 and save
        self.save_files = save
        self.path = wdir / MID
        self.device = device
        self.world = world
        self.last_save = time.monotonic()
        self.resume_at: tuple[int, torch.Tensor, int] | None = None
        self._due = False  # the step's agreed word (read), until due() takes it
        self._flags: dict[tuple[bool, torch.device, torch.dtype], torch.Tensor] = {}  # attach's, on the device

    def restore(self, ckpt: dict[str, Any], nb: int, step_images: int) -> int:
        """The batch a checkpoint's epoch continues at in this run's plan of ``nb`` batches of ``step_images``
        images (0 for one saved at an epoch's end); the running losses are kept for :meth:`begin_epoch`. The fields
        were checked by :func:`detrain.engine.train.state.resume_state.check_mid` on rank 0."""
        mid = ckpt.get("mid_epoch")
        if not mid:
            return 0
        batch, saved_step = int(mid["next_batch"]), int(mid["step_images"])
        first = min(batch if saved_step == step_images else batch * saved_step // step_images, nb)
        self.resume_at = (first, mid["mean_items"].float(), int(mid["n_images"]))
        return first

    def begin_epoch(self, loader: DataLoader, n_items: int) -> tuple[int, torch.Tensor, int]:
        """(first batch, running mean of the ``n_items`` loss items, images so far) of the epoch about to run:
        (0, zeros, 0), except for the epoch a mid-epoch checkpoint resumes, whose sampler then starts at its
        batch."""
        first, items, images = self.resume_at or (0, torch.zeros(n_items), 0)
        self.resume_at = None
        if first:
            loader.batch_sampler.start_at(first)  # type: ignore[union-attr]
        return first, items.to(self.device), images

    def attach(self, items: torch.Tensor, i: int, nb: int) -> torch.Tensor:
        """``items`` with rank 0's word appended after batch ``i`` of ``nb`` (1 where its clock says ``mid.pt`` is
        due, on every other rank 0), for the step's all-reduce; ``items`` itself when disabled or after an epoch's
        last batch (``last.pt`` is saved right after it). The two flags are made once on the device: no copy from
        the host at every step."""
        if not self.enabled or i + 1 >= nb:
            return items
        mine = self.world.is_main and time.monotonic() - self.last_save >= self.interval_s
        key = (mine, items.device, items.dtype)
        if key not in self._flags:
            self._flags[key] = items.new_full((1,), float(mine))
        return torch.cat((items, self._flags[key]))

    def read(self, reduced: list[float], i: int, nb: int) -> list[float]:
        """The values before :meth:`attach`'s flag, from the reduced tensor as the step read it to the host; whether
        ``mid.pt`` is due after this batch is now known to every rank (:meth:`due`)."""
        if not self.enabled or i + 1 >= nb:
            return reduced
        self._due = reduced[-1] > 0
        return reduced[:-1]

    def due(self, i: int, nb: int) -> bool:
        """After batch ``i`` of ``nb`` (every rank): whether ``mid.pt`` is to be saved now, as rank 0's clock said
        when the step's all-reduce carried it (:meth:`attach`, :meth:`read`), so that all ranks save at this step or
        none. Never after an epoch's last batch: ``last.pt`` is saved right after it."""
        due, self._due = self._due, False
        return due and self.enabled and i + 1 < nb

    def stamp(
        self, state: dict[str, Any] | None, i: int, step_images: int, mean_items: torch.Tensor, n_images: int
    ) -> dict[str, Any] | None:
        """``mid.pt``'s content: ``state`` (the run's checkpoint after batch ``i``, which rank 0 alone gives; None on
        the other ranks) with where the epoch stands (the checkpointer's writer writes it to :attr:`path`); the
        clock starts again on every rank."""
        if state is not None:
            state["mid_epoch"] = {
                "next_batch": i + 1,
                "step_images": int(step_images),
                "mean_items": mean_items.detach().float().cpu(),
                "n_images": int(n_images),
            }
        self.last_save = time.monotonic()
        return state

    def epoch_done(self) -> None:
        """Rank 0, once ``last.pt`` holds the finished epoch: the epoch's ``mid.pt`` is superseded."""
        if self.save_files and self.world.is_main:
            self.path.unlink(missing_ok=True)
