"""A training run's checkpoints, from the start agreement to the last save: :class:`Checkpointer`.

The trainer builds the model, its EMA, the optimizer, its schedule and the gradient scaler, and runs the loop; the
checkpointer is handed those objects (:class:`Parts`) and where the loop stands (:class:`Loop`) wherever a
checkpoint is read or made, and never sees the trainer. What it does, in the order a run meets it:

* the start (:func:`agree_start`, collective): every node offers its furthest checkpoint of this run, every rank
  gets the one to resume from (:mod:`.resume_state`), and a failure that only repeats stops the run
  (:mod:`detrain.distributed.launch.restart_policy`);
* the run folder (:class:`Checkpointer`, collective): rank 0 decides it and locks it for the run's life
  (:mod:`.run_lock`); before the first write, leftovers of killed writes go and ``args.yaml`` is written;
* the restore: the weights, the EMA, the optimizer, schedule, scaler, each rank's random
  generators and the loop's position (a ``mid.pt`` within its epoch: :mod:`.mid_epoch`);
* the gather (collective): what differs between ranks, and under ``parallel=fsdp`` the whole tensors, to rank 0
  (sharded questions go to :mod:`detrain.distributed.parallel`);
* the saves: ``last.pt`` (the one before kept as ``last.prev.pt``), ``best.pt``, ``epochN.pt``, ``mid.pt`` every
  ``save_interval`` minutes: the loop copies the state to host memory at the step's end and goes on, while rank 0's
  writer writes, fsyncs and renames the files in a thread (:mod:`.writer`); the next save first waits for that one
  (its error raised then), and then every rank sends its copies to the next nodes' disks (:mod:`.replicas`); before
  the run ends, however it ends, the last write finishes (:meth:`Checkpointer.drain`, :meth:`Checkpointer.held`);
* the preemption line: a signal on any rank becomes one agreed step at which every rank saves ``mid.pt`` and the run
  ends resumable (:mod:`.preemption`).

Only rank 0 writes; every method says where it is a collective (call it on every rank).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from detrain.config.cfg import Cfg
from detrain.distributed import dist, parallel
from detrain.distributed.launch import restart_policy
from detrain.distributed.parallel import unwrap
from detrain.distributed.world import World
from detrain.engine.build import agree_run_dir
from detrain.engine.run_plan import RunPlan
from detrain.engine.train import accumulation
from detrain.engine.train.ema import ModelEMA
from detrain.engine.train.recipe import optim
from detrain.engine.train.reproduce import rng_state, set_rng_state
from detrain.engine.train.state import resume_state
from detrain.engine.train.state.mid_epoch import MidEpoch
from detrain.engine.train.state.preemption import Preemption
from detrain.engine.train.state.replicas import Replicas
from detrain.engine.train.state.run_lock import RunLock
from detrain.engine.train.state.writer import Writer
from detrain.errors import ConfigError, Preempted
from detrain.log import console, save_yaml
from detrain.system.tempfiles import remove_unfinished
from detrain.weights.checkpoint import PREVIOUS, load_weights, model_meta, save_checkpoint

if TYPE_CHECKING:
    from detrain.nn.model import DetectionModel

# what best.pt leaves out of last.pt: it is for using the weights, not for resuming
_RESUME_ONLY = ("optimizer", "scheduler", "scaler", "rng", "rng_per_rank", "buffers_per_rank", "pending_grads")


@dataclass(frozen=True)
class Parts:
    """The trainer's objects a checkpoint holds; ``model`` as it trains (wrapped for data parallelism, or bare)."""

    model: nn.Module
    ema: ModelEMA
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler


@dataclass(frozen=True)
class Loop:
    """Where the training loop stands, as a checkpoint records it: the arguments as now planned (``time=`` re-plans
    the epochs), the batches of an epoch and of an update, the images of a step, the last update (a global batch
    index), the best fitness and the epochs since it, the seconds ``time=`` has used."""

    cfg: Cfg
    batches_per_epoch: int
    accumulate: int
    step_images: int
    last_update: int = -1
    best_fitness: float | None = None
    epochs_without_improvement: int = 0
    train_time_s: float | None = None

    def pending(self, batch: int) -> bool:
        """Whether gradients wait for an update after global batch ``batch`` (:mod:`detrain.engine.train.accumulation`).

        >>> Loop(None, 8, 2, 4, last_update=5).pending(6), Loop(None, 8, 2, 4, last_update=5).pending(5)
        (True, False)
        """
        return accumulation.pending_batches(batch, self.last_update) > 0


