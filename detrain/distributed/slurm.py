"""SLURM: a task started by ``srun`` (several tasks, no torchrun variables) is one rank of a world SLURM has
already launched; its variables are translated to the ones torch.distributed reads.

>>> first_slurm_host("gpu[07-09,12],cpu01")
'gpu07'
"""

from __future__ import annotations

import os
import re

from detrain.distributed.env import env_int


def map_slurm_env() -> None:
    """Under ``srun`` (several tasks, no torchrun variables) translate SLURM's variables to torch's."""
    if "RANK" in os.environ or not slurm_tasks():
        return
    env = os.environ
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
    env["LOCAL_WORLD_SIZE"] = re.split(r"[(,]", per_node)[0]  # "4(x2),3" -> "4"
    if not env.get("MASTER_ADDR"):
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        env["MASTER_ADDR"] = first_slurm_host(nodes) or "127.0.0.1"
    if not env.get("MASTER_PORT"):
        # Every task of the job derives the same port; different jobs on one node rarely collide.
        env["MASTER_PORT"] = str(15000 + env_int("SLURM_JOB_ID", 0) % 20000)


def slurm_tasks() -> bool:
    """True inside a task started by ``srun`` with more than one task (a world SLURM already launched)."""
    env = os.environ
    return (
        env.get("DETRAIN_IGNORE_SLURM", "") not in ("1", "true")
        and "SLURM_PROCID" in env
        and "SLURM_LOCALID" in env
        and "SLURM_STEP_ID" in env
        and env_int("SLURM_NTASKS", 1) > 1
    )


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list.

    Example:
        >>> first_slurm_host("gpu[07-09,12],cpu01")
        'gpu07'
    """
    m = re.match(r"^([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        return ""
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first

