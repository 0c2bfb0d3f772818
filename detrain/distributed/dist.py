"""The process group, every collective and every timeout, in one place.

The trainer never calls ``torch.distributed`` itself; it asks this module. In a single process (a
``World`` of one rank) every function here is a no-op or the identity, so the same
training code runs unchanged on one device and on many.

Timeouts come in two phases:

* start-up (``startup_timeout_s``, default 600 s): joining the group and the first barrier, where
  ranks may legitimately wait for each other to import, build models or cache labels;
* training (``timeout_s``: the config's ``dist_timeout``; 300 s when not given): every collective after
  ``setup`` returns. A rank that hangs or dies makes its peers' next collective fail within this
  bound, so the elastic launcher can stop the run instead of waiting for torch's 30-minute default.

The switch between the two uses ``torch.distributed.set_timeout`` on the default group (public in
recent torch, 2.14 included; older versions get the private ``_set_pg_timeout``). It changes the timeout of
every later operation on the group, DDP's gradient all-reduces included. For gloo a timed-out
collective raises in Python, which this module turns into a one-line ``DistributedError`` naming
the operation, the rank and the cause. For NCCL the watchdog aborts the process instead (CUDA work
is asynchronous, so raising is not safe) after one line on stderr, which detrain's launcher reads
(:mod:`detrain.distributed.launch.nccl_watch`) to report the rank that stopped, or the one the watchdog ended and why.
A phase that is known to take long (the first process of a node downloading a dataset, checking its labels
or filling ``cache=ram``) passes ``timeout_s`` (the config's ``prepare_timeout``) to ``barrier`` for that one
wait. On gloo, barriers go through the rendezvous store (each rank marks its arrival, then waits for every
mark), so every rank's wait is bounded and the error names the ranks that never came. Every rank also keeps a
heartbeat in that store (:mod:`detrain.distributed.heartbeat`), so that a rank whose collective timed out can name
the rank that stopped (:func:`silent_peers_error`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from detrain.distributed import heartbeat, wire
from detrain.distributed.launch import nccl_watch, netif
from detrain.distributed.launch.master_store import SECRET_ENV, host_store, sealed
from detrain.distributed.launch.slurm import map_slurm_env
from detrain.distributed.store_barrier import Absent, StoreBarrier
from detrain.distributed.world import World
from detrain.errors import DistributedError

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_STARTUP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class DistInfo:
    """The group this process joined, returned by ``setup``: its World (who it is: rank, sizes, device, restarts,
    read from the environment once; the one place those facts live) and what joining settled (the backend, the
    collectives' timeout)."""

    world: World
    backend: str | None
    timeout_s: float

    @property
    def rank(self) -> int:
        return self.world.rank if self.distributed else 0

    @property
    def local_rank(self) -> int:
        return self.world.local_rank if self.distributed else 0

    @property
    def world_size(self) -> int:
        return self.world.world_size

    @property
    def local_world_size(self) -> int:
        return self.world.local_world_size if self.distributed else 1

    @property
    def device(self) -> str:
        return self.world.device

    @property
    def restart_count(self) -> int:
        return self.world.restart_count

    @property
    def distributed(self) -> bool:
        return self.world.distributed


_info: DistInfo | None = None
_barriers: StoreBarrier | None = None  # barrier() on gloo: every rank's wait is bounded
# the group's store, held here while the group lives: a SealedStore is a Python object, which the process group
# (C++) does not keep alive, and rank 0's holds the store's server
_group_store: Any = None


# ----------------------------------------------------------------------------------------- setup


def setup(
    world: World,
    backend: str | None = None,
    timeout_s: float | None = None,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
) -> DistInfo:
    """Join the process group of ``world``, or stay single-process.

    ``world`` (:class:`detrain.distributed.world.World`, as the launcher handed it to the worker's entry) gives the
    ranks, MASTER_ADDR / MASTER_PORT (set by torch's elastic launcher or torchrun, or mapped from SLURM's variables
    under ``srun``) and the device (the device plan's for this worker, chosen by
    ``detrain.distributed.launch.launcher``). Backend: nccl for CUDA, gloo otherwise. Under ``srun`` torch's
    variables are also put into the environment, for libraries that read them there.

    Example:
        >>> info = setup(World())     # a plain process: no group, rank 0 of 1
        >>> info.world_size, info.distributed
        (1, False)
        >>> cleanup()
    """
    global _info, _barriers, _group_store
    if _info is not None and (not _info.distributed or tdist.is_initialized()):
        return _info
    map_slurm_env()
    device = world.device
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    timeout = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    restarts = world.restart_count
    if not world.distributed:
        _info = DistInfo(world, None, timeout)
        return _info

    rank_, size = world.rank, world.world_size
    _check_world(world)
    addr, port = world.master_addr, int(world.master_port or 0)
    backend = backend or ("nccl" if device.startswith("cuda") else "gloo")
    where = f"{addr}:{port}"
    startup = timedelta(seconds=startup_timeout_s)
    _keep_transport_on_master_interface(addr, world.whole_world_here)
    try:
        joined = _store_args(world, startup)
        _group_store = joined["store"]
        tdist.init_process_group(
            backend=backend,
            timeout=startup,
            device_id=torch.device(device) if device.startswith("cuda") else None,
            **joined,
        )
    except Exception as e:  # a dead master, a bad address: say which rank could not join where
        msg = f"rank {rank_} of {size} could not join the process group at {where}: {_cause(e)}"
        raise DistributedError(msg) from e
    _info = DistInfo(world, backend, timeout)
    _barriers = StoreBarrier.connect(addr, port, restarts, startup, world.secret)
    heartbeat.start(addr, port, restarts, rank_, size)
    # Every rank has reached this point before training begins: a slow start is not a hang.
    barrier("setup", timeout_s=startup_timeout_s)
    _set_group_timeout(timeout)
    return _info


def _check_world(world: World) -> None:
    """What a world of several ranks needs before it joins: where the master is, and for srun's tasks on several
    nodes the run's secret (one line each)."""
    missing = "MASTER_ADDR" if not world.master_addr else "MASTER_PORT" if world.master_port is None else None
    if missing:
        raise DistributedError(
            f"WORLD_SIZE={world.world_size} is set but {missing} is not; start through detrain or torchrun"
        )
    if world.launcher == "slurm" and not world.whole_world_here and not world.secret:
        raise DistributedError(
            f"srun's tasks on several nodes need the run's secret: export {SECRET_ENV} in the job script (srun "
            "passes it to every task); python -c 'import secrets; print(secrets.token_hex(16))' makes one"
        )


def cleanup() -> None:
    """Leave the process group (if any); safe to call twice or without ``setup``.

    Example:
        >>> cleanup()
    """
    global _info, _barriers, _group_store
    heartbeat.stop()  # the others' counters stay readable: a failed rank names the silent ones after leaving
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()
    _info, _barriers, _group_store = None, None, None


# ----------------------------------------------------------------------------------- who am I


def is_distributed() -> bool:
    """True inside an initialised process group of more than one rank.

    Example:
        >>> is_distributed()
        False
    """
    return tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1


def rank() -> int:
    """Global rank; 0 when not distributed.

    Example:
        >>> rank()
        0
    """
    return tdist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of ranks; 1 when not distributed.

    Example:
        >>> world_size()
        1
    """
    return tdist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    """Rank within this node (picks the GPU); 0 when not distributed.

    Example:
        >>> local_rank()
        0
    """
    return _info.local_rank if _info is not None and is_distributed() else 0


def is_main() -> bool:
    """True on global rank 0 (and in a single process): the rank that logs and saves.

    Example:
        >>> is_main()
        True
    """
    return rank() == 0


# ---------------------------------------------------------------------------------- collectives


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over all ranks, as a new detached tensor (``t`` itself is left alone).

    Example:
        >>> all_reduce_sum(torch.tensor([1.0, 2.0]))   # single process: a copy
        tensor([1., 2.])
    """
    out = t.detach().clone()
    if is_distributed():
        with _named("all_reduce_sum"):
            tdist.all_reduce(out, op=tdist.ReduceOp.SUM)
    return out


def reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean of ``t`` over all ranks, as a new detached tensor (for logging loss items).

    Example:
        >>> reduce_mean(torch.tensor([2.0]))
        tensor([2.])
    """
    out = all_reduce_sum(t)
    return out / world_size() if is_distributed() else out


def broadcast_(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank ``src``'s values in ``t`` on every rank, in place; returns ``t``.

    Example:
        >>> broadcast_(torch.tensor([3.0]))   # single process: unchanged
        tensor([3.])
    """
    if is_distributed():
        with _named(f"broadcast(src={src})"):
            tdist.broadcast(t, src=src)
    return t


def broadcast_many_(tensors: list[torch.Tensor]) -> None:
    """Rank 0's values of ``tensors`` on every rank, in place: one broadcast per dtype of one flat tensor (a
    collective)."""
    with torch.no_grad():
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            group = [t for t in tensors if t.dtype == dtype]
            flat = broadcast_(torch.cat([t.detach().reshape(-1) for t in group]))
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank. ``obj`` travels as a message of
    :mod:`detrain.distributed.wire` (plain data, arrays, tensors, marked dataclasses; never a pickle), so a rank
    builds only data from what the others sent; anything else a rank sends is one line, refused.

    Example:
        >>> all_gather_object({"tp": 3})
        [{'tp': 3}]
    """
    if not is_distributed():
        return [obj]
    data = wire.encode(obj)
    with _named("all_gather_object"):
        parts = _all_gather_bytes(data)
        return [_decoded(part, f"rank {i}") for i, part in enumerate(parts)]


def gather_to_main(t: torch.Tensor) -> list[torch.Tensor] | None:
    """Every rank's ``t`` (the same shape and dtype on every rank), in rank order, on rank 0 alone (None on the
    others, which receive nothing): a tensor gather, no pickles. On NCCL the tensors travel through the GPUs.

    Example:
        >>> gather_to_main(torch.ones(2))
        [tensor([1., 1.])]
    """
    if not is_distributed():
        return [t]
    device = _p2p_device()
    mine = t.to(device).contiguous()
    out = [torch.empty_like(mine) for _ in range(world_size())] if is_main() else None
    with _named("gather_to_main"):
        tdist.gather(mine, out, dst=0)
    return [x.cpu() for x in out] if out is not None else None


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (the others' ``obj`` is ignored), as a message of
    :mod:`detrain.distributed.wire` (see :func:`all_gather_object`).

    Example:
        >>> broadcast_object([1, 2])
        [1, 2]
    """
    if not is_distributed():
        return obj
    mine = rank() == src
    data = wire.encode(obj) if mine else b""
    with _named(f"broadcast_object(src={src})"):
        device = _p2p_device()
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        tdist.broadcast(size, src=src)
        _check_size(int(size.item()), src)
        payload = _as_tensor(data, device) if mine else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        if payload.numel():
            tdist.broadcast(payload, src=src)
        return obj if mine else _decoded(payload.cpu().numpy().tobytes(), f"rank {src}")


