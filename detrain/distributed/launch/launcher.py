"""Device strings -> a plan of workers -> torch's elastic launcher (or just a call, when one is enough).

``launch`` never writes a script and never manages processes itself: several workers on this node
(and several nodes) are started by ``torch.distributed.launcher.api.elastic_launch``, which brings
rendezvous, restarts (``max_restarts``), failure reports and signal handling. When the process is
already one rank of a world (torchrun, or ``srun`` with several tasks) it joins that world instead of
spawning again; a single device is a plain function call with no process group.

Devices are parsed in :mod:`detrain.distributed.launch.devices`, the pre-flight checks are in
:mod:`detrain.distributed.launch.checks` and failures are worded by :mod:`detrain.distributed.launch.failures`.
Every worker is handed its :class:`detrain.distributed.world.World` as ``entry(args, world)``: read from the
environment once (in a spawned worker: the agent's variables, at the top of its entry here; in this process: by the
caller), then completed with the worker's device, which the device plan gives for its local rank. The device never
travels through the environment; only the mark that detrain's launcher started a worker (DETRAIN_LAUNCHER) does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

from detrain.distributed import dist, heartbeat
from detrain.distributed.launch import netif, restart_policy, run_identity
from detrain.distributed.launch.checks import check_entry, parse_nnodes, rendezvous_settings, wait_reachable
from detrain.distributed.launch.devices import (
    DeviceKind,
    DevicePlan,
    cpu_threads_per_worker,
    parse_device,
    slurm_binds_gpus,
)
from detrain.distributed.launch.failures import describe_failure, explained, is_consequence, signal_stop
from detrain.distributed.launch.job_watch import ended_together
from detrain.distributed.launch.master_store import (
    SECRET_ENV,
    host_store,
    missing_secret,
    new_secret,
    rendezvous_backend,
    sealed,
)
from detrain.distributed.launch.nccl_watch import relayed_stderr
from detrain.distributed.launch.preempt_mark import MARK_ENV, MARK_SPARE_S, SIGNALS, read_mark, stop_path
from detrain.distributed.world import LAUNCHER_ENV, World
from detrain.errors import DistributedError, Preempted
from detrain.log import console

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

__all__ = ["DeviceKind", "DevicePlan", "launch", "parse_device", "parse_nnodes"]

T = TypeVar("T")

_HANDLED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1")
# what torch's agent handles itself under preemption: SIGTERM and SIGUSR1 go to _catch_preemption
_AGENT_SIGNALS_UNDER_GRACE = ",".join(s for s in _HANDLED_SIGNALS if s not in SIGNALS)
_CONSEQUENCE_GRACE_S = 3.0
_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


# long: the launcher's whole contract (every path, every key) is its docstring; the body is a dozen lines
def launch(
    entry: Callable[[dict[str, Any], World], T],
    args: dict[str, Any],
    plan: DevicePlan,
    *,
    nnodes: str | int | tuple[int, int] = "1",
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    max_restarts: int = 0,
    rdzv_backend: str | None = None,  # static or c10d (checked by rendezvous_settings)
    run_id: str = "detrain",
    run_args: dict[str, Any] | None = None,
    socket_ifname: str = "",
    monitor_interval: float = 0.2,
    start_timeout: float = 600.0,
    connect_timeout: float = 60.0,
    world: World | None = None,
    grace_s: float = 0.0,
    lost_after_s: float = 10.0,
) -> T | None:
    """Run ``entry(args, world)`` on every worker of ``plan`` (times ``nnodes``) and return rank 0's result;
    ``world`` is that worker's :class:`World`, its device the plan's for its local rank.

    * already a rank of a torchrun/srun world, or one device on one node: ``entry(args, world)`` is called in
      this process (the caller keeps working objects);
    * otherwise torch's ``elastic_launch`` starts ``plan.nprocs`` workers here (spawned, so ``entry``
      must be an importable top-level function and ``args`` picklable); rank 0's return value comes
      back to this process. On a node that does not host rank 0 (``node_rank > 0``) it returns None.

    ``nnodes`` is torchrun's spelling (``2``, ``"1:4"``) or the (MIN, MAX) pair already parsed from it; ``world``
    is this process's place as the caller read it (read here when not given); a spawned worker reads its own.

    ``master_port=0`` on one node picks a free port. Several nodes need the same ``master_addr``/``master_port``
    /``run_id`` on each and ``node_rank`` 0..N-1; ``nnodes="MIN:MAX"`` uses torch's c10d rendezvous (node_rank 0
    hosts it) for elastic membership: ranks follow node_rank, so rank 0 stays on node 0 (``rendezvous_address``),
    other nodes may leave and join, and losing node 0 ends every node with one line (``lost_master``). A node
    whose ``run_id`` is not the master's ends with one line naming both (``run_args``: the arguments a derived id
    came from, so that the line names those that differ).

    Every value in the rendezvous store is sealed with the run's secret (:mod:`master_store`): on one node one this
    launcher makes, with several ``world.secret`` (``DETRAIN_RUN_SECRET``), the same on every node; node 0 makes and
    prints one where none is given, and another node without it ends with one line. The workers get it in their
    environment. The rendezvous store listens only on ``master_addr`` (loopback for the default 127.0.0.1) and gloo
    on the interface that reaches it; ``socket_ifname`` names the interface(s) gloo and NCCL use instead (checked to
    exist here). Failures raise ``DistributedError`` with one line naming the rank and the cause; Ctrl-C stops every
    worker and raises ``KeyboardInterrupt``. ``grace_s`` > 0: SIGTERM or SIGUSR1 to this launcher or a worker ends
    the run as ``Preempted`` once every rank saved (:mod:`detrain.engine.train.state.preemption`). With several
    nodes each launcher ends when node 0's store has not answered for ``lost_after_s`` seconds (the run's
    ``dist_timeout``: a node waits for node 0 as long as a collective waits for a rank).

    Example:
        >>> from detrain.distributed.launch.launcher import launch, parse_device
        >>> launch(lambda args, world: (args["a"], world.device), {"a": 1}, parse_device("cpu"))  # a plain call
        (1, 'cpu')
    """
    lo, hi = nnodes if isinstance(nnodes, tuple) else parse_nnodes(nnodes)
    world = World.from_env() if world is None else world
    transport = netif.ifname_env(netif.check_ifname(socket_ifname)) if socket_ifname else {}
    if world.launched or (plan.nprocs == 1 and hi == 1):
        return _call_here(entry, args, plan, world, transport)
    rendezvous_settings(lo, hi, node_rank, master_addr, master_port, rdzv_backend)  # the arguments, before listening
    check_entry(entry)
    if max_restarts < 0:
        raise DistributedError(f"max_restarts={max_restarts} must be >= 0")
    secret = _run_secret(world, hi, node_rank)
    rdzv = _meet_nodes(
        (lo, hi),
        node_rank,
        master_addr,
        master_port,
        rdzv_backend,
        (run_id, run_args, secret),
        start_timeout,
        connect_timeout,
    )
    timing = _Timing(monitor_interval, start_timeout, grace_s, lost_after_s)  # grace_s > 0: SIGTERM / SIGUSR1 save
    return _launch_workers(entry, args, plan, rdzv, transport, run_id, max_restarts, timing)


def _run_secret(world: World, max_nodes: int, node_rank: int) -> str:
    """The secret that seals this launch's rendezvous store: on one node a new one (the workers get it from this
    launcher); on several the one given (``DETRAIN_RUN_SECRET``, read into ``world``), the same on every node. Node 0
    makes one where none is given and prints it, for the other nodes; another node without one ends here."""
    if max_nodes == 1:
        return new_secret()
    if world.secret:
        return world.secret
    if node_rank > 0:
        raise missing_secret(node_rank)
    secret = new_secret()
    console.print(f"run secret: start every other node with {SECRET_ENV}={secret} in its environment")
    return secret


@dataclass(frozen=True)
class _Timing:
    """How often the agent looks at its workers, how long nodes may take to meet, and the preemption grace (0:
    a SIGTERM just stops the workers; > 0: they save and end resumable, :mod:`preempt_mark`)."""

    monitor_interval: float
    start_timeout: float
    grace_s: float
    lost_after_s: float = 10.0  # node 0's store silent this long ends this node (job_watch)


@dataclass(frozen=True)
class _Rendezvous:
    """Where and how this node's launcher meets the others: torch's rendezvous settings for its agent, and on
    node 0 the store that serves them (held for the whole launch)."""

    nodes: tuple[int, int]  # (MIN, MAX) nodes
    node_rank: int
    master_addr: str
    master_port: int  # the store's port (picked here when 0 was asked for)
    backend: str  # static or c10d
    endpoint: str
    configs: dict[str, Any]
    local_addr: str | None  # the address this node's workers' store listens on (see rendezvous_address)
    store: torch.distributed.TCPStore | None = None  # node 0: the server torch's rendezvous uses (master_store.py)
    secret: str = dataclasses.field(default="", repr=False)  # seals every value in the store (master_store.py)


def _call_here(
    entry: Callable[[dict[str, Any], World], T],
    args: dict[str, Any],
    plan: DevicePlan,
    world: World,
    env: dict[str, str],
) -> T:
    """``entry(args, world)`` in this process: one rank of a world torchrun or srun started, or the one worker;
    ``world`` completed with its device."""
    try:
        with _environ(env):
            return entry(args, _worker_world(plan, world))
    finally:
        dist.cleanup()  # launch owns the group's lifetime, as it does in spawned workers


def _meet_nodes(
    nodes: tuple[int, int],
    node_rank: int,
    master_addr: str,
    master_port: int,
    rdzv_backend: str | None,
    identity: tuple[str, dict[str, Any] | None, str],
    start_timeout: float,
    connect_timeout: float,
) -> _Rendezvous:
    """Node 0 hosts the rendezvous store and the run's identity (and with a fixed node count waits for every node
    to come); another node waits until the store is reachable and joins with its run id. Then the settings torch's
    rendezvous gets, the same on every node. ``identity``: the run id, the arguments a derived id came from, and
    the secret that seals every value in the store."""
    lo, hi = nodes
    run_id, run_args, secret = identity
    where = netif.listen_address(master_addr, whole_world_here=hi == 1)
    store = None
    if node_rank == 0:
        # Held for the whole launch: torch's rendezvous asks for a multi-tenant server on this port and gets this
        # one, listening only on the master's address (see detrain.distributed.launch.master_store).
        store = host_store(master_addr, master_port, bind=where, timeout=timedelta(seconds=start_timeout))
        master_port, local_addr = store.port, where
        run_identity.host(sealed(store, secret), run_id, run_args)
        if lo == hi:
            where_ = f"{master_addr}:{master_port}"
            run_identity.wait_for_nodes(sealed(store, secret), run_id, run_args, hi - 1, start_timeout, where_)
    else:
        wait_reachable(master_addr, master_port, connect_timeout)
        run_identity.join(
            master_addr,
            master_port,
            run_id,
            node_rank,
            run_args,
            wait_go=lo == hi,
            connect_timeout_s=connect_timeout,
            start_timeout_s=start_timeout,
            secret=secret,
        )
        local_addr = netif.route_source(where) if where else None
    backend, endpoint, configs = rendezvous_settings(lo, hi, node_rank, master_addr, master_port, rdzv_backend)
    if backend == "c10d":
        local_addr = rendezvous_address(local_addr, node_rank, hi)
    return _Rendezvous(
        nodes, node_rank, master_addr, master_port, backend, endpoint, configs, local_addr, store, secret
    )


def _launch_workers(
    entry: Callable[[dict[str, Any], World], T],
    args: dict[str, Any],
    plan: DevicePlan,
    rdzv: _Rendezvous,
    transport: dict[str, str],
    run_id: str,
    max_restarts: int,
    timing: _Timing,
) -> T | None:
    """torch's elastic agent starts ``plan``'s workers on this node; rank 0's result, or a DistributedError of one
    line. The caller's signal handlers come back afterwards, and the agent's logs show only when they add to it.

    Preemption (``timing.grace_s`` > 0): SIGTERM or SIGUSR1 to this launcher reaches its workers as SIGUSR1
    (:func:`_catch_preemption`), and the agent waits ``grace_s`` + a spare before it kills them; a worker that
    saved on such a signal leaves a line in this launch's folder (:mod:`preempt_mark`), raised here as
    :class:`Preempted`."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    # elastic's per-attempt error files: in a folder that goes with the launch (read before), not torch's in /tmp
    log_dir = tempfile.TemporaryDirectory(prefix="detrain_elastic_")
    config = _launch_config(plan, rdzv, run_id, max_restarts, timing, log_dir.name)
    mark = os.path.join(log_dir.name, "preempted")
    threads = cpu_threads_per_worker(plan.nprocs)
    (lo, hi), node_rank, endpoint = rdzv.nodes, rdzv.node_rank, rdzv.endpoint
    env = _workers_environ(transport, rdzv.backend, mark if timing.grace_s > 0 else None, log_dir.name, rdzv.secret)
    with (
        log_dir,
        _restore_signal_handlers(),
        _environ(env),
        _held_elastic_logs() as held,
        ended_together(rdzv.master_addr, rdzv.master_port, node_rank, lo, hi, timing.lost_after_s, rdzv.secret),
        relayed_stderr(_nccl_workers(plan)) as watch,  # NCCL's watchdog ends a rank with a line there, and SIGABRT
    ):  # several nodes end as one
        if timing.grace_s > 0:
            _catch_preemption(mark)
            _start_resource_tracker_without_sigusr1()
        try:
            results = elastic_launch(config, _worker)(entry, args, plan, threads)
            _raise_if_preempted(mark)
            restart_policy.raise_if_stopped(results.values())  # every rank agreed to stop: no restart could help
        except ChildFailedError as e:
            _raise_if_preempted(mark)  # a worker slower than the grace period was killed after the save
            if explained(e):
                held.drop()  # the one line below is the whole story
            watch.settle()
            stopped = heartbeat.stopped_early(rdzv.store, max_restarts) if watch.findings else {}
            raise DistributedError(describe_failure(e, max_restarts, watch.findings, stopped)) from None
        except SignalException as e:
            _raise_if_preempted(mark)  # this launcher was signalled: its workers saved and returned
            raise signal_stop(e) from None
        except (RendezvousError, RuntimeError, ValueError, TimeoutError) as e:  # rendezvous / store failures
            cause = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            if node_rank > 0 and type(e).__name__ == "RendezvousConnectionError":
                # the store was there when this node joined (run_identity.join): its host, node 0, is gone
                raise DistributedError(lost_master(endpoint, node_rank, cause)) from None
            raise DistributedError(f"could not form the group at {endpoint} (node_rank={node_rank}): {cause}") from None
    result: T | None = results.get(0)
    return result


