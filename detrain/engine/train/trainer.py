"""The training loop of one worker (rank). Collectives go through :mod:`detrain.distributed.dist`, each named where
the loop reaches it; only rank 0 writes.

Usage (a training run, so not run as a test): ``metrics = Trainer(make_cfg({"data": "shapes.yaml", "epochs": 1,
"imgsz": 128}), World()).train()`` trains in this process, as rank 0 of 1.
"""

from __future__ import annotations

import itertools
import math
import random
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch import nn

from detrain.config.cfg import Cfg
from detrain.config.values import is_auto_batch
from detrain.data.memory.batch_memory import release_batch
from detrain.data.prepare import build_train_loader, build_val_loader, load_split
from detrain.data.samples.device_render import DeviceBatch
from detrain.distributed import dist, parallel
from detrain.distributed.launch import node_consistency, restart_policy
from detrain.distributed.launch.preempt_mark import exit_when_launcher_stops, leave_mark
from detrain.distributed.parallel import unwrap
from detrain.distributed.world import World
from detrain.distributed.world_layout import number_nodes
from detrain.engine.build import set_cpu_threads
from detrain.engine.evaluate.val_outputs import LastValidation
from detrain.engine.evaluate.validator import validate
from detrain.engine.run_plan import RunPlan
from detrain.engine.telemetry import epoch_stats, run_trace
from detrain.engine.telemetry.epoch_monitor import EpochMonitor
from detrain.engine.telemetry.manifest import dataset_identity
from detrain.engine.telemetry.run_loggers import RunLoggers
from detrain.engine.train import accumulation, pretrained, setup, time_budget
from detrain.engine.train.batch_plan import check_split, planned_world_size
from detrain.engine.train.callbacks import CallbackFn, Callbacks
from detrain.engine.train.nonfinite import NonFinite, finite_items, gradient_norm
from detrain.engine.train.precision import choose_precision
from detrain.engine.train.recipe import optim
from detrain.engine.train.reproduce import seed_everything
from detrain.engine.train.shared_settings import shared_settings
from detrain.engine.train.state.checkpointer import Checkpointer, Loop, Parts, agree_start
from detrain.errors import Preempted
from detrain.log import EpochProgress, ResultsCSV, console, epoch_line, metric_columns
from detrain.plots.train import plot_train_batch

if TYPE_CHECKING:
    from detrain.nn.model import DetectionModel


@dataclass(frozen=True)
class EpochResult:
    """What one epoch's training gave, the same on every rank: its mean loss items over the ranks, its columns of
    results.csv (losses, learning rates, speed) and its seconds."""

    mean_items: torch.Tensor
    losses: dict[str, float]
    lrs: dict[str, float]
    speed: dict[str, float]
    seconds: float


