"""SLURM: a task started by ``srun`` (several tasks, no torchrun variables) is one rank of a world SLURM has
already launched; its variables are translated to the ones torch.distributed reads (``torch_variables``), which
:class:`detrain.distributed.world.World` is read from; ``env_int`` reads such a variable as an integer, for both.

>>> first_slurm_host("gpu[07-09,12],cpu01")
'gpu07'
>>> env_int("RANK", 0, {"RANK": "2"}), env_int("DETRAIN_SURELY_UNSET", 3)
(2, 3)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path

from detrain.errors import DistributedError
from detrain.system.tempfiles import write_atomic

REQUEUES_FILE = "requeues.json"  # in the run folder: the preemptions in a row at one checkpoint


def env_int(key: str, default: int, env: Mapping[str, str] | None = None) -> int:
    """``int(env[key])`` (``env``: ``os.environ`` unless given), ``default`` when unset or empty; DistributedError
    naming the variable if not an int (a launcher or scheduler variable: RANK, SLURM_NTASKS...)."""
    value = (os.environ if env is None else env).get(key, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise DistributedError(f"environment variable {key}={value!r} is not an integer") from None


def torch_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The torch variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) a task of
    ``srun`` stands for, from SLURM's; nothing where torch's own are there or this is no such task. MASTER_ADDR and
    MASTER_PORT given by the user are kept.

    >>> torch_variables({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
    ...                  "SLURM_TASKS_PER_NODE": "2", "SLURM_NODELIST": "n[3-4]", "MASTER_PORT": "29500"})
    {'RANK': '1', 'WORLD_SIZE': '2', 'LOCAL_RANK': '1', 'LOCAL_WORLD_SIZE': '2', 'MASTER_ADDR': 'n3'}
    """
    if "RANK" in env or not slurm_tasks(env):
        return {}
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
    out = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env["SLURM_NTASKS"],
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": re.split(r"[(,]", per_node)[0],  # "4(x2),3" -> "4"
    }
    if not env.get("MASTER_ADDR"):
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        out["MASTER_ADDR"] = first_slurm_host(nodes) or "127.0.0.1"
    if not env.get("MASTER_PORT"):
        # Every task of the job derives the same port; different jobs on one node rarely collide.
        out["MASTER_PORT"] = str(15000 + env_int("SLURM_JOB_ID", 0, env) % 20000)
    return out


def map_slurm_env() -> None:
    """Under ``srun`` (several tasks, no torchrun variables) put torch's variables into this process's environment
    too, for the libraries (and the data loader's caches) that read them there."""
    os.environ.update(torch_variables(os.environ))


def slurm_tasks(env: Mapping[str, str] | None = None) -> bool:
    """True inside a task started by ``srun`` with more than one task (a world SLURM already launched)."""
    env = os.environ if env is None else env
    return (
        env.get("DETRAIN_IGNORE_SLURM", "") not in ("1", "true")
        and "SLURM_PROCID" in env
        and "SLURM_LOCALID" in env
        and "SLURM_STEP_ID" in env
        and env_int("SLURM_NTASKS", 1, env) > 1
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


def requeue(job_id: str, timeout_s: float = 30.0) -> str:
    """Put SLURM job ``job_id`` back in the queue (``scontrol requeue``), after a preemption saved the run: the
    requeued job keeps its id and resumes its own checkpoints. Returns what happened, for the run's last line; a
    failure (no scontrol, a job that is not requeueable) is said, not raised."""
    if not re.fullmatch(r"[0-9]+(_[0-9]+)?", job_id):
        return f"SLURM job id {job_id[:40]!r} is not a job id: not requeued"
    try:
        done = subprocess.run(
            ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"could not requeue SLURM job {job_id} ({type(e).__name__}: {str(e)[:120]})"
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        return f"could not requeue SLURM job {job_id} (scontrol: {why[0][:160] if why else done.returncode})"
    return f"requeued SLURM job {job_id}"


def requeue_unless_stuck(job_id: str, run_dir: str | Path, point: str, limit: int) -> str:
    """Requeue job ``job_id`` (:func:`requeue`) after a preemption that saved the run at ``point`` (where it stands,
    as the run's line says it), unless it was already requeued ``limit`` times in a row from that same point: a job
    preempted again before it saved anything further would loop through the queue for ever. The count is kept in
    ``run_dir``/requeues.json (written atomically; another point or job starts it again at 1). ``limit`` 0: no
    limit. Returns what happened, for the run's last line."""
    path = Path(run_dir) / REQUEUES_FILE
    earlier: dict[str, object] = {}
    with contextlib.suppress(OSError, ValueError):
        read = json.loads(path.read_bytes()[:4096])
        earlier = read if isinstance(read, dict) else {}
    same = earlier.get("job") == job_id and earlier.get("point") == point and type(earlier.get("count")) is int
    count = int(earlier["count"]) + 1 if same else 1  # type: ignore[call-overload]
    if limit and count > limit:
        return (
            f"not requeued: SLURM job {job_id} was requeued {limit} times in a row with no progress since {point} "
            f"(requeue_without_progress={limit}); see why it is preempted before it saves, then requeue it by hand"
        )
    with contextlib.suppress(OSError):
        write_atomic(path, json.dumps({"job": job_id, "point": point, "count": count}))
    return requeue(job_id)