def _all_gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's ``data`` (of any length), in rank order: the lengths first, each checked against the bound
    before anything is allocated, then one all-gather of the bytes padded to the longest."""
    device = _p2p_device()
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size())]
    tdist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device))
    lengths = [int(s.item()) for s in sizes]
    for sender, n in enumerate(lengths):
        _check_size(n, sender)
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: len(data)] = _as_tensor(data, device)
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in lengths]
    tdist.all_gather(out, mine)
    return [t[:n].cpu().numpy().tobytes() for t, n in zip(out, lengths, strict=True)]


def _as_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _check_size(n: int, sender: int) -> None:
    if not 0 <= n <= wire.MAX_MESSAGE:
        raise DistributedError(
            f"rank {sender} announced a message of {n} bytes, over the bound of {wire.MAX_MESSAGE}; refused"
        )


def _decoded(data: bytes, sender: str) -> Any:
    """The value ``sender`` sent, or one line saying it was refused (nothing of it was built)."""
    try:
        return wire.decode(data)
    except wire.WireError as e:
        raise DistributedError(f"rank {rank()} of {world_size()} refused what {sender} sent: {e}") from None


def agree(value: Any) -> Any:
    """Rank 0's ``value`` on every rank, so that all ranks take the same branch (stop early, best fitness).

    Example:
        >>> agree(True)
        True
    """
    return broadcast_object(value, src=0)


def send_bytes(data: bytes, dst: int) -> None:
    """Send ``data`` to rank ``dst`` alone (point to point: only the two ranks take part; ``dst`` calls
    :func:`recv_bytes`). Its length goes first. On NCCL the bytes travel through this rank's GPU. Each transfer
    waits at most the training timeout: gloo's point-to-point waits have no bound of their own, so a peer stopped
    mid-transfer (SIGSTOP, a hung host) would hold this rank forever instead of ending it with one line."""
    device = _p2p_device()
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    with _named(f"send_bytes(dst={dst})"):
        _p2p_wait(tdist.isend(torch.tensor([len(data)], dtype=torch.int64, device=device), dst))
        if data:
            _p2p_wait(tdist.isend(payload.to(device), dst))


def recv_bytes(src: int) -> bytes:
    """The bytes rank ``src`` sends with :func:`send_bytes` (point to point, bounded as it is)."""
    device = _p2p_device()
    size = torch.zeros(1, dtype=torch.int64, device=device)
    with _named(f"recv_bytes(src={src})"):
        _p2p_wait(tdist.irecv(size, src))
        out = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        if out.numel():
            _p2p_wait(tdist.irecv(out, src))
    return out.cpu().numpy().tobytes()


def _p2p_wait(work: Any) -> None:
    """Wait for a point-to-point transfer at most the training timeout; a transfer not done by then raises."""
    timeout = _info.timeout_s if _info is not None else DEFAULT_TIMEOUT_S
    if work is not None and not work.wait(timeout=timedelta(seconds=timeout)):
        raise TimeoutError(f"timed out after {timeout:g}s waiting for a point-to-point transfer")


def _p2p_device() -> torch.device:
    """Where point-to-point tensors must live: this rank's GPU on NCCL, host memory on gloo."""
    if tdist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier(name: str, timeout_s: float | None = None) -> None:
    """Wait until every rank reaches the barrier called ``name``.

    ``timeout_s`` overrides the training timeout for this one wait (e.g. while rank 0 downloads a
    dataset). On gloo every rank marks its arrival in the rendezvous store and waits for the others' marks, so
    every rank's wait is bounded (gloo's monitored barrier bounds only rank 0's) and the error names the ranks
    that never came. On nccl it is torch's barrier under the timeout (the watchdog bounds every rank).

    Example:
        >>> barrier("dataset ready")   # no-op in a single process
    """
    if not is_distributed():
        return
    timeout = _info.timeout_s if timeout_s is None and _info is not None else (timeout_s or DEFAULT_TIMEOUT_S)
    with _named(f"barrier '{name}'", timeout):
        if tdist.get_backend() == "gloo" and _barriers is not None:
            _barriers.wait(rank(), world_size(), timeout)
        elif tdist.get_backend() == "gloo":
            tdist.monitored_barrier(timeout=timedelta(seconds=timeout), wait_all_ranks=True)
        else:
            with _group_timeout(timeout):
                tdist.barrier(device_ids=[torch.cuda.current_device()] if torch.cuda.is_available() else None)