class Trainer:
    """Trains one rank of ``world``. Every decision that could differ between ranks (best epoch, early stop, image
    size) is taken once and shared, so no rank waits for another that has left the loop.

    ``plan``: what the launching process decided for the run (:class:`detrain.engine.run_plan.RunPlan`: the node
    count, the run folder, the launch's id); the default is a plain process's."""

    def __init__(
        self, cfg: Cfg, world: World, plan: RunPlan | None = None, callbacks: dict[str, list[CallbackFn]] | None = None
    ) -> None:
        plan = RunPlan() if plan is None else plan
        self.callbacks = Callbacks(callbacks)  # fired on rank 0 only (detrain.engine.train.callbacks)
        # collective: every node looks on its own disk for this run's furthest checkpoint (rank 0 also for resume=);
        # every rank gets the furthest of all from the rank that holds it; a failure that only repeats stops the run
        start = agree_start(cfg, plan, world)
        cfg = self.cfg = start.cfg
        self.world, self.rank, self.main = world, world.rank, world.is_main
        # the batch must split over the planned world whatever the accumulation: checked before anything loads
        self.planned_world = planned_world_size(plan.nodes, world.dp_size, world.local_world_size)
        self.elastic = plan.nodes[0] != plan.nodes[1]  # nnodes=MIN:MAX: nodes must have the same number of devices
        if not is_auto_batch(cfg.train.batch):  # AutoBatch's is chosen to split (setup.pick_batch)
            check_split(cfg.train.batch_images, self.planned_world)
        self.device = torch.device(world.device)  # the launcher's choice for this rank (World.device)
        set_cpu_threads(self.device, world)
        # collective: rank 0 decides the run folder and locks it for the run's life; the checkpoints from the restore
        # to the last save, mid.pt and preemption (state/checkpointer.py)
        self.state = Checkpointer(start, world, self.device)
        self.save_dir, self.wdir, self.resume_ckpt = self.state.save_dir, self.state.wdir, self.state.resume

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict[str, Any]:
        """Run every epoch; returns the final metrics (the same dict on every rank). However it ends, rank 0 says
        how in the run folder's events.jsonl (detrain.engine.telemetry.run_trace)."""
        with self.state.held(run_trace.ended(self)):  # the run folder locked, preemption signals caught
            self._prepare()  # data, model, optimizer; the run folder's files; the starting weights' score
            epoch = self.start_epoch
            while epoch < self.cfg.train.epochs:  # time= re-plans cfg.train.epochs after every epoch
                self.callbacks.fire("on_train_epoch_start", self, epoch + 1)
                trained = self._train_epoch(epoch)  # every batch: forward, loss, backward; an update every accumulate
                self._validate_epoch(epoch)  # val=true, or the last epoch: self.metrics, the same on every rank
                improved, stop = self._agree(trained)  # best fitness so far, early stop: rank 0's word on every rank
                self._fit_to_time(epoch)  # time=: as many epochs as fit, the lr schedule refitted to them
                self._save_and_log(epoch, trained, improved)  # results.csv, last.pt / best.pt, the epoch's line
                self.state.copy_last()  # point to point: rank 0 and the nodes keeping a copy (state/replicas.py)
                dist.barrier("end of epoch")  # collective: every rank has finished the epoch
                if self.state.preempt.agreed and not stop and epoch + 1 < self.cfg.train.epochs:
                    raise self.state.preempted(self.wdir / "last.pt", f"epoch {epoch + 2}")  # at the last batch
                if stop:
                    self._say(f"early stop: no improvement in the last {self.cfg.train.patience} epochs")
                    break
                epoch += 1
            self.state.drain()  # collective: the last save's files whole on disk, its copies sent
            return self._finish()

    # ------------------------------------------------------------------ before the first epoch
    def _prepare(self) -> None:
        """Everything before the first epoch: the callbacks around the set-up, the run folder's args.yaml and trace,
        the epoch monitor and logs, and (fine-tuning) the starting weights' score."""
        done = int(self.resume_ckpt["epoch"]) + 1 if self.resume_ckpt else 0
        self.callbacks.fire("on_pretrain_routine_start", self, done)
        self._setup()
        self.callbacks.fire("on_pretrain_routine_end", self, self.start_epoch)
        cfg = self.cfg
        if self.main:
            self.state.open_folder(cfg)  # weights/, leftovers of killed writes removed, args.yaml
            console.print(
                f"training {cfg.inputs.model} on {cfg.inputs.data} for {cfg.train.epochs} epochs; "
                f"results in {self.save_dir}"
            )
        # collective: every rank's place is gathered for the start event, then a barrier once rank 0 wrote it
        self.trace = run_trace.start(
            self.save_dir,
            cfg,
            self.world,
            self.device,
            first_epoch=self.start_epoch,
            step=self.start_epoch * self.nb,
            datasets=(self.data, self.val_data),
            resumed_from=str(cfg.train.resume) if self.resume_ckpt is not None else None,
        )
        # last.pt and mid.pt also on the disks of the next save_replicas - 1 nodes (state/replicas.py)
        self.state.keep_copies(self.trace.world, cfg.output.save_replicas, self.trace.events if self.main else None)
        self.monitor = EpochMonitor(unwrap(self.model), self.device, self.world)
        # non-finite losses or gradients: every rank skips the same updates, BatchNorm's statistics restored
        events = self.trace.events if self.main else None
        self.nonfinite = NonFinite(cfg.train.nonfinite_limit, events, unwrap(self.model))
        self.csv = ResultsCSV(self.save_dir / "results.csv", self.start_epoch if self.resume_ckpt else None)
        self.loggers = RunLoggers(self.save_dir, cfg, self.main)  # tensorboard, mlflow, wandb
        self.metrics: dict[str, Any] = {}  # the last validation's (kept by epochs that do not validate)
        self.last_val = LastValidation(cfg.output.plots, cfg.output.verbose)  # its table and pictures, on rank 0
        self.start_scores: dict[str, Any] = {}
        if pretrained.starts_from_weights(cfg) and self.resume_ckpt is None and cfg.train.val:
            # fine-tuning: score the starting weights, so the final mAP can be read against them
            scores = self.start_scores = self._validate(-1)
            self._say(f"starting weights: mAP50 {scores['map50']:.4f}  mAP50-95 {scores['map']:.4f}")
        self.callbacks.fire("on_train_start", self, self.start_epoch)
        self.optimizer.zero_grad(set_to_none=True)
        spent = (self.resume_ckpt or {}).get("train_time_s") or 0.0  # time=: the hours a resumed run used before
        self.budget = time_budget.TimeBudget(cfg.train.time, spent) if cfg.train.time else None

    def _setup(self) -> None:
        """The run's pieces, each step using those before it (and drawing on the generators seeded here)."""
        seed_everything(self.cfg.train.seed + self.rank, self.cfg.train.deterministic)
        self._load_data()  # the splits, their classes
        # collective: every node's code, versions and dataset (and elastic nodes' devices) are node 0's, or all stop
        data = (self.data, self.val_data)
        node_consistency.check_nodes(
            self.world, lambda: dataset_identity(data), elastic=self.elastic, settings=shared_settings(self.cfg)
        )
        # start, frozen or resumed weights on the device; the EMA
        self.model, self.ema = setup.train_model(self.cfg, self.nc, self.names, self.device, self.state, self.main)
        # collective (batch=-1 or a fraction): the batch that fits every rank's GPU
        self.cfg = setup.pick_batch(
            self.cfg, self._bare(), self.data.records, self.device, self.planned_world, self._say
        )
        # images per update (optimizer=auto's), accumulation
        self.plan, total_iters = setup.plan_batches(
            self.cfg, len(self.data.records), self.nc, self.world.dp_size, self.planned_world
        )
        self._make_parallel()  # collective: every rank trains rank 0's weights
        self._build_loaders()  # collective: a barrier once every node's data is ready
        self._build_optimizer(total_iters)  # and the lr schedule
        self._choose_precision()  # AMP's dtype and the gradient scaler
        # compile=: the training forward, once the checks above ran it eagerly
        setup.compile_model(self._bare(), self.cfg.train.compile, self._say)
        self._build_loss()
        self._start_point()  # epoch 0, or where a resumed checkpoint stands
        said = setup.recipe_lines(self.recipe, self.cfg, self.plan, self.world.world_size, self.nb, self.device.type)
        self._say("\n".join(said))  # the optimizer, the batch plan; an elastic world smaller than planned

    def _load_data(self) -> None:
        """The train and val splits of the dataset yaml, and its classes."""
        self.data = load_split(self.cfg.inputs.data, "train", self.cfg)
        self.val_data = load_split(self.cfg.inputs.data, "val", self.cfg)
        self.nc, self.names = self.data.nc, self.data.names

    def _make_parallel(self) -> None:
        """In a group: the model wrapped for data parallelism (:func:`detrain.distributed.parallel.wrap`), which
        gives every rank rank 0's weights and buffers; the EMA then follows them."""
        d = self.cfg.distributed
        self.model = parallel.wrap(self.model, self.world, self.device, sync_bn=d.sync_bn, kind=d.parallel)
        if parallel.is_sharded(self.model):
            self._say(f"parallel: {parallel.describe(self.model)}")  # the mesh the parameters are placed on
        self.state.restore_ranks(self.model, self.ema)  # collective where sharded

    def _build_loaders(self) -> None:
        """This rank's train and val loaders; the batches per epoch and per update (a run shorter than one planned
        update still steps: weight decay keeps the planned scaling)."""
        cfg = self.cfg
        self.local_batch = self.plan.local_batch
        self.train_loader = build_train_loader(self.data, cfg, self.local_batch, self.world, self.plan.planned_world)
        self.batches: Iterator[Any] | None = None  # the one iterator every epoch's batches come from (_epoch_batches)
        # every rank runs whole single-process val batches, so padded shapes (and so metrics) do not depend on
        # the number of ranks
        self.val_loader = build_val_loader(self.val_data, cfg, cfg.train.batch_images, self.world)
        # collective: cache=ram is filled per node: the first step's collectives must not start the short training
        # timeout on a node that is still filling
        dist.barrier("training data ready on every node", cfg.distributed.prepare_timeout)
        self.nb = len(self.train_loader)
        self.accumulate_target = min(self.plan.accumulate, self.nb * cfg.train.epochs)

    def _build_optimizer(self, total_iters: int) -> None:
        """The optimizer over the bare model's parameters for the planned update (:func:`setup.build_recipe`) and
        the lr schedule."""
        self.recipe = setup.build_recipe(self.model, self.cfg, self.nc, self.plan, total_iters)
        self.optimizer, self.lr0, self.lf = self.recipe.optimizer, self.recipe.lr0, self.recipe.lf
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda=self.lf)

    def _choose_precision(self) -> None:
        """amp=true on CUDA: bfloat16 where the GPU has it, else float16 with a gradient scaler; validation in
        float16; each checked on the model first, float32 where it disagrees (:mod:`precision`)."""
        cfg = self.cfg
        # collective: every rank's AMP check, so that all ranks agree
        self.precision = choose_precision(self._bare(), self.device, cfg.train.amp, cfg.inputs.imgsz, self._say)
        self.amp_dtype = self.precision.train
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp_dtype == torch.float16)

    def _build_loss(self) -> None:
        """The model's own loss (its head's: :mod:`detrain.nn.head`), given the loss section as a mapping (the head
        takes the gains it names); the normaliser's all-reduce is the training step's own (_step)."""
        cfg, bare = self.cfg, self._bare()
        # the loss normalises over the data-parallel group's images (score_sum all-reduced, times its size)
        self.criterion = bare.criterion(asdict(cfg.loss), epochs=cfg.train.epochs, world_size=self.world.dp_size)
        self.loss_names = bare.loss_names

    def _start_point(self) -> None:
        """Where the run starts: epoch 0 with nothing waiting, or where a resumed checkpoint stands, with its
        optimizer, schedule, scaler and random generators (:meth:`Checkpointer.restore`)."""
        at = self.state.restore(self._parts(), Loop(self.cfg, self.nb, self.accumulate_target, self.plan.step_images))
        self.start_epoch = at.start_epoch
        self.best_fitness: float | None = at.best_fitness
        self.epochs_without_improvement = at.epochs_without_improvement
        self.last_update = at.last_update  # global batch index of the last optimizer update
        self.carried_grads = at.carried_grads  # a resumed run's waiting gradients

    # ------------------------------------------------------------------ one epoch
    def _train_epoch(self, epoch: int) -> EpochResult:
        """Every batch of ``epoch`` (from a mid-epoch checkpoint's batch on, for the epoch it resumes), then the lr
        schedule's step and the epoch's numbers from every rank."""
        cfg = self.cfg
        t0 = time.perf_counter()
        self._begin_epoch(epoch)
        progress = EpochProgress(epoch, cfg.train.epochs, self.nb, self.loss_names) if self.main else None
        # (0, zeros, 0) but after mid.pt
        first, mean_items, n_images = self.state.mid.begin_epoch(self.train_loader, len(self.loss_names))
        n_warmup = optim.warmup_iterations(cfg, self.nb)
        step_times: list[float] = []
        for i, batch in enumerate(self.monitor.timed(self._epoch_batches(first)), first):
            ts = time.perf_counter()
            if isinstance(batch, DeviceBatch):  # augment_device=gpu: the images are drawn here, on the device
                batch = batch.render(self.device)
            mean_items, shown, imgsz = self._train_batch(epoch, i, batch, n_warmup, mean_items)
            n_images += int(batch["img"].shape[0])
            if self.main and cfg.output.plots and epoch == self.start_epoch and i < 3:
                plot_train_batch(batch, self.names, self.save_dir / f"train_batch{i}.jpg")
            step_times.append(time.perf_counter() - ts)
            if progress is not None:
                progress.update(shown, int(batch["cls"].shape[0]), imgsz)
            release_batch(batch)  # nothing reads this batch any more: its worker may fill the memory again
            # mid.pt when rank 0's clock said so at this step (save_interval > 0); a preemption agreed at this step
            # saves mid.pt and ends the run (state/checkpointer.py)
            self.state.after_batch(self._parts(), self._loop(), epoch, i, mean_items, n_images)
        if progress is not None:
            progress.close()
        return self._end_epoch_training(epoch, mean_items, n_images, t0, step_times)

    def _epoch_batches(self, first: int) -> Iterable[Any]:
        """This epoch's batches from batch ``first`` on. They come from one iterator that runs on across epochs
        (the sampler's ``run_to``), so the loader's workers prepare the next epoch's first batches while this one
        validates and saves, as Ultralytics' loader does: on a small dataset the workers stood idle at every
        epoch's start (an H200 trained YOLOv8n at 0.60x Ultralytics' images/s with 32-batch epochs, 2026-11-27).
        Under ``time=``, which re-plans the epochs as it goes, each epoch is a pass of its own."""
        run_to = getattr(self.train_loader.batch_sampler, "run_to", None)
        if self.budget is not None or not callable(run_to):
            return self.train_loader
        if self.batches is None:
            run_to(self.cfg.train.epochs)
            self.batches = iter(self.train_loader)
        return itertools.islice(self.batches, self.nb - first)

    def _begin_epoch(self, epoch: int) -> None:
        """The epoch's monitor, augmentation and sampler; mosaic closed when due; the model in training mode."""
        cfg = self.cfg
        self.monitor.begin_epoch()
        self.nonfinite.begin_epoch()
        self.train_loader.dataset.set_epoch(epoch)  # type: ignore[attr-defined]
        _set_sampler_epoch(self.train_loader, epoch)
        if self.budget is not None:
            time_budget.close_mosaic_when_due(self.train_loader.dataset, cfg, epoch, self.main)
        elif cfg.train.close_mosaic and epoch == cfg.train.epochs - cfg.train.close_mosaic:
            self._say(f"closing mosaic for the last {cfg.train.close_mosaic} epochs")
        self.criterion.set_epoch(epoch)  # a loss with a schedule (YOLO26's branch weights) follows the run
        self.model.train()

    def _train_batch(
        self, epoch: int, i: int, batch: dict[str, Any], n_warmup: int, mean: torch.Tensor
    ) -> tuple[torch.Tensor, list[float], int]:
        """Batch ``i`` of ``epoch``: warmup's lr and momentum, forward, loss and backward, and an update once
        ``accumulate`` batches have gathered since the last one; the epoch's running ``mean`` of the loss items over
        the ranks with this batch's (on the device, and as read to the host), its size."""
        ni = i + self.nb * epoch
        accumulate = self.accumulate_target
        if ni <= n_warmup:  # momentum rises to the key's value, as Ultralytics (auto's MuSGD is built at 0.9)
            accumulate = optim.apply_warmup(
                self.optimizer,
                self.cfg,
                ni,
                n_warmup,
                self.lf(epoch),
                self.lr0,
                self.cfg.train.momentum,
                self.accumulate_target,
            )
        # updates are counted over the run, so gradients may wait across an epoch's end (accumulation.py)
        will_step = ni - self.last_update >= accumulate
        items, imgsz = self._step(batch, will_step)
        if self.carried_grads is not None:  # a resumed run's waiting gradients join the first batch's
            accumulation.add_saved(unwrap(self.model), self.carried_grads)
            self.carried_grads = None
        if will_step:
            self.nonfinite.note_gradients(self._unscaled_norm())
        preempt, mid, nonfinite, n = self.state.preempt, self.state.mid, self.nonfinite, items.numel()
        # collective: the batch's loss items over the ranks, to log, with the flags every rank decides by: whether any
        # rank was told to stop, saw a non-finite loss or gradient, rank 0's clock says mid.pt is due (nonfinite.py)
        reduced = dist.reduce_mean(mid.attach(preempt.attach(nonfinite.attach(items.detach())), i, self.nb))
        mean = (mean * i + finite_items(reduced[:n], mean)) / (i + 1)  # a skipped batch's NaN stays out of it
        values = torch.cat((reduced, mean)).tolist()  # the step's one host sync: its flags and losses together
        nonfinite.read(preempt.read(mid.read(values[: len(values) - n], i, self.nb)), self.world.world_size)
        if will_step:
            if self.nonfinite.skip(epoch, i, self.nb):  # the same answer on every rank
                self._skip_update()
            else:
                self._optimizer_step()
            self.last_update = ni
        return mean, values[-n:], imgsz

    def _step(self, batch: dict[str, Any], will_step: bool) -> tuple[torch.Tensor, int]:
        """Forward, loss and backward of one batch; in a group the gradients are all-reduced in the backward pass
        only when ``will_step`` (the batches before an update keep theirs: :func:`parallel.gradient_sync`)."""
        imgs = batch["img"].to(self.device, non_blocking=True)
        imgs = imgs.contiguous(memory_format=torch.channels_last).float().div_(255)
        if self.cfg.train.multi_scale:
            imgs = self._multi_scale(imgs)
        with parallel.gradient_sync(self.model, will_step):
            with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                head_maps = self.model(imgs)
            # the labels as the loader gave them, in host memory: the criterion moves what it needs (nn/head.py)
            targets = self.criterion.assign(head_maps, batch["batch_idx"], batch["cls"], batch["bboxes"])
            # collective: the loss's normaliser, the target scores summed over every rank (each reaches it at every
            # step, with or without boxes of its own)
            summed_scores = dist.all_reduce_sum(targets.score_sum)
            loss, items = self.criterion.score(targets, summed_scores, global_batch=self.plan.step_images)
            self.nonfinite.note_loss(loss)
            self.scaler.scale(loss).backward()
        return items, int(imgs.shape[-1])

    def _multi_scale(self, imgs: torch.Tensor) -> torch.Tensor:
        """A size from 0.5x to 1.5x imgsz, a multiple of 32, chosen on rank 0 and shared."""
        base = self.cfg.inputs.imgsz
        size = dist.broadcast_object(
            random.randrange(int(base * 0.5), int(base * 1.5) + 32) // 32 * 32 if self.main else None
        )  # collective: rank 0's size on every rank
        factor = size / max(imgs.shape[2:])
        if factor == 1:
            return imgs
        new = [math.ceil(x * factor / 32) * 32 for x in imgs.shape[2:]]
        return nn.functional.interpolate(imgs, size=new, mode="bilinear", align_corners=False)

    def _unscaled_norm(self) -> torch.Tensor:
        """At an update: the gradients unscaled (fp16) and clipped (clip_grad); their total norm."""
        self.scaler.unscale_(self.optimizer)
        return gradient_norm(self.model.parameters(), self.cfg.train.clip_grad)

    def _optimizer_step(self) -> None:
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.ema.update(parallel.share_main_buffers(self.model))  # collective: rank 0's BatchNorm statistics
        self.nonfinite.remember()  # the statistics a skipped update puts back

    def _skip_update(self) -> None:
        """An update some rank found non-finite: no optimizer or EMA step, the gradients gone; the fp16 scaler's own."""
        if self.scaler.is_enabled():
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def _end_epoch_training(
        self, epoch: int, mean_items: torch.Tensor, n_images: int, t0: float, step_times: list[float]
    ) -> EpochResult:
        """After the epoch's last batch: the lr schedule's step, the waiting gradients made the same on every rank,
        the epoch's speed from every rank; ``on_train_epoch_end``."""
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        with warnings.catch_warnings():  # an epoch shorter than one update has not stepped the optimizer yet;
            warnings.simplefilter("ignore", UserWarning)  # LambdaLR computes from the epoch, so nothing is lost
            self.scheduler.step()
        if self._gradients_wait(epoch) and self.world.distributed:
            # collective: the waiting gradients averaged over the ranks (one all-reduce)
            accumulation.average_over_ranks(unwrap(self.model))
        epoch_time = time.perf_counter() - t0
        speed = self._speed(epoch, n_images, epoch_time, step_times)
        losses = {f"train/{n}": float(v) for n, v in zip(self.loss_names, mean_items.tolist())}
        lr_columns = {f"lr/pg{j}": lr for j, lr in enumerate(lrs)}
        self.callbacks.fire("on_train_epoch_end", self, epoch + 1, {**losses, **lr_columns})
        return EpochResult(mean_items, losses, lr_columns, speed, epoch_time)

    def _speed(self, epoch: int, n_images: int, epoch_time: float, step_times: list[float]) -> dict[str, float]:
        """Images/s of the whole world, step times, the slowest rank and its data wait, each node's resources
        (detrain.engine.telemetry.epoch_stats); stragglers go to events.jsonl."""
        # collective: one all_gather_object of every rank's epoch numbers (a dict of a dozen numbers)
        stats = number_nodes(dist.all_gather_object(self.monitor.sample(n_images, epoch_time, step_times)))
        self.trace.epoch(epoch, stats)
        return epoch_stats.columns(stats)

    # ------------------------------------------------------------------ the end of an epoch
    def _validate_epoch(self, epoch: int) -> None:
        """Score the EMA weights after ``epoch`` when ``val`` is on, and after the last epoch in any case."""
        if self.cfg.train.val or epoch + 1 == self.cfg.train.epochs:
            self.metrics = self._validate(epoch)

    def _validate(self, epoch: int) -> dict[str, Any]:
        self.ema.gather(self.model)  # collective where sharded: every rank's averaged rows (ema.py)
        ema = self.ema.ema
        if self.world.distributed:  # BatchNorm running stats differ per rank unless sync_bn: validate one model
            for buf in ema.buffers():
                if buf.dtype.is_floating_point:
                    buf.copy_(dist.reduce_mean(buf))  # collective: every rank's statistics, averaged
        # collective: each rank scores its share of the images; rank 0 gathers them and shares the metrics
        return validate(
            ema,
            self.val_loader,
            self.val_data,
            self.cfg,
            self.device,
            self.world,
            plots=self.cfg.output.plots,  # rank 0 keeps the first batches drawn: only the last validation's are written
            verbose=False,
            keep=self.last_val,  # rank 0: the table and pictures, shown at the end (evaluate/val_outputs.py)
            amp_dtype=self.precision.val,  # on CUDA float16 (precision.py); float32 elsewhere
        )

    def _agree(self, trained: EpochResult) -> tuple[bool, bool]:
        """(improved, stop): whether this epoch's fitness (mAP, or the negative loss without validation) is the best
        so far, and whether patience has run out, which rank 0 decides for every rank."""
        loss_fitness = -float(trained.mean_items.sum())
        fitness = float(self.metrics.get("fitness", loss_fitness)) if self.metrics else loss_fitness
        improved = self.best_fitness is None or fitness > self.best_fitness
        if improved:
            self.best_fitness = fitness
            self.epochs_without_improvement = 0
        else:
            self.epochs_without_improvement += 1
        patience = self.cfg.train.patience
        stop = bool(dist.agree(patience > 0 and self.epochs_without_improvement >= patience))  # collective: rank 0's
        return improved, stop

    def _fit_to_time(self, epoch: int) -> None:
        """time=: re-plan the run for the epochs that fit (rank 0's estimate, on every rank): the cfg, the lr
        schedule (ending at lr0 * lrf after the new last epoch) and, through the cfg, warmup and close_mosaic. With
        val=false the epoch that has become the last is scored."""
        if self.budget is None:
            return
        epochs = self.budget.epochs_that_fit(epoch + 1)
        if epochs != self.cfg.train.epochs:
            self.cfg = time_budget.replanned(self.cfg, epochs)
            self.lf = optim.lr_lambda(self.cfg)
            self.scheduler = time_budget.rescheduled(self.optimizer, self.lf, epoch + 1)
            self._say(f"time={self.cfg.train.time:g} h: {epochs} epochs fit ({self.budget.spent_s / 3600:.3g} h used)")
        if epoch + 1 == self.cfg.train.epochs and not self.metrics:  # val=false: the last epoch as now planned
            self.metrics = self._validate(epoch)

    def _save_and_log(self, epoch: int, trained: EpochResult, improved: bool) -> None:
        """The epoch's row in results.csv and TensorBoard, last.pt (best.pt when it improved; written in the
        background, whole before callbacks run), the epoch's line, the callbacks (rank 0; all ranks gather first)."""
        cfg = self.cfg
        row = {
            "epoch": epoch + 1,
            **trained.losses,
            **metric_columns(self.metrics),
            **trained.lrs,
            "nonfinite_skipped": self.nonfinite.epoch_skipped,  # updates skipped for a NaN/inf (nonfinite.py)
            **trained.speed,  # the per-node columns come last
        }
        # collective (save=true): what differs between ranks (and, sharded, the whole tensors) goes in last.pt too
        self.state.gather(self._parts(), self._gradients_wait(epoch))
        if not self.main:
            return
        self.csv.add(row)
        scalars = {k: float(v) for k, v in row.items() if k != "epoch"}
        self.loggers.add_row(scalars, epoch + 1)
        self.state.save_epoch(self._parts(), self._loop(), epoch, self.metrics, improved, self.callbacks.registered())
        if cfg.output.save:  # after last.pt (and best.pt) are written whole: a raising callback loses no epoch
            self.callbacks.fire("on_model_save", self, epoch + 1, scalars, improved)
        console.print(epoch_line(epoch + 1, cfg.train.epochs, row, trained.speed, trained.seconds))
        self.callbacks.fire("on_fit_epoch_end", self, epoch + 1, scalars, improved)

    # ------------------------------------------------------------------ after the last epoch
    def _finish(self) -> dict[str, Any]:
        """Close the logs; rank 0 plots the run, says how it went, fires on_train_end; rank 0's result on every rank."""
        self.loggers.close()
        self.monitor.close()
        metrics, start = self.metrics, self.start_scores
        result = {k: v for k, v in metrics.items() if not isinstance(v, (dict, list, np.ndarray))}
        if start:
            result["start_map50"], result["start_map"] = start["map50"], start["map"]
        if self.main:
            self.last_val.write(self.save_dir, self.data)  # results.png, labels.jpg; the last validation's table, plots
            if start and metrics:
                console.print(
                    f"mAP50-95 {metrics['map']:.4f} after epoch {self.cfg.train.epochs} (started at "
                    f"{start['map']:.4f}); mAP50 {metrics['map50']:.4f} (started at {start['map50']:.4f})"
                )
            console.print(f"done: {self.save_dir}")
            self.callbacks.fire("on_train_end", self, None, result)
        # after the callbacks, which get numbers only: what Model.train()'s metrics object reads besides them
        result.update({k: metrics[k] for k in ("per_class", "names", "speed", "confusion", "curves") if k in metrics})
        result["save_dir"] = str(self.save_dir)
        return dist.broadcast_object(result)  # collective: rank 0's result on every rank

    def _say(self, text: str) -> None:
        """One line on the console, from rank 0."""
        if self.main:
            console.print(text)

    def _bare(self) -> DetectionModel:
        """The model itself, without the data-parallel wrapper."""
        return cast("DetectionModel", unwrap(self.model))

    def _gradients_wait(self, epoch: int) -> bool:
        """Whether batches of ``epoch`` (at its end) hold gradients for an update still to come."""
        return accumulation.pending_batches(self.nb * (epoch + 1) - 1, self.last_update) > 0

    def _parts(self) -> Parts:
        """The objects a checkpoint holds, as they are now."""
        return Parts(self.model, self.ema, self.optimizer, self.scheduler, self.scaler)

    def _loop(self) -> Loop:
        """Where the loop stands, as a checkpoint records it."""
        spent = self.budget.spent_s if self.budget is not None else None  # time=: what resume has left
        planned = (self.cfg, self.nb, self.accumulate_target, self.plan.step_images)
        return Loop(*planned, self.last_update, self.best_fitness, self.epochs_without_improvement, spent)