@dataclass(frozen=True)
class Resumed:
    """Where the loop starts: the first epoch, the last update, the best fitness and the epochs since it, and the
    gradients a resumed run's first batch adds to its own (a fresh start: the defaults)."""

    start_epoch: int = 0
    last_update: int = -1
    best_fitness: float | None = None
    epochs_without_improvement: int = 0
    carried_grads: dict[str, torch.Tensor] | None = None


def agree_start(cfg: Cfg, plan: RunPlan, world: World) -> resume_state.Start:
    """Where the run starts, the same on every rank (a collective): the furthest checkpoint of this run on any
    node's disk, or ``resume=``'s (:func:`resume_state.agree`); the same failure again with no progress since the
    last restart stops the run (:func:`restart_policy.check_progress`, a collective)."""
    launch = resume_state.Launch.here(world, plan.launch_id)
    start = resume_state.agree(cfg, plan.save_dir, launch, world)  # collective: every node's find, the holder's file
    point = resume_state.position(start.ckpt) if start.ckpt is not None else None
    restart_policy.check_progress(world, point, start.cfg.distributed.restart_same_failures)  # collective
    return start


class Checkpointer:
    """The checkpoints of one rank's run (see the module). Made on every rank, a collective: rank 0 decides the
    run folder (``start.save_dir`` or a new one) and locks it, and every rank learns both."""

    def __init__(self, start: resume_state.Start, world: World, device: torch.device) -> None:
        cfg = self.cfg = start.cfg
        self.world, self.main, self.save = world, world.is_main, cfg.output.save
        self.resume = start.ckpt  # the checkpoint this run resumes from, on every rank (None: a fresh start)
        self.launch = start.launch
        # collective: rank 0 decides the run folder (other nodes may not know the one the launching node picked)
        self.save_dir = agree_run_dir(cfg.output, "train", start.save_dir, world.is_main)
        self.wdir = self.save_dir / "weights"
        self.mid = MidEpoch(cfg.output.save_interval, cfg.output.save, self.wdir, device, world)  # mid.pt
        # SIGTERM / SIGUSR1: every rank saves mid.pt at the same step and the run ends resumable (preemption.py)
        self.preempt = Preemption(cfg.output.grace if cfg.output.save else 0.0, world.launcher)
        self.replicas = Replicas([{"rank": 0, "node": 0}], 1, world.rank)  # none until keep_copies knows the nodes
        self.events: Any = None  # rank 0's events.jsonl, for failed copies (keep_copies)
        self.per_rank: dict[str, Any] = {}  # what differs between ranks, gathered when a checkpoint is saved
        self.gathered: dict[str, Any] | None = None  # parallel=fsdp: rank 0's whole tensors for the next checkpoint
        self.start_epoch = 0
        self.writer = Writer()  # rank 0's writes, in a thread beside the loop (state/writer.py)
        self.unsent: list[Callable[[], list[str]]] = []  # every rank: the copies of the save in flight, in order
        self.lock = self._lock()  # collective: rank 0 holds the run folder, or every rank stops with its line

    # ------------------------------------------------------------------ the run folder
    def _lock(self) -> RunLock | None:
        """Rank 0 locks the run folder (:mod:`.run_lock`); a folder in use stops every rank with the same line."""
        lock, problem = None, None
        if self.main:
            try:
                lock = RunLock.take(self.save_dir)
            except ConfigError as e:
                problem = str(e)
        problem = dist.broadcast_object(problem)  # collective: rank 0's word on every rank
        if problem is not None:
            raise ConfigError(problem)
        if lock is not None and lock.note:
            console.print(lock.note)
        return lock

    @contextlib.contextmanager
    def held(self, inner: contextlib.AbstractContextManager[Any] | None = None) -> Iterator[None]:
        """The run's life: preemption signals caught (:meth:`Preemption.installed`), ``inner`` entered within them,
        the write in flight finished before ``inner`` sees an error (:meth:`Writer.finish`: the run's end event
        finds the files whole), and the run folder's lock let go after it, however it ends."""
        try:
            with self.preempt.installed(), inner or contextlib.nullcontext():
                try:
                    yield
                except BaseException:
                    if self.main:
                        self.writer.finish()
                    raise
                if self.main:
                    self.writer.wait()  # nothing in flight after drain(); a write's error is the run's
        finally:
            if self.lock is not None:
                self.lock.release()

    def open_folder(self, cfg: Cfg) -> None:
        """Rank 0, before the run writes its folder: ``weights/``, the temporary files of writes killed before they
        finished removed (no other run writes here: the lock), ``args.yaml``."""
        self.wdir.mkdir(parents=True, exist_ok=True)
        left = [*remove_unfinished(self.save_dir), *remove_unfinished(self.wdir)]
        if left:
            console.print(f"removed {len(left)} temporary file(s) of writes that never finished: {', '.join(left)}")
        save_yaml(self.save_dir / "args.yaml", cfg.to_dict())

    def keep_copies(self, layout: list[dict[str, Any]], copies: int, events: Any = None) -> None:
        """Once every rank's node is known (``layout``): the nodes whose first process keeps a copy of each
        ``last.pt`` and ``mid.pt`` and of the run's record (``save_replicas``: :mod:`.replicas`); such a process
        removes the leftovers of copies killed mid-write from its own disk. ``events``: rank 0's log."""
        self.replicas = Replicas(layout, copies, self.world.rank, self.save_dir)
        self.events = events
        left = self.replicas.clean()
        if left:
            console.print(
                f"rank {self.world.rank}: removed {len(left)} temporary file(s) of copies that never finished"
            )

    def _copied(self, problems: list[str]) -> None:
        """Rank 0: each failed copy one warning line and a ``replica_failed`` event; the run goes on."""
        for problem in problems:
            console.print(f"warning: a copy of the run on another node failed ({problem}); training goes on")
            if self.events is not None:
                self.events.write("replica_failed", problem=problem[:1000])

    # ------------------------------------------------------------------ the restore
    def restore_weights(self, model: DetectionModel) -> None:
        """A resumed run's own weights into ``model`` (bare, before it is wrapped); nothing for a fresh start."""
        if self.resume is not None:
            load_weights(model, self.resume["model"]["state_dict"], str(self.cfg.train.resume))

    def restore_ema(self, ema: ModelEMA) -> None:
        """A resumed run's EMA weights and update count (where its checkpoint has them)."""
        if self.resume is not None and self.resume.get("ema"):
            ema_model = cast("DetectionModel", ema.ema)  # a copy of the model
            load_weights(ema_model, self.resume["ema"]["state_dict"], f"{self.cfg.train.resume} (its EMA)")
            ema.updates = int(self.resume["ema"]["updates"])

    def restore_ranks(self, model: nn.Module, ema: ModelEMA) -> None:
        """In a group, once ``model`` is wrapped (every rank has rank 0's weights): the EMA follows them on a fresh
        start; a resumed run sends rank 0's buffers before the next forward as DDP would have."""
        if not self.world.distributed:
            return
        if self.resume is None or not self.resume.get("ema"):
            # the EMA was copied earlier from this rank's own (seed + rank) init, so ranks > 0 would validate a
            # slightly different model; collective where sharded (the whole weights)
            ema.ema.load_state_dict(parallel.full_state_dict(model))
        if self.resume is not None:  # DDP's buffer broadcast before the next forward, as it stood
            resume_state.restore_rank_state(model, self.resume)

    def restore(self, parts: Parts, loop: Loop) -> Resumed:
        """A resumed run's optimizer, schedule, scaler and random generators, and where its loop starts in this
        run's plan of ``loop`` (a ``mid.pt`` continues within its epoch); a fresh start: :class:`Resumed`'s
        defaults."""
        ckpt = self.resume
        if ckpt is None:
            return Resumed()
        # keeps this run's kernel choice; fsdp: this rank's rows of the whole state
        optimizer_state = parallel.local_optimizer_state(parts.model, parts.optimizer, ckpt["optimizer"])
        optim.load_optimizer_state(parts.optimizer, optimizer_state)
        parts.scheduler.load_state_dict(ckpt["scheduler"])
        if ckpt.get("scaler"):
            parts.scaler.load_state_dict(ckpt["scaler"])
        nb = loop.batches_per_epoch
        self.start_epoch = int(ckpt["epoch"]) + 1
        start_batch = self.mid.restore(ckpt, nb, loop.step_images)  # a mid.pt continues within its epoch
        last_update, carried = self.start_epoch * nb + start_batch - 1, None
        if ckpt.get("batches_per_epoch") == nb and ckpt.get("accumulate") == loop.accumulate:
            # gradients still waiting for an update (accumulation.py); a different batch plan (another world
            # size) starts its cadence afresh at this epoch instead
            last_update = int(ckpt.get("last_update", last_update))
            carried = ckpt.get("pending_grads") or None
        rng = ckpt.get("rng_per_rank", {}).get(str(self.world.rank)) or ckpt.get("rng")
        if rng:
            set_rng_state(rng)
        epochs = loop.cfg.train.epochs
        if self.start_epoch >= epochs and self.main:
            console.print(f"{loop.cfg.train.resume}: training already finished {epochs} epochs; nothing to resume")
        return Resumed(
            self.start_epoch,
            last_update,
            ckpt.get("best_fitness"),
            int(ckpt.get("epochs_without_improvement", 0)),
            carried,
        )

    # ------------------------------------------------------------------ the gather and the saves
    def gather(self, parts: Parts, pending: bool) -> None:
        """What the checkpoint rank 0 writes next needs from the other ranks (a collective: every rank): what
        differs between ranks (the generators' states: a gather of bytes to rank 0), and under
        parallel=fsdp the whole weights, optimizer state and waiting gradients (:func:`parallel.gathered_state`)
        and the EMA's rows. Nothing where the run saves no checkpoints (``save=false``)."""
        if not self.save:
            return
        self.drain()  # the save before this one finished and sent (collective where it has copies to send)
        self.per_rank = resume_state.gather_per_rank(self.world)  # collective
        parts.ema.gather(parts.model)  # collective where sharded: one all-gather per weight
        whole = parallel.gathered_state(parts.model, parts.optimizer, pending)  # collective where sharded
        self.gathered = whole if self.main else None  # the other ranks keep only their shards

    def state(self, parts: Parts, loop: Loop, epoch: int, metrics: dict[str, Any], pending: bool) -> dict[str, Any]:
        """Everything a resumed run needs, after epoch ``epoch`` (0-based); ``pending``: gradients wait for an
        update (averaged over the ranks already) and are saved too. Sharded (parallel=fsdp), the whole tensors
        come from :meth:`gather`, which every rank ran just before: the same format as DDP's."""
        bare = cast("DetectionModel", unwrap(parts.model))
        meta = model_meta(bare, loop.cfg.inputs.imgsz)
        whole = self.gathered if parallel.is_sharded(bare) else None
        self.gathered = None  # used once: the next checkpoint gathers its own
        grads = whole["pending_grads"] if whole is not None else (accumulation.saved(bare) if pending else None)
        return {
            "model": {**meta, "state_dict": whole["model"] if whole is not None else _weights(bare)},
            "ema": {"state_dict": _weights(parts.ema.ema), "updates": parts.ema.updates},
            "optimizer": whole["optimizer"] if whole is not None else parts.optimizer.state_dict(),
            "scheduler": parts.scheduler.state_dict(),
            "scaler": parts.scaler.state_dict() if parts.scaler.is_enabled() else None,
            "epoch": epoch,
            "best_fitness": loop.best_fitness,
            "epochs_without_improvement": loop.epochs_without_improvement,
            "last_update": loop.last_update,
            "batches_per_epoch": loop.batches_per_epoch,
            "accumulate": loop.accumulate,
            "pending_grads": grads if pending else None,
            "train_args": loop.cfg.to_dict(),
            "train_time_s": loop.train_time_s,  # time=: what resume has left
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
            "rng": rng_state(),
            **self.per_rank,  # rng_per_rank
            **self.launch.stamp(),  # which launch wrote it: a restart of this launch resumes from it
        }

    def save_epoch(
        self, parts: Parts, loop: Loop, epoch: int, metrics: dict[str, Any], improved: bool, wait: bool = False
    ) -> None:
        """Rank 0, after :meth:`gather`: ``last.pt`` (the one before kept as ``last.prev.pt``), ``best.pt`` when
        the epoch improved, ``epochN.pt`` every ``save_period`` epochs, then the epoch's ``mid.pt`` removed (it is
        superseded), all written by the writer while the loop goes on (``wait``: written before this returns, for
        callbacks that read the files)."""
        if not self.save:
            return
        cfg = loop.cfg
        state = self.state(parts, loop, epoch, metrics, loop.pending(loop.batches_per_epoch * (epoch + 1) - 1))
        # the last.pt before becomes last.prev.pt, which a resume falls back to when last.pt is damaged; a run
        # resumed from last.prev.pt keeps it: the last.pt it replaces was the damaged one
        keep = None if Path(str(cfg.train.resume)).name == PREVIOUS and epoch == self.start_epoch else PREVIOUS
        period = cfg.output.save_period > 0 and (epoch + 1) % cfg.output.save_period == 0

        def write(state: dict[str, Any]) -> None:
            save_checkpoint(state, self.wdir / "last.pt", keep_previous=keep)
            if improved:
                save_checkpoint({k: v for k, v in state.items() if k not in _RESUME_ONLY}, self.wdir / "best.pt")
            if period:
                save_checkpoint(state, self.wdir / f"epoch{epoch + 1}.pt")  # complete: a run can resume from it
            self.mid.epoch_done()  # once last.pt holds the epoch

        self._write(state, write)
        if wait:
            self.writer.wait()

    def _write(self, state: dict[str, Any], write: Callable[[dict[str, Any]], object]) -> None:
        """Rank 0: ``state`` copied to host memory now (:meth:`Writer.snapshot`), ``write`` given the copy in the
        writer's thread once the write before it has finished (:meth:`Writer.submit`)."""
        copy, ready = self.writer.snapshot(state)
        self.writer.submit(lambda: write(copy), ready)

    def copy_last(self) -> None:
        """Every rank, after the epoch's save: its copies on the next nodes (:mod:`.replicas`), sent once rank 0's
        writer has written the files (:meth:`drain`, at the next save): ``last.pt``, where the epoch's ``mid.pt``
        goes, and the rest of the run's record."""
        if self.save:
            last = self.wdir / "last.pt"
            self.unsent.append(lambda: self.replicas.copy(last, keep_previous=PREVIOUS, supersedes=self.mid.path.name))
            self.unsent.append(lambda: self.replicas.copy_record(self.save_dir))  # results, events, args, best...

    def drain(self) -> None:
        """Every rank (a collective where copies are due: point to point, rank 0 and the nodes keeping one): rank
        0's write in flight finished (its error raised here, as a synchronous save raised it), then the copies of
        the saves before sent, in their order. The next save calls it first; the trainer before the run's end."""
        if self.main:
            self.writer.wait()
        unsent, self.unsent = self.unsent, []
        for send in unsent:
            self._copied(send())

    def after_batch(
        self, parts: Parts, loop: Loop, epoch: int, i: int, mean_items: torch.Tensor, n_images: int
    ) -> None:
        """Every rank after batch ``i`` of ``epoch``: ``mid.pt`` when ``save_interval`` says (rank 0's clock, agreed
        in the step's all-reduce; the save is a collective), or when a preemption was agreed, which then ends the
        run (:class:`Preempted`; at an epoch's last batch the epoch finishes first and ``last.pt`` is the place:
        :meth:`preempted`). Rank 0 first raises the error of a write that failed (:meth:`Writer.check`)."""
        if self.main:
            self.writer.check()  # a save that failed ends the run now (its one line), as it did when synchronous
        nb = loop.batches_per_epoch
        saved = self.mid.due(i, nb)  # rank 0's clock, agreed in the step's all-reduce (no collective here)
        if saved:
            self._save_mid(parts, loop, epoch, i, mean_items, n_images)
        if self.preempt.agreed and i + 1 < nb:  # the same step on every rank (the items' all-reduce)
            if not saved:
                self._save_mid(parts, loop, epoch, i, mean_items, n_images)
            raise self.preempted(self.mid.path, f"epoch {epoch + 1}, {i + 1}/{nb} batches done")

    def _save_mid(self, parts: Parts, loop: Loop, epoch: int, i: int, mean_items: torch.Tensor, n_images: int) -> None:
        """``mid.pt`` after batch ``i`` of ``epoch`` (a collective: call on every rank): the run's checkpoint as it
        stands, with where the epoch stands (:mod:`.mid_epoch`)."""
        pending = loop.pending(epoch * loop.batches_per_epoch + i)
        if pending and self.world.distributed:
            # collective: one all-reduce of the waiting gradients, as at an epoch's end
            accumulation.average_over_ranks(unwrap(parts.model))
        self.gather(parts, pending)  # collective
        state = self.state(parts, loop, epoch - 1, {}, pending) if self.main else None
        state = self.mid.stamp(state, i, loop.step_images, mean_items, n_images)  # the clock starts again
        if state is not None:
            self._write(state, lambda state: save_checkpoint(state, self.mid.path))
        self.unsent.append(lambda: self.replicas.copy(self.mid.path))  # sent at the next drain()

    def preempted(self, path: Path, where: str) -> Preempted:
        """The one line of a run stopped by a preemption signal once ``path`` holds ``where`` it stands (a
        collective: after it, every rank knows rank 0 has written ``path``, and its copies are sent)."""
        self.drain()  # collective where copies are due: rank 0's writer has written path
        dist.barrier("preempted")  # collective: rank 0 has written path when every rank is past it
        return Preempted(
            f"preempted by {self.preempt.signal}: saved {path} at {where}; the same command with resume={path} "
            "continues it (a restart or SLURM requeue of this launch resumes by itself)"
        )


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict as a plain dict; its tensors are the model's own (the save's snapshot copies them)."""
    return dict(model.state_dict())
