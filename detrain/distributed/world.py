"""Where this process sits in the run, read from the environment once: :class:`World`.

Launchers tell a worker where it sits through environment variables: torch's elastic agent (under detrain's
launcher and under torchrun) sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and TORCHELASTIC_* (and torchrun OMP_NUM_THREADS); ``srun`` sets SLURM_*, translated to
torch's names by :mod:`detrain.distributed.launch.slurm`; detrain's launcher marks the workers it spawned
(DETRAIN_LAUNCHER). :meth:`World.from_env` is the one place that reads them, once per process: the launching
process in :func:`detrain.run.task.run_task`, a spawned worker in the launcher's worker entry
(:mod:`detrain.distributed.launch.launcher`). The launcher then completes the world with the worker's device, taken from
the device plan for its local rank (:meth:`World.on`; no device travels through the environment), and hands it
to the entry (``train_worker(args, world)``), which passes it on to whatever needs it (``dist.setup``, the
trainer, the checkpoint search, the run's trace, the loaders). Nothing under ``detrain/engine`` reads the
environment itself.

A world of one process is rank 0 of 1 whatever stray RANK or LOCAL_RANK says, as the process group sees it.

>>> World.from_env({}).on("cpu")
World(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=None, nnodes=None, restart_count=0, \
launcher='none', run_id=None, slurm_job_id=None, slurm_requeues=0, master_addr='', master_port=None, \
agent_store=False, omp_threads='', device='cpu')
>>> w = World.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
...                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}).on("cpu")
>>> w.launcher, w.rank, w.distributed, w.is_main, w.device
('torchrun', 1, True, False, 'cpu')
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from detrain.distributed.launch import slurm
from detrain.distributed.launch.master_store import run_secret
from detrain.distributed.launch.slurm import env_int
from detrain.errors import DistributedError

Launcher = Literal["detrain", "torchrun", "slurm", "none"]

LAUNCHER_ENV = "DETRAIN_LAUNCHER"  # "detrain" in the workers detrain's launcher spawned
_TORCH_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class World:
    """This process's place in the run, as its launcher gave it (see the module). Frozen: read once, handed on."""

    rank: int = 0  # global rank (RANK)
    world_size: int = 1  # ranks in the run (WORLD_SIZE)
    local_rank: int = 0  # rank on this node (LOCAL_RANK), which picks its GPU
    local_world_size: int = 1  # ranks on this node (LOCAL_WORLD_SIZE)
    node_rank: int | None = None  # this node's number as its launcher gives it (GROUP_RANK, else SLURM_NODEID)
    nnodes: int | None = None  # nodes in the run, where the launcher says (GROUP_WORLD_SIZE, else SLURM_NNODES)
    restart_count: int = 0  # how often the elastic agent restarted the workers (TORCHELASTIC_RESTART_COUNT)
    launcher: Launcher = "none"  # who started this process: detrain's launcher, torchrun (or any agent), srun
    run_id: str | None = None  # the elastic agent's run id (TORCHELASTIC_RUN_ID); None: no agent
    slurm_job_id: str | None = None  # SLURM_JOB_ID, which a requeue keeps
    slurm_requeues: int = 0  # SLURM_RESTART_COUNT (read only inside a job)
    master_addr: str = ""  # MASTER_ADDR
    master_port: int | None = None  # MASTER_PORT (read only for a world of several ranks)
    agent_store: bool = False  # the workers share the agent's store (TORCHELASTIC_USE_AGENT_STORE=True)
    # OMP_NUM_THREADS as the user or a launcher set it (torchrun: 1; detrain's launcher: the worker's share of the
    # cores); "" when unset, and then a CPU worker takes its share itself (detrain.engine.build.set_cpu_threads)
    omp_threads: str = ""
    # this worker's torch device: the launcher's, from the device plan (World.on); from_env alone gives
    # cuda:LOCAL_RANK with CUDA, else cpu
    device: str = "cpu"
    # the run's secret (DETRAIN_RUN_SECRET: detrain's launcher sets it for its workers; given for several nodes),
    # which seals every value in the rendezvous store (master_store.SealedStore); never shown
    secret: str = field(default="", repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> World:
        """The world described by ``env`` (``os.environ`` unless given). A variable that must be an integer and is
        not, or a rank outside the world, is a DistributedError of one line naming the variable."""
        env = dict(os.environ if env is None else env)
        if all(k in env for k in _TORCH_RANK_VARS):
            launcher: Launcher = "detrain" if env.get(LAUNCHER_ENV) == "detrain" else "torchrun"
        elif slurm.slurm_tasks(env):
            launcher = "slurm"
        else:
            launcher = "none"
        env.update(slurm.torch_variables(env))  # srun's tasks: SLURM's variables under torch's names
        world_size = env_int("WORLD_SIZE", 1, env)
        rank, local_rank = env_int("RANK", 0, env), env_int("LOCAL_RANK", 0, env)
        local_world_size = env_int("LOCAL_WORLD_SIZE", 1, env)
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
        master_port = None
        if world_size > 1:
            if not 0 <= rank < world_size:
                raise DistributedError(
                    f"environment variable RANK={rank} is not a rank of WORLD_SIZE={world_size}; "
                    f"ranks run from 0 to {world_size - 1}"
                )
            if local_rank < 0 or local_world_size < 1:
                raise DistributedError(
                    f"environment variables LOCAL_RANK={local_rank} and LOCAL_WORLD_SIZE="
                    f"{local_world_size} do not describe a rank on this node"
                )
            master_port = env_int("MASTER_PORT", 0, env) if env.get("MASTER_PORT") else None
        else:  # one process: no group, rank 0 of 1
            world_size, rank, local_rank, local_world_size = 1, 0, 0, 1
        job = env.get("SLURM_JOB_ID") or None
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            node_rank=_digits(env, "GROUP_RANK", "SLURM_NODEID"),
            nnodes=_digits(env, "GROUP_WORLD_SIZE", "SLURM_NNODES"),
            restart_count=env_int("TORCHELASTIC_RESTART_COUNT", 0, env),
            launcher=launcher,
            run_id=env.get("TORCHELASTIC_RUN_ID"),
            slurm_job_id=job,
            slurm_requeues=env_int("SLURM_RESTART_COUNT", 0, env) if job else 0,
            master_addr=env.get("MASTER_ADDR", ""),
            master_port=master_port,
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            omp_threads=env.get("OMP_NUM_THREADS", ""),
            device=device,
            secret=run_secret(env) or "",
        )

    def on(self, device: str) -> World:
        """This world with ``device`` as this worker's: the launcher's choice from the device plan for its local rank
        (:func:`detrain.distributed.launch.launcher.launch`), which the environment does not carry.

        >>> World().on("cuda:1").device
        'cuda:1'
        """
        return replace(self, device=device)

    @property
    def launched(self) -> bool:
        """True when a launcher started this process as one rank of its world (detrain's, torchrun, srun)."""
        return self.launcher != "none"

    @property
    def distributed(self) -> bool:
        """True for a world of more than one rank."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that logs and writes files."""
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's place in the data-parallel group: which share of every global batch it reads, of which
        validation shard it scores, whose images its loss normalises over. Every parallelism detrain has (ddp,
        fsdp, hsdp: sharded within a node, replicated across nodes) gives each rank images of its own, so the group
        is the world today; a parallelism that splits a model across ranks (tensor parallelism) would make it a
        part of the world, and the data would follow it through here.

        >>> World(rank=3, world_size=4).dp_rank, World(rank=3, world_size=4).dp_size
        (3, 4)
        """
        return self.rank

    @property
    def dp_size(self) -> int:
        """The ranks of the data-parallel group (see :attr:`dp_rank`): the world's."""
        return self.world_size

    @property
    def whole_world_here(self) -> bool:
        """True when every rank runs on this node."""
        return self.world_size == self.local_world_size


def _digits(env: Mapping[str, str], *keys: str) -> int | None:
    """The first of ``keys`` whose value is a whole number (informational variables: anything else is ignored)."""
    for key in keys:
        value = env.get(key, "")
        if value.isascii() and value.isdigit():
            return int(value)
    return None