# ------------------------------------------------------------------------------------ internals


@contextmanager
def _named(what: str, timeout_s: float | None = None) -> Iterator[None]:
    """Turn a failed collective into one line that names the operation, this rank and the cause."""
    try:
        yield
    except DistributedError:
        raise
    except Exception as e:
        timeout = timeout_s if timeout_s is not None else (_info.timeout_s if _info else DEFAULT_TIMEOUT_S)
        where = f"rank {rank()} of {world_size()}"
        raise DistributedError(f"{what} failed on {where}: {_cause(e, timeout)}") from e


PEER_LOST_MARK = "(one of them hung or died)"  # lets the launcher tell consequences from root causes


_BACKEND_ERRORS = ("RuntimeError", "DistError", "DistBackendError", "DistNetworkError")  # what torch's raise
_WAITED = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout caused pair closure")


def waited_for_a_peer(message: str) -> bool:
    """Whether a worker's error (``"Type: text"``) says that it waited for another rank in vain: one of this
    module's collectives that lost or timed out on a peer, or the backend's own words inside a collective this
    module does not wrap (DDP's all-reduce): a peer that went away, or a wait that timed out (gloo says "Timed out
    waiting 10000ms for send operation to complete" or "Application timeout caused pair closure"; NCCL, where the
    error reaches Python, that the remote process exited: :func:`nccl_watch.peer_gone`)."""
    kind, _, text = message.partition(":")
    if kind == "DistributedError":
        return PEER_LOST_MARK in text
    return kind in _BACKEND_ERRORS and (any(w in text.lower() for w in _WAITED) or nccl_watch.peer_gone(text))


