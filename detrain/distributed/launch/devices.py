"""The user's ``device`` value -> a :class:`DevicePlan`: which kind of device, which GPUs, how many workers.

Accepted ``device`` values (``parse_device``):

* ``None`` / ``""``: cuda:0 when CUDA is available, else the CPU (under torchrun: cuda:LOCAL_RANK; under ``srun``
  with per-task GPU binding, each task's own GPU: :func:`slurm_binds_gpus`);
* ``"cpu"``: one CPU process; ``"cpu,cpu"`` (or ``["cpu", "cpu"]``): two CPU workers on gloo;
* ``0``, ``"0"``, ``"cuda:0"``, ``"cuda"``: one GPU; ``"0,1"``, ``[0, 1]``, ``"cuda:0,cuda:1"``: one
  worker per listed GPU on nccl (indices count the GPUs visible through CUDA_VISIBLE_DEVICES);
* ``"mps"``: Apple's GPU, one process;
* ``-1`` (``-1,-1`` for two): the idlest GPU(s), as Ultralytics picks them; resolved once, where the arguments are
  read (:func:`resolve_idle`), to the indices above, or to ``""`` (the CPU) where there is no GPU.

Everything wrong with the value is a :class:`DistributedError` before any process starts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from detrain.errors import DistributedError

DeviceKind = Literal["cpu", "cuda", "mps"]


@dataclass(frozen=True)
class DevicePlan:
    """Which devices this node runs on: ``nprocs`` workers of one ``kind``.

    ``ids`` are CUDA indices (one per worker) and empty for cpu/mps; ``auto`` means the user named no
    device, so under an external launcher each rank takes ``cuda:LOCAL_RANK``.
    """

    kind: DeviceKind
    ids: tuple[int, ...]
    nprocs: int
    auto: bool = False

    def device_for(self, local_rank: int, local_world_size: int | None = None, own_gpus: bool = False) -> str:
        """The torch device string for the worker with this local rank.

        ``own_gpus``: the launcher gave each process GPUs of its own, which are all it sees (SLURM's per-task
        binding, :func:`slurm_binds_gpus`); an automatic plan (or one GPU named) then takes the first of them
        (that one), whatever the local rank.

        Example:
            >>> DevicePlan("cuda", (2, 3), 2).device_for(1)
            'cuda:3'
        """
        if self.kind != "cuda":
            return self.kind
        if self.auto:
            count = torch.cuda.device_count()
            if own_gpus and count:
                return "cuda:0"
            if local_rank >= count:
                raise DistributedError(
                    f"local rank {local_rank} has no GPU: {count} CUDA GPU(s) are visible to it "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start one process "
                    f"per visible GPU, or let the scheduler give each process its own"
                )
            return f"cuda:{local_rank}"
        if own_gpus and len(self.ids) == 1:  # device=0 under per-task binding: each task's own first GPU
            return f"cuda:{self.ids[0]}"
        if local_rank >= len(self.ids) or (local_world_size is not None and local_world_size != len(self.ids)):
            raise DistributedError(
                f"device={','.join(map(str, self.ids))} lists {len(self.ids)} GPU(s) but the launcher started "
                f"{local_world_size or local_rank + 1} processes on this node; list one GPU per process"
            )
        return f"cuda:{self.ids[local_rank]}"


def slurm_binds_gpus(local_rank: int, tasks_on_node: int) -> bool:
    """Whether SLURM gave this task (one of ``srun``'s) GPUs of its own: fewer GPUs are visible to it than there are
    tasks on its node, or none at its local rank. ``srun --gpus-per-task 1`` (and ``--gpu-bind``) sets
    CUDA_VISIBLE_DEVICES per task, so every task sees one GPU, its own, as cuda:0; taking cuda:LOCAL_RANK would
    leave every task but the first without one.

    Example:
        >>> import torch
        >>> slurm_binds_gpus(1, 4) == (0 < torch.cuda.device_count() < 4)  # task 1 of 4 on its node
        True
    """
    count = torch.cuda.device_count()
    return count > 0 and (count < tasks_on_node or local_rank >= count)


def parse_device(device: str | int | Sequence[str | int] | None) -> DevicePlan:
    """Turn the user's ``device`` into a ``DevicePlan``; raise ``DistributedError`` before anything starts.

    Example:
        >>> parse_device("cpu,cpu")
        DevicePlan(kind='cpu', ids=(), nprocs=2, auto=False)
        >>> parse_device("cpu").nprocs
        1
    """
    shown = _show(device)
    tokens = _tokens(device)
    if not tokens:
        if torch.cuda.is_available():
            return DevicePlan("cuda", (0,), 1, auto=True)
        return DevicePlan("cpu", (), 1, auto=True)

    kinds: list[DeviceKind] = []
    ids: list[int] = []
    for tok in tokens:
        low = tok.lower()
        if low == "cpu":
            kinds.append("cpu")
        elif low == "mps":
            kinds.append("mps")
        elif low == "cuda":
            kinds.append("cuda")
            ids.append(0)
        else:
            num = low[5:] if low.startswith("cuda:") else low
            if not num.lstrip("-").isdigit():
                raise DistributedError(f"device={shown}: {tok!r} is not a device; use cpu, mps, 0 or 0,1")
            if int(num) < 0:
                raise DistributedError(f"device={shown}: negative GPU indices are not supported; list indices like 0,1")
            kinds.append("cuda")
            ids.append(int(num))

    if len(set(kinds)) > 1:
        raise DistributedError(f"device={shown} mixes {' and '.join(sorted(set(kinds)))}; use one kind of device")
    kind = kinds[0]
    if kind == "cpu":
        return DevicePlan("cpu", (), len(kinds))
    if kind == "mps":
        if len(kinds) > 1:
            raise DistributedError(f"device={shown}: there is only one mps device; use device=mps")
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise DistributedError(f"device={shown} but MPS is not available on this machine; use device=cpu")
        return DevicePlan("mps", (), 1)

    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise DistributedError(f"device={shown} lists cuda:{dupes[0]} twice; each worker needs its own GPU")
    if not torch.cuda.is_available():
        raise DistributedError(f"device={shown} asks for CUDA but no CUDA GPU is available here; use device=cpu")
    count = torch.cuda.device_count()
    missing = [i for i in ids if i >= count]
    if missing:
        raise DistributedError(
            f"device={shown}: cuda:{missing[0]} does not exist; {count} CUDA GPU(s) are visible (valid: 0..{count - 1})"
        )
    return DevicePlan("cuda", tuple(ids), len(ids))


#: a GPU ``device=-1`` may pick keeps at least this fraction of its memory free (as Ultralytics asks)
IDLE_FREE_FRACTION = 0.2


def resolve_idle(device: str | int | Sequence[str | int] | None) -> tuple[str | int | Sequence[str | int] | None, str]:
    """``device`` with each ``-1`` replaced by the idlest visible GPU not named otherwise (lowest utilisation where
    the driver reports it, then the most free memory; at least :data:`IDLE_FREE_FRACTION` of it free), and the one
    line that says what was picked ('' when ``device`` holds no ``-1``). A ``-1`` no GPU qualifies for is dropped,
    as Ultralytics drops it: with nothing left the default device runs (the first GPU, else the CPU).

    Example:
        >>> resolve_idle("cpu"), resolve_idle(0)
        (('cpu', ''), (0, ''))
    """
    try:
        tokens = _tokens(device)
    except DistributedError:
        return device, ""  # parse_device names what is wrong with it
    if "-1" not in tokens:
        return device, ""
    named = {int(t.lower().removeprefix("cuda:")) for t in tokens if t.lower().removeprefix("cuda:").isdigit()}
    wanted = tokens.count("-1")
    picked = _idlest_gpus(wanted, named)
    rest = [t for t in tokens if t != "-1"]
    resolved = ",".join(rest + [str(i) for i in picked])
    if not torch.cuda.is_available():
        where = "using the CPU" if not resolved else f"device={resolved}"
        return resolved, f"device={_show(device)}: no CUDA GPU here to pick an idle one from; {where}"
    if len(picked) < wanted:
        shown_rest = f"device={resolved}" if resolved else "the default device (cuda:0)"
        return resolved, (
            f"device={_show(device)}: {len(picked)} of the {wanted} GPU(s) asked for have {IDLE_FREE_FRACTION:.0%} "
            f"of their memory free; using {shown_rest}"
        )
    return resolved, f"device={_show(device)}: the idlest GPU(s) picked: {', '.join(f'cuda:{i}' for i in picked)}"


def _idlest_gpus(count: int, named: set[int]) -> list[int]:
    """Up to ``count`` visible GPUs, outside ``named``, idlest first (see :func:`resolve_idle`)."""
    if not torch.cuda.is_available():
        return []
    ranked = []
    for i in range(torch.cuda.device_count()):
        if i in named:
            continue
        try:
            free, total = torch.cuda.mem_get_info(i)
        except RuntimeError:  # a GPU that cannot be queried (busy in exclusive mode, lost) is not idle
            continue
        try:
            busy = int(torch.cuda.utilization(i))
        except Exception:  # noqa: BLE001 - no NVML (pynvml) or its own error: free memory alone ranks them
            busy = 0
        if total and free / total >= IDLE_FREE_FRACTION:
            ranked.append((busy, -free, i))
    return [i for _, _, i in sorted(ranked)[:count]]


def cpu_threads_per_worker(workers_on_node: int) -> int | None:
    """The torch threads of each of ``workers_on_node`` workers on this node: an equal share of the cores this
    process may run on (at least one), since more threads only fight each other and the gloo comms; None when the
    user set OMP_NUM_THREADS, which wins. The one rule for spawned workers (the launcher) and for a worker that
    runs in the calling process or under torchrun (``detrain.engine.build.set_cpu_threads``)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, _cores() // max(1, workers_on_node))


#: the most loader processes ``workers=auto`` gives a rank: each holds its own decode buffers and open files
AUTO_WORKERS_MAX = 16


def loader_workers(workers: int | str, workers_on_node: int) -> int:
    """DataLoader processes for each of ``workers_on_node`` ranks on this node: ``workers`` as given, or for
    ``auto`` an equal share of the cores this process may run on (at least 1, at most 16). A GPU's rank waits on
    the GPU, so its share of the cores decodes and augments (the loader was what held whole epochs back on a
    16-core GPU machine, docs/benchmarks.md); a fixed 4 left most of a large node idle.

    >>> loader_workers(3, 8), loader_workers("auto", 10**6)
    (3, 1)
    """
    if workers != "auto":
        return int(workers)
    return min(AUTO_WORKERS_MAX, max(1, _cores() // max(1, workers_on_node)))


def _cores() -> int:
    """The cores this process may run on (its affinity: a SLURM allocation, taskset), else every core."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _tokens(device: str | int | Sequence[str | int] | None) -> list[str]:
    """The device names in ``device``: ``"0,1"``, ``"0 1"``, ``"[0, 1]"`` and ``[0, 1]`` all give ``["0", "1"]``.

    An empty entry (``cpu,,``, ``,0``, ``[]`` inside a list) or an unbalanced bracket is an error: the value was
    cut or mistyped, and guessing what was meant could start a run on the wrong devices.
    """
    if device is None:
        return []
    if isinstance(device, bool):
        raise DistributedError(f"device={device} is not a device; use cpu, mps, 0 or 0,1")
    if isinstance(device, int):
        return [str(device)]
    shown = _show(device)
    if isinstance(device, str):
        text = device.strip()
        if not text:
            return []
        if text[:1] in "[(" or text[-1:] in "])":
            if (text[:1], text[-1:]) not in (("[", "]"), ("(", ")")):
                raise DistributedError(f"device={shown} has an unbalanced bracket; write e.g. 0,1 or [0,1]")
            text = text[1:-1]
        items: list[str] = text.split(",")
    else:
        items = [part for item in device for part in str(item).split(",")]
    out: list[str] = []
    for item in items:
        words = item.split()  # "0 1" is as clear as "0,1"
        if not words:
            raise DistributedError(f"device={shown} has an empty entry; list devices like 0,1 or cpu,cpu")
        out += words
    return out


def _show(device: object) -> str:
    if isinstance(device, (list, tuple)):
        return ",".join(str(d) for d in device)
    return "''" if device is None or device == "" else str(device)