def _catch_preemption(mark: str) -> None:
    """SIGTERM / SIGUSR1 to this launcher (main thread): say so to the workers that will have saved and returned
    (:func:`preempt_mark.exit_when_launcher_stops`), then stop as torch's own handler does, but as if the signal
    were SIGUSR1: its agent passes that on to the workers and waits for them. A worker takes a SIGTERM of its own
    (the whole process group signalled) as a preemption only when this launcher's word is in that file, because
    the agent's own restarts stop the workers with SIGTERM too (:mod:`detrain.engine.train.state.preemption`).
    torch installs its handler only for the signals not
    taken out of ``TORCHELASTIC_SIGNALS_TO_HANDLE`` (:func:`_launch_config`, :func:`_workers_environ`)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def on_signal(signum: int, frame: object) -> None:
        with contextlib.suppress(OSError), open(stop_path(mark), "w") as f:
            f.write(signal.Signals(signum).name)  # what this launcher got, for the run's last line
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.SIGUSR1)

    if threading.current_thread() is threading.main_thread():
        for name in SIGNALS:
            signal.signal(getattr(signal, name), on_signal)


def _start_resource_tracker_without_sigusr1() -> None:
    """Start multiprocessing's resource tracker (which the spawned workers report their semaphores to) with SIGUSR1
    blocked: it ignores SIGINT and SIGTERM itself, but a SIGUSR1 to every process of the job (SLURM's
    ``--signal=USR1@90``) would kill it, and its successor prints a traceback for every name it never saw. A tracker
    already running is left as it is."""
    from multiprocessing import resource_tracker

    if not hasattr(signal, "pthread_sigmask"):
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        resource_tracker.ensure_running()  # the mask is inherited through fork and exec
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _raise_if_preempted(mark: str) -> None:
    note = read_mark(mark)
    if note is not None:
        raise Preempted(note) from None


def _nccl_workers(plan: DevicePlan) -> bool:
    """Whether the workers talk over NCCL, whose watchdog ends a rank on its own (see :mod:`nccl_watch`)."""
    return plan.kind == "cuda"


def _launch_config(
    plan: DevicePlan,
    rdzv: _Rendezvous,
    run_id: str,
    max_restarts: int,
    timing: _Timing,
    log_dir: str,
) -> LaunchConfig:
    """torch's description of this node's part: ``plan.nprocs`` spawned workers, the rendezvous, the restarts."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    # preemption: the agent waits grace + a spare for its workers (torch >= 2.6; 30 s before) and leaves SIGTERM
    # and SIGUSR1 to _catch_preemption (the field where torch has it, else the variable of _workers_environ)
    wait: dict[str, Any] = {}
    if timing.grace_s > 0:
        wait = {
            "shutdown_timeout": int(timing.grace_s + MARK_SPARE_S),
            "signals_to_handle": _AGENT_SIGNALS_UNDER_GRACE,
        }
    fields = {f.name for f in dataclasses.fields(LaunchConfig)}
    wait = {k: v for k, v in wait.items() if k in fields}
    return LaunchConfig(
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        min_nodes=rdzv.nodes[0],
        max_nodes=rdzv.nodes[1],
        nproc_per_node=plan.nprocs,
        run_id=run_id,
        local_addr=rdzv.local_addr,  # c10d: the workers' store listens there (MASTER_ADDR), not on the FQDN's address
        role="detrain",
        rdzv_backend=rendezvous_backend(rdzv.backend),  # torch's, with every value in the store sealed
        rdzv_endpoint=rdzv.endpoint,
        rdzv_configs=rdzv.configs,
        rdzv_timeout=int(timing.start_timeout),
        max_restarts=max_restarts,
        monitor_interval=timing.monitor_interval,
        start_method="spawn",  # fork would copy CUDA state and the caller's threads
        **wait,
    )