def silent_peers_error(e: BaseException) -> DistributedError | None:
    """For an error that only says this rank waited for a peer in vain: one line naming the ranks whose heartbeat
    stopped (stopped, hung, dead, or their machine gone), as seen now; None when the error is another kind, or
    every peer still shows signs of life (then the original error says more). Takes a few heartbeats to tell."""
    message = f"{type(e).__name__}: {e}"
    if not waited_for_a_peer(message):
        return None
    silent = heartbeat.silent_ranks()
    if not silent:
        return None
    who = f"rank {silent[0]}" if len(silent) == 1 else f"ranks {', '.join(map(str, silent))}"
    first = re.sub(r"^(\[[^\]]*\]:?\s*)+", "", str(e).strip().splitlines()[0] if str(e).strip() else "")[:160]
    return DistributedError(
        f"{who} stopped responding: no heartbeat for {3 * heartbeat.EVERY_S:g}s {PEER_LOST_MARK} [{first}]"
    )


def _cause(e: BaseException, timeout_s: float | None = None) -> str:
    text = str(e).strip()
    # gloo and c10d prefix messages with a source location or rank: "[/path/pair.cc:78] ...", "[Rank 0]: ..."
    first = re.sub(r"^(\[[^\]]*\]:?\s*)+", "", text.splitlines()[0] if text else type(e).__name__).lstrip(": ")[:200]
    low = text.lower()
    bound = f" within {timeout_s:g}s" if timeout_s is not None else ""
    missing = re.search(r"ranks? ([\d, ]+) failed to pass monitoredbarrier", low)
    if isinstance(e, Absent):
        return f"rank(s) {e} did not arrive{bound} {PEER_LOST_MARK}"
    if missing:
        return f"rank(s) {missing.group(1).strip()} did not arrive{bound} {PEER_LOST_MARK}"
    silent = re.search(r"waiting for send/recv from rank (\d+)", low)  # monitored barrier, seen from rank > 0
    if silent:
        return f"no answer from rank {silent.group(1)}{bound} {PEER_LOST_MARK}"
    if "timed out" in low or "timeout" in low:
        after = f" after {timeout_s:g}s" if timeout_s is not None else ""
        return f"timed out{after} waiting for the other ranks {PEER_LOST_MARK} [{first}]"
    if "connection closed" in low or "connection reset" in low or "broken pipe" in low:
        return f"lost the connection to another rank {PEER_LOST_MARK} [{first}]"
    return f"{type(e).__name__}: {first}"


