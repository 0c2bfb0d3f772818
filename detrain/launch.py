"""Device strings -> a plan of workers -> torch's elastic launcher (or just a call, when one is enough).

``launch`` never writes a script and never manages processes itself: several workers on this node
(and several nodes) are started by ``torch.distributed.launcher.api.elastic_launch``, which brings
rendezvous, restarts (``max_restarts``), failure reports and signal handling. When the process is
already one rank of a world (torchrun, or ``srun`` with several tasks) it joins that world instead of
spawning again; a single device is a plain function call with no process group.

Accepted ``device`` values (``parse_device``):

* ``None`` / ``""``: cuda:0 when CUDA is available, else the CPU (under torchrun: cuda:LOCAL_RANK);
* ``"cpu"``: one CPU process; ``"cpu,cpu"`` (or ``["cpu", "cpu"]``): two CPU workers on gloo;
* ``0``, ``"0"``, ``"cuda:0"``, ``"cuda"``: one GPU; ``"0,1"``, ``[0, 1]``, ``"cuda:0,cuda:1"``: one
  worker per listed GPU on nccl (indices count the GPUs visible through CUDA_VISIBLE_DEVICES);
* ``"mps"``: Apple's GPU, one process.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

from detrain import dist
from detrain.errors import DistributedError

T = TypeVar("T")
DeviceKind = Literal["cpu", "cuda", "mps"]

_HANDLED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
_CONSEQUENCE_GRACE_S = 3.0


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

    def device_for(self, local_rank: int, local_world_size: int | None = None) -> str:
        """The torch device string for the worker with this local rank.

        Example:
            >>> DevicePlan("cuda", (2, 3), 2).device_for(1)
            'cuda:3'
        """
        if self.kind != "cuda":
            return self.kind
        if self.auto:
            if local_rank >= torch.cuda.device_count():
                raise DistributedError(
                    f"local rank {local_rank} has no GPU: "
                    f"{torch.cuda.device_count()} CUDA GPU(s) are visible on this node"
                )
            return f"cuda:{local_rank}"
        if local_rank >= len(self.ids) or (local_world_size is not None and local_world_size != len(self.ids)):
            raise DistributedError(
                f"device={','.join(map(str, self.ids))} lists {len(self.ids)} GPU(s) but the launcher started "
                f"{local_world_size or local_rank + 1} processes on this node; list one GPU per process"
            )
        return f"cuda:{self.ids[local_rank]}"


# ---------------------------------------------------------------------------------- devices


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


def _tokens(device: str | int | Sequence[str | int] | None) -> list[str]:
    if device is None:
        return []
    if isinstance(device, bool):
        raise DistributedError(f"device={device} is not a device; use cpu, mps, 0 or 0,1")
    if isinstance(device, int):
        return [str(device)]
    items = [device] if isinstance(device, str) else list(device)
    out: list[str] = []
    for item in items:
        # "[0, 1]" arrives as text from the command line; "0 1" is as clear as "0,1".
        out += [t for t in str(item).strip().strip("[]()").replace(" ", ",").split(",") if t.strip()]
    return [t.strip() for t in out]


def _show(device: object) -> str:
    if isinstance(device, (list, tuple)):
        return ",".join(str(d) for d in device)
    return "''" if device is None or device == "" else str(device)


def check_batch(batch: int, world: int) -> int:
    """Check that the global ``batch`` splits evenly over ``world`` ranks; return the per-rank batch.

    Example:
        >>> check_batch(16, 2)
        8
    """
    if world < 1 or batch < world or batch % world:
        up = max(world, -(-batch // world) * world)
        raise DistributedError(
            f"batch={batch} does not split evenly over {world} workers; use a multiple of {world}, e.g. {up}"
        )
    return batch // world


def in_launcher_env() -> bool:
    """True when this process is already one rank of a world started by torchrun or srun.

    Example:
        >>> import os
        >>> in_launcher_env()   # a plain `python` process
        False
    """
    env = os.environ
    return all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")) or dist.slurm_tasks()


def parse_nnodes(nnodes: str | int) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4), like torchrun's ``--nnodes``.

    Example:
        >>> parse_nnodes("1:4")
        (1, 4)
    """
    text = str(nnodes).strip()
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if lo < 1 or hi < lo:
        raise DistributedError(f"nnodes={text!r} is not valid; use a node count like 2 or a range MIN:MAX like 1:4")
    return lo, hi


# ----------------------------------------------------------------------------------- launch