def _workers_environ(
    transport: dict[str, str],
    backend: str,
    mark: str | None = None,
    launch_dir: str | None = None,
    secret: str = "",
) -> dict[str, str]:
    """What the spawned workers inherit: the transport's interface, that detrain's launcher started them, the run's
    secret (which torch's rendezvous here reads too: :func:`master_store.rendezvous_backend`), (preemption on)
    where they leave their line, and where in ``launch_dir`` they note each attempt (:mod:`restart_policy`); the
    agent here also catches SIGUSR1, to pass it on."""
    # c10d: let every rendezvous round start a fresh store for the workers instead of sharing the agent's,
    # whose stale keys break restarts and membership changes (pytorch/pytorch#135712).
    env = {**transport, **({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if backend == "c10d" else {})}
    env[LAUNCHER_ENV] = "detrain"  # the workers inherit it: World.launcher tells them who started them
    if secret:
        env[SECRET_ENV] = secret  # World.secret in the workers
    if launch_dir is not None:  # the workers' notes of each attempt (restart_policy)
        env[restart_policy.ATTEMPTS_ENV] = os.path.join(launch_dir, "attempts")
        os.makedirs(env[restart_policy.ATTEMPTS_ENV], exist_ok=True)
    if mark is not None:
        env[MARK_ENV] = mark
        # read by the agent as it starts them: SIGTERM and SIGUSR1 stay with _catch_preemption's handler
        env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = _AGENT_SIGNALS_UNDER_GRACE
    return env


def rendezvous_address(local_addr: str | None, node_rank: int, max_nodes: int) -> str:
    """The address this node gives torch's c10d rendezvous, which numbers the nodes of every round (rank 0
    first) in the order of those addresses as text, and uses the address of the node it makes rank 0 alone (its
    workers' store listens there). Node 0 gives its own; every other node puts ``~`` and its node_rank before its
    own, which sorts after any address: ranks follow node_rank, and rank 0, which alone reads and writes the run
    folder, is always on node 0, the node that hosts the rendezvous, which the group cannot lose
    (:func:`lost_master`). A node that leaves then takes no checkpoint with it.

    Example:
        >>> rendezvous_address("10.0.0.9", 0, 4), rendezvous_address("10.0.0.12", 1, 4)
        ('10.0.0.9', '~1~10.0.0.12')
    """
    addr = local_addr or socket.getfqdn()
    if node_rank == 0:
        return addr
    return f"~{node_rank:0{len(str(max_nodes - 1))}d}~{addr}"


def lost_master(endpoint: str, node_rank: int, cause: str) -> str:
    """The one line of a node whose rendezvous went away mid-run: node 0's launcher hosts it (torch's c10d
    rendezvous keeps the membership in that one store), so losing node 0 ends the run on every node.

    Example:
        >>> lost_master("10.0.0.1:29500", 2, "The connection to the C10d store has failed.")[:54]
        'lost the rendezvous at 10.0.0.1:29500 (node_rank=2): n'
    """
    return (
        f"lost the rendezvous at {endpoint} (node_rank={node_rank}): node_rank=0, which hosts it, has stopped "
        f"or cannot be reached, and the group cannot go on without node 0 (other nodes may leave); start the "
        f"nodes again with resume= naming node 0's weights/last.pt, or, without node 0, the copy of it in this "
        f"node's run folder (save_replicas) [{cause}]"
    )


@record
def _worker(
    entry: Callable[[dict[str, Any], World], T], args: dict[str, Any], plan: DevicePlan, threads: int | None
) -> T:
    """What each spawned worker runs: its world read once from the agent's variables (after its thread count is set)
    and completed with its device, then ``entry(args, world)``; ``@record`` writes the exception to elastic's error
    file."""
    if threads is not None:
        # One core per worker on CPU: more threads only fight each other and the gloo comms.
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    world = World.from_env()
    try:
        return entry(args, _worker_world(plan, world))  # this worker's local rank picks its device
    except KeyboardInterrupt:
        raise SystemExit(130) from None  # the agent reports the stop; no traceback per worker
    except Exception as e:
        blamed = dist.silent_peers_error(e)  # a wait in vain: name the rank whose heartbeat stopped (a few seconds)
        consequence = blamed is not None or is_consequence(f"{type(e).__name__}: {e}")
        restart_policy.note_failure(world, e, consequence)  # the next attempt compares it (restart_policy)
        if consequence:
            # This rank only noticed that a peer is gone. The agent reports whichever worker it sees
            # exit first and stops the rest, so give the peer that failed on its own time to be seen.
            time.sleep(_CONSEQUENCE_GRACE_S)
        if blamed is not None:
            raise blamed from None
        raise
    finally:
        dist.cleanup()


def _worker_world(plan: DevicePlan, world: World) -> World:
    """``world`` with the worker's device: ``plan``'s for its local rank (under ``srun`` with per-task GPU binding,
    the task's own GPU). The number of processes on the node is checked against the listed GPUs where torch's agent
    gives it (SLURM's tasks per node may differ from node to node)."""
    local = world.local_rank if world.launched else 0
    local_world = world.local_world_size if world.launcher in ("detrain", "torchrun") else None
    own = world.launcher == "slurm" and plan.kind == "cuda" and slurm_binds_gpus(local, world.local_world_size)
    return world.on(plan.device_for(local, local_world, own_gpus=own))


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


class _HeldRecords(logging.Handler):
    """Torch elastic's log records (warnings and up), kept back while the launch runs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def drop(self) -> None:
        self.records.clear()


@contextlib.contextmanager
def _held_elastic_logs() -> Iterator[_HeldRecords]:
    """Hold back what the elastic agent logs until the outcome is known, then let it through, except where the
    failure is one of detrain's own errors: the agent logs each failed worker's full traceback, and above a
    one-line "dataset yaml not found" that is only noise. A crash or a restart still shows everything.

    Held: the agent's own loggers and torch.multiprocessing's, whose process context the agent uses to stop
    the other workers ("Terminating process ... via signal SIGTERM")."""
    logs = [logging.getLogger(name) for name in _ELASTIC_LOGGERS]
    held, propagate = _HeldRecords(), [log.propagate for log in logs]
    for log in logs:
        log.addHandler(held)
        log.propagate = False
    try:
        yield held
    finally:
        for log, was in zip(logs, propagate):
            log.removeHandler(held)
            log.propagate = was
        for kept in held.records:
            logging.getLogger(kept.name).handle(kept)


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