def _store_args(world: World, timeout: timedelta) -> dict[str, Any]:
    """How ``init_process_group`` finds its peers.

    Under torch's elastic agent the workers share the agent's TCPStore, which outlives a restart; the
    keys of the failed attempt would still be there and a new rank could read a dead peer's address
    (pytorch/pytorch#135712). A prefix per attempt keeps every attempt's keys apart.

    Otherwise (srun, plain env://, detrain's c10d rounds) rank 0 hosts the store as env:// would, but listening
    only on MASTER_ADDR (see ``netif.listen_address``), where binding that address is possible here.

    Either way every value this group puts there is sealed with the run's secret (``world.secret``, which
    detrain's launcher hands its workers; :class:`detrain.distributed.launch.master_store.SealedStore`): the ranks'
    addresses, NCCL's unique id. srun's tasks on several nodes must be given one (``DETRAIN_RUN_SECRET``, which srun
    passes to every task: :func:`setup` says so first); under torchrun, or srun on one node, a group without one
    is not sealed.
    """
    addr, port, size = world.master_addr, int(world.master_port or 0), world.world_size
    if world.agent_store:
        client = tdist.TCPStore(addr, port, world_size=size, is_master=False, timeout=timeout)
        prefixed = tdist.PrefixStore(f"detrain/attempt_{world.restart_count}", client)
        return {"store": sealed(prefixed, world.secret), "rank": world.rank, "world_size": size}
    if world.rank == 0:
        try:
            ip = netif.listen_address(addr, world.whole_world_here)
        except DistributedError:  # does not resolve: the store below says so, and setup names the rank
            ip = None
        if ip is not None and netif.interface_of(ip) is None:  # e.g. a NAT or floating address: bind everything
            ip = None
        store = host_store(addr, port, bind=ip, timeout=timeout, world_size=size)
    else:
        store = tdist.TCPStore(addr, port, world_size=size, is_master=False, timeout=timeout)
    # the prefix env:// gives its store, so that keys stay where torch's own tools expect them
    return {
        "store": sealed(tdist.PrefixStore("default_pg", store), world.secret),
        "rank": world.rank,
        "world_size": size,
    }


def _keep_transport_on_master_interface(master_addr: str, whole_world_here: bool) -> None:
    """Point gloo (and NCCL on one machine) at the interface that reaches MASTER_ADDR, where the user (or
    ``socket_ifname``) has not chosen one; gloo would otherwise listen where the host name resolves."""
    try:
        chosen = netif.transport_env(master_addr, whole_world_here)
    except DistributedError:  # an address that does not resolve: init_process_group says so, with the rank
        return
    for key, value in chosen.items():
        os.environ.setdefault(key, value)


def _set_group_timeout(timeout_s: float) -> None:
    delta = timedelta(seconds=timeout_s)
    if hasattr(tdist, "set_timeout"):
        tdist.set_timeout(delta)
    else:  # torch < 2.7
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(delta)


@contextmanager
def _group_timeout(timeout_s: float) -> Iterator[None]:
    _set_group_timeout(timeout_s)
    try:
        yield
    finally:
        if _info is not None:
            _set_group_timeout(_info.timeout_s)