def launch(
    entry: Callable[[dict[str, Any]], T],
    args: dict[str, Any],
    plan: DevicePlan,
    *,
    nnodes: str | int = "1",
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    max_restarts: int = 0,
    rdzv_backend: Literal["static", "c10d"] | None = None,
    run_id: str = "detrain",
    monitor_interval: float = 0.2,
    start_timeout: float = 600.0,
    connect_timeout: float = 60.0,
) -> T | None:
    """Run ``entry(args)`` on every worker of ``plan`` (times ``nnodes``) and return rank 0's result.

    * already a rank of a torchrun/srun world, or one device on one node: ``entry(args)`` is called in
      this process (the caller keeps working objects);
    * otherwise torch's ``elastic_launch`` starts ``plan.nprocs`` workers here (spawned, so ``entry``
      must be an importable top-level function and ``args`` picklable); rank 0's return value comes
      back to this process. On a node that does not host rank 0 (``node_rank > 0``) it returns None.

    ``master_port=0`` on one node lets the rendezvous pick a free port. Several nodes need the same
    ``master_addr``/``master_port``/``run_id`` on each and ``node_rank`` 0..N-1; ``nnodes="MIN:MAX"``
    uses torch's c10d rendezvous (node_rank 0 hosts it) for elastic membership. Failures raise
    ``DistributedError`` with one line naming the rank and the cause; Ctrl-C stops every worker and
    raises ``KeyboardInterrupt``.

    Example:
        >>> from detrain.launch import launch, parse_device
        >>> launch(len, {"a": 1}, parse_device("cpu"))   # one CPU: a plain call
        1
    """
    lo, hi = parse_nnodes(nnodes)
    if in_launcher_env() or (plan.nprocs == 1 and hi == 1):
        try:
            with _worker_env(plan, joined=in_launcher_env()):
                return entry(args)
        finally:
            dist.cleanup()  # launch owns the group's lifetime, as it does in spawned workers

    backend, endpoint, rdzv_configs = _rendezvous(lo, hi, node_rank, master_addr, master_port, rdzv_backend)
    _check_entry(entry)
    if max_restarts < 0:
        raise DistributedError(f"max_restarts={max_restarts} must be >= 0")
    if node_rank == 0 and master_port:
        _check_port_free(master_port)
    elif node_rank > 0:
        _wait_reachable(master_addr, master_port, connect_timeout)

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Elastic keeps per-attempt error files in a log folder; ours goes away with the launch (torch's
    # default would leave a torchelastic_* folder in /tmp per run). The failures are parsed before that.
    log_dir = tempfile.TemporaryDirectory(prefix="detrain_elastic_")
    config = LaunchConfig(
        logs_specs=DefaultLogsSpecs(log_dir=log_dir.name),
        min_nodes=lo,
        max_nodes=hi,
        nproc_per_node=plan.nprocs,
        run_id=run_id,
        role="detrain",
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        rdzv_timeout=int(start_timeout),
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method="spawn",  # fork would copy CUDA state and the caller's threads
    )
    threads = None if os.environ.get("OMP_NUM_THREADS") else max(1, _cores() // plan.nprocs)
    # c10d: let every rendezvous round start a fresh store for the workers instead of sharing the agent's,
    # whose stale keys break restarts and membership changes (pytorch/pytorch#135712).
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if backend == "c10d" else {}
    with log_dir, _restore_signal_handlers(), _environ(env):
        try:
            results = elastic_launch(config, _worker)(entry, args, plan, threads)
        except ChildFailedError as e:
            raise DistributedError(_describe_failure(e, max_restarts)) from None
        except SignalException as e:
            if e.sigval == signal.SIGINT:
                raise KeyboardInterrupt from None
            raise DistributedError(f"stopped by {signal.Signals(e.sigval).name}; all workers were terminated") from None
        except (RendezvousError, RuntimeError, ValueError, TimeoutError) as e:  # rendezvous / store failures
            cause = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise DistributedError(f"could not form the group at {endpoint} (node_rank={node_rank}): {cause}") from None
    return results.get(0)  # type: ignore[no-any-return]


@record
def _worker(entry: Callable[[dict[str, Any]], T], args: dict[str, Any], plan: DevicePlan, threads: int | None) -> T:
    """What each spawned worker runs; ``@record`` writes the exception to elastic's error file."""
    if threads is not None:
        # One core per worker on CPU: more threads only fight each other and the gloo comms.
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    try:
        with _worker_env(plan, joined=True):
            return entry(args)
    except KeyboardInterrupt:
        raise SystemExit(130) from None  # the agent reports the stop; no traceback per worker
    except DistributedError as e:
        if dist.PEER_LOST_MARK in str(e):
            # This rank only noticed that a peer is gone. The agent reports whichever worker it sees
            # exit first and stops the rest, so give the peer that failed on its own time to be seen.
            time.sleep(_CONSEQUENCE_GRACE_S)
        raise
    finally:
        dist.cleanup()


def _worker_env(plan: DevicePlan, joined: bool) -> contextlib.AbstractContextManager[None]:
    """Tell ``dist.setup`` this process's device through the environment, and tidy up afterwards."""
    local = int(os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or 0) if joined else 0
    local_world = (int(os.environ.get("LOCAL_WORLD_SIZE") or 0) or None) if joined else None
    return _environ(
        {
            dist.DEVICE_ENV: plan.device_for(local, local_world),
            "DETRAIN_DEVICE_KIND": plan.kind,
            "DETRAIN_DEVICE_IDS": ",".join(map(str, plan.ids)),
        }
    )


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of a block, then restore what was there."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------------------- pre-flight checks


def _rendezvous(
    lo: int, hi: int, node_rank: int, addr: str, port: int, backend: str | None
) -> tuple[str, str, dict[str, Any]]:
    if not 0 <= node_rank < hi:
        shown = str(lo) if lo == hi else f"{lo}:{hi}"
        raise DistributedError(f"node_rank={node_rank} must be in 0..{hi - 1} for nnodes={shown}")
    if not 0 <= port <= 65535:
        raise DistributedError(f"master_port={port} is not a TCP port (0..65535)")
    if hi > 1 and not port:
        raise DistributedError("several nodes need master_port=PORT (the same free port on every node)")
    if backend not in (None, "static", "c10d"):
        raise DistributedError(f"rdzv_backend={backend!r} is not supported; use static or c10d")
    if lo != hi and backend == "static":
        raise DistributedError(f"nnodes={lo}:{hi} is elastic and needs rdzv_backend=c10d, not static")
    if backend is None or (backend == "static" and not port and hi == 1):
        # Static rendezvous needs a known port; with master_port=0 on one node (the config's defaults) c10d
        # lets its store bind a free port itself (no race with another run picking the same one).
        backend = "static" if lo == hi and port else "c10d"
    endpoint = f"{addr}:{port}"
    if backend == "static":
        return backend, endpoint, {"rank": node_rank}
    # Name the host explicitly: guessing from hostnames fails for two "nodes" on one machine.
    return backend, endpoint, {"is_host": node_rank == 0} if port else {}


def _check_entry(entry: Callable[..., Any]) -> None:
    qual = getattr(entry, "__qualname__", "")
    module = getattr(entry, "__module__", None)
    # A notebook's __main__ has no file, so spawned workers cannot import what was defined there.
    no_file = module == "__main__" and not getattr(sys.modules.get("__main__"), "__file__", None)
    if "<lambda>" in qual or "<locals>" in qual or not module or no_file:
        raise DistributedError(
            f"entry {qual or entry!r} cannot be sent to spawned workers; "
            "use a top-level function of an importable module"
        )


def _check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # Same option as torch's TCPStore, so a port in TIME_WAIT is not reported as busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                raise DistributedError(
                    f"master_port={port} is already in use on this machine; choose another port or stop what holds it"
                ) from None
            raise DistributedError(f"cannot listen on master_port={port}: {e.strerror}") from None


def _wait_reachable(addr: str, port: int, timeout_s: float) -> None:
    """Retry a TCP connect to the master until ``timeout_s``: nodes may start in any order."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            with socket.create_connection((addr, port), timeout=min(5.0, max(0.1, timeout_s))):
                return
        except OSError as e:
            last = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise DistributedError(
                f"cannot reach the master at {addr}:{port} within {timeout_s:g}s ({last}); "
                "start node_rank=0 first and check master_addr, master_port and the firewall"
            )
        time.sleep(0.5)


def _describe_failure(e: ChildFailedError, max_restarts: int) -> str:
    """One line: the failing rank that caused it, how it ended and its own last words (from the error file).

    Elastic's own choice (earliest timestamp, in whole seconds) often names a rank whose collective merely
    noticed a dead peer; a rank that failed on its own is the root cause, so it is preferred.
    """
    failures = e.failures
    primary = [r for r, f in failures.items() if not _is_consequence(f)] or list(failures)
    root_rank = min(primary, key=lambda r: (failures[r].timestamp, r))
    parts = [f"worker rank {root_rank} {_how(failures[root_rank])}"]
    others = sorted(r for r in failures if r != root_rank)
    if others:
        parts.append(f"(also failed: rank {', '.join(map(str, others))})")
    if max_restarts:
        parts.append(f"after max_restarts={max_restarts} restarts")
    return " ".join(parts)


def _message(failure: Any) -> str:
    msg = failure.message
    if isinstance(msg, dict):  # written by @record: {"message": "Type: text", "extraInfo": {...}}
        msg = msg.get("message", "")
    return str(msg).strip()


def _is_consequence(failure: Any) -> bool:
    """A rank whose collective failed because another rank was gone (see ``dist._cause``)."""
    msg = _message(failure)
    return failure.exitcode > 0 and msg.startswith("DistributedError:") and dist.PEER_LOST_MARK in msg


def _how(failure: Any) -> str:
    msg = _message(failure)
    if failure.exitcode < 0:
        return f"was killed by {failure.signal_name()} (exit code {failure.exitcode})"
    if failure.error_file_data and msg and not msg.startswith("To enable traceback"):
        return f"failed (exit code {failure.exitcode}): {msg.splitlines()[0][:300]}"
    return f"exited with code {failure.exitcode} without a Python error (see its output above)"


@contextlib.contextmanager
def _restore_signal_handlers() -> Iterator[None]:
    """The elastic agent installs its own handlers and leaves them; give the caller its own back."""
    saved = {}
    for name in _HANDLED_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            with contextlib.suppress(ValueError):  # not the main thread: nothing to save
                saved[sig] = signal.getsignal(sig)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1
