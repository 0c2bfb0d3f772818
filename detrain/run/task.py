"""Run a task (train or val) on the devices the arguments name: in this process, or one worker per device
through torch's elastic launcher, or inside a launcher that already started us (torchrun, srun).

Usage (two training processes, so not run as a test): ``run_task("train", make_cfg({"device": "cpu,cpu",
"epochs": 1}))``.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from detrain.config.cfg import Cfg
from detrain.config.values import is_auto_batch
from detrain.distributed.launch import launcher, netif, restart_policy, run_identity, slurm
from detrain.distributed.world import World
from detrain.engine.build import increment_run_dir
from detrain.engine.run_plan import RunPlan, user_heads
from detrain.engine.train.batch_plan import check_split
from detrain.engine.train.callbacks import CallbackFn, check_sendable
from detrain.errors import Preempted
from detrain.run.preflight import check_inputs

_SAVED = re.compile(r"saved (.+?) at (epoch [^;]+);")  # in the line of a preempted run (trainer.py)


def run_task(task: str, cfg: Cfg, callbacks: Mapping[str, list[CallbackFn]] | None = None) -> dict[str, Any] | None:
    """Train or validate; returns rank 0's result in the calling process.

    The run is planned here, once, for every worker: this process's world (read from the environment), the
    devices, the node count, the run folder and the launch's id (:class:`detrain.engine.run_plan.RunPlan`), each checked
    before a process starts or a folder is made. ``callbacks`` (train only; see :mod:`detrain.engine.train.callbacks`)
    run on rank 0: here, or pickled by reference into the spawned workers, checked before anything starts."""
    from detrain.engine.evaluate.val_worker import val_worker
    from detrain.engine.train.trainer import train_worker

    entry = {"train": train_worker, "val": val_worker}[task]
    world = World.from_env()  # this process: a plain one, or already a rank of torchrun's or srun's world
    if cfg.distributed.socket_ifname:
        netif.check_ifname(cfg.distributed.socket_ifname)  # before anything is planned or created
    devices = launcher.parse_device(cfg.distributed.device)
    check_inputs(task, cfg, world)  # every named file, before a process starts or a folder is made
    nodes = cfg.distributed.node_range  # (MIN, MAX), parsed when the config was checked
    args: dict[str, Any] = {"cfg": cfg}  # checked once, by make_cfg: the workers take it as it is
    spawning = not world.launched and (devices.nprocs > 1 or nodes[1] > 1)
    if callbacks:
        if spawning:
            check_sendable(
                callbacks,
                f"the {devices.nprocs} workers of device={cfg.distributed.device!r}"
                if devices.nprocs > 1
                else f"the workers of nnodes={cfg.distributed.nnodes!r}",
            )
        args["callbacks"] = {event: list(fns) for event, fns in callbacks.items()}
    if task == "train" and not cfg.train.resume and not world.launched and not is_auto_batch(cfg.train.batch):
        # the whole planned world (every node of nnodes=MIN:MAX) must split the batch: say so before starting; each
        # rank checks again once the world has formed (nodes may run different numbers of workers)
        check_split(cfg.train.batch_images, devices.nprocs * nodes[1])
    save_dir = None
    if spawning and cfg.distributed.node_rank == 0 and not (task == "train" and cfg.train.resume):
        # decided once, before the workers start, so that restarted workers write to the same folder
        save_dir = str(increment_run_dir(cfg.output.project, cfg.output.name, task, cfg.output.exist_ok))
    # this launch's id goes into its checkpoints: after any restart, rank 0 resumes from those and not from an
    # older run's in the same folder (engine/train/state/resume_state.py); a requeued SLURM job finds them by its job id
    launch_id = uuid.uuid4().hex if task == "train" and not world.launched and cfg.distributed.node_rank == 0 else None
    args["plan"] = RunPlan(nodes, save_dir, launch_id, user_heads())  # a user's heads, for spawned workers too
    with _requeued_when_preempted(task, world, cfg):  # under SLURM node 0 puts the job back in the queue
        return restart_policy.finished(  # every rank agreed to stop (restart_policy.py): its line, raised
            launcher.launch(
                entry,
                args,
                devices,
                world=world,
                nnodes=nodes,
                node_rank=cfg.distributed.node_rank,
                master_addr=cfg.distributed.master_addr,
                master_port=cfg.distributed.master_port,
                max_restarts=cfg.distributed.max_restarts,
                rdzv_backend=cfg.distributed.rdzv_backend,
                run_id=cfg.distributed.run_id or run_identity.derive(task, cfg.node_shared()),
                # every node of one job gives the same arguments, so a derived id tells jobs apart with no key to set
                run_args=None if cfg.distributed.run_id else run_identity.shared_args(task, cfg.node_shared()),
                socket_ifname=cfg.distributed.socket_ifname,
                grace_s=cfg.output.grace if task == "train" and cfg.output.save else 0.0,
                lost_after_s=cfg.distributed.dist_timeout,  # node 0 silent as long as a collective may wait
            )
        )


@contextlib.contextmanager
def _requeued_when_preempted(task: str, world: World, cfg: Cfg) -> Iterator[None]:
    """A training run that ends preempted (SIGTERM / SIGUSR1, ``grace``) under SLURM: the process that speaks for
    the job requeues it, and the run's last line says how that went."""
    try:
        yield
    except Preempted as e:
        if task == "train" and world.slurm_job_id and _leads(world, cfg):
            saved = _SAVED.search(str(e))  # the run's line: "saved <run>/weights/mid.pt at epoch 2, 1/2 batches done;"
            if saved is None:
                raise Preempted(f"{e}; {slurm.requeue(world.slurm_job_id)}") from None
            run_dir, point = Path(saved.group(1)).parent.parent, saved.group(2)
            limit = cfg.distributed.requeue_without_progress
            raise Preempted(f"{e}; {slurm.requeue_unless_stuck(world.slurm_job_id, run_dir, point, limit)}") from None
        raise


def _leads(world: World, cfg: Cfg) -> bool:
    """Whether this process speaks for the whole job: rank 0 of a world srun launched, or node 0's launcher."""
    if world.launched:
        return world.rank == 0
    return (world.node_rank if world.node_rank is not None else cfg.distributed.node_rank) == 0