def _set_sampler_epoch(loader: torch.utils.data.DataLoader, epoch: int) -> None:
    for sampler in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


def train_worker(args: dict[str, Any], world: World) -> dict[str, Any] | restart_policy.Stopped:
    """Entry point of every rank (spawned by the elastic launcher, or called in-process under torchrun, srun or on
    one device): ``args`` holds the Cfg the command checked (``cfg``, pickled to spawned workers, not checked again
    here), the launching process's :class:`detrain.engine.run_plan.RunPlan` (``plan``) and the callbacks (``callbacks``,
    rank 0's); ``world`` is this worker's place and device, as the launcher handed it."""
    cfg: Cfg = args["cfg"]
    args["plan"].register_heads()  # a spawned worker: the heads the launching process registered
    d = cfg.distributed  # a restart waits longer each time (restart_policy.py)
    restart_policy.pause_before_restart(world, d.restart_backoff, d.restart_backoff_max, d.dist_timeout)
    dist.setup(world, timeout_s=d.dist_timeout)  # collective: every rank joins the group (a barrier)
    told = False
    try:
        # after any restart, every node finds this launch's checkpoints in its run folder (resume_state.py)
        return Trainer(cfg, world, args["plan"], args.get("callbacks")).train()
    except restart_policy.AgreedStop as e:  # every rank alike: not worth a restart
        return restart_policy.stopped(e, world)
    except Preempted as e:
        told = leave_mark(str(e))  # spawned by detrain's launcher: it ends the run with this line (preempt_mark.py)
        if told:
            return {"preempted": str(e)}
        raise
    finally:
        dist.cleanup()
        if told:
            exit_when_launcher_stops()
