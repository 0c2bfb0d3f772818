"""A fault matrix for distributed training on one machine: each "node" is its own ``detrain train`` launcher on
127.0.0.1 with its own working folder (its own copy of the dataset, its own ``project=runs``: nothing shared but
the network), a tiny model (scale n) and 64-pixel synthetic images, on CPU (gloo). Faults are real signals sent
from here when a node's run folder shows the moment (a results.csv row, weights/mid.pt) to processes found as
descendants of the launchers in /proc; nothing in detrain knows about them.

Cases (``--cases`` picks some, by letter or name):

a worker_kill      nnodes=2 max_restarts=1: SIGKILL of node 1's worker after epoch 1 (the fault-tolerance issue's
                   two-node command, with its keys only): both nodes finish every epoch, each epoch once in node 0's
                   results.csv, and node 1 holds only copies of node 0's checkpoints (save_replicas)
b node_leaves      nnodes=1:2 rdzv_backend=c10d max_restarts=1: SIGKILL of node 1's launcher and its workers at
                   once (a machine that dies) after epoch 1: node 0 goes on alone and finishes
c node_joins       nnodes=1:2 rdzv_backend=c10d: node 1 starts after node 0's first epoch: the group grows to two
                   workers, resumes from node 0's last.pt and finishes (node 0's worker is held with SIGSTOP while
                   node 1 starts, and let go once its agent asks it to stop for the new round, so a fast machine
                   cannot finish before the join)
d rank_stopped     nnodes=2: SIGSTOP of node 1's worker (rank 1) after epoch 1: every launcher ends with a last
                   line naming rank 1 within dist_timeout + 30 s, and no process of the run is left
e launcher_sigterm nnodes=2: SIGTERM of node 0's launcher after epoch 1: every process of both nodes gone within
                   10 s, each node's last line says so, weights/last.pt loads
f mid_epoch_kill   device=cpu,cpu max_restarts=1 save_interval: SIGKILL of rank 0 right after a weights/mid.pt
                   half-way through epoch 2 or later (rank 0 is held with SIGSTOP while mid.pt is read): the restart
                   resumes at the batch after mid.pt, each epoch once in results.csv
g busy_port        master_port held by another socket: one line naming the port before training, exit code 2
h no_master        node_rank=1 and nobody at master_addr:master_port: one line after the 60 s wait for the master,
                   before training, exit code 2
i preempted        nnodes=2: SIGTERM of node 0's launcher after epoch 1 under the default grace: every rank saves
                   mid.pt at one step, both launchers exit 75, and both started again with resume= finish from it
j net_blip         nnodes=2, each node in its own network namespace (scripts/_netns.py, root): the cable between
                   them cut for 20 s after epoch 1 (dist_timeout 45), then mended: both finish, no restart
k net_partition    nnodes=1:2 rdzv_backend=c10d max_restarts=1, own namespaces: the cable cut for good after epoch
                   1: node 0 resumes alone within dist_timeout + 60 s and finishes; node 1 ends with one line
l node0_lost       nnodes=2: SIGKILL of node 0's launcher and workers (its machine) after epoch 1: node 1 ends with
                   one line; started again alone with resume= its own copy of last.pt (save_replicas) it finishes
m nodes_differ     nnodes=2, node 1's dataset one image short: both refuse before training, one line, exit code 2
n repeated_failure nnodes=2 max_restarts=5, every attempt's first save fails (tests/_inject's I/O error): the
                   third attempt stops the run with 'the same failure repeated 2 times' instead of restarting on
o save_fails       nnodes=2, rank 0's write of epoch 2's last.pt fails (an injected I/O error): one line, epoch 1's
                   last.pt intact; last.pt then damaged on disk: resumed, both nodes fall back to last.prev.pt
p nan_steps        nnodes=2 nonfinite_limit=2, node 1's losses NaN from epoch 2 on (tests/_inject): both ranks skip
                   those updates and stop after two in a row with one line, exit 2; last.pt stays epoch 1's

Every case returns a :class:`Result` (a row of the printed table); the exit code is 1 when any case failed. Every
process a case started is killed when it ends, however it ends (Ctrl-C included): each node runs in its own session
and carries a tag in its environment that every descendant inherits.

Example::

    nice -n 19 python scripts/chaos.py                     # every case, full size (about 6 minutes on 2 cores)
    python scripts/chaos.py --cases a,f --small            # the sizes tests/integration/test_chaos.py uses
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a source checkout too
sys.path.insert(0, str(REPO / "scripts"))  # _netns, also when this file is loaded by the tests

import _netns  # noqa: E402 (scripts/_netns.py, beside this file)

from detrain.system.procfs import stat_fields, status_value  # noqa: E402

BLIP_S = 20.0  # case j: longer than the 10 s a node used to wait for node 0's store, shorter than its timeout
BLIP_TIMEOUT_S = 45.0  # case j's dist_timeout: the drop plus TCP's retransmission backoff (to 2x) fit in it
TAG_ENV = "CHAOS_TAG"  # in every process a case starts (inherited by all descendants): what cleanup looks for


# ------------------------------------------------------------------ sizes and results


@dataclass(frozen=True)
class Size:
    """How big each run is: the full matrix, or the smallest runs that still exercise each case (pytest)."""

    epochs: int = 10
    n_train: int = 32
    batch: int = 16
    dist_timeout: float = 30.0
    limit_s: float = 600.0  # a case that has not ended by then hangs: it fails and is killed
    issue_keys: bool = True  # case a runs the issue's command as written (validation, plots...), not the quick keys


FULL = Size()
SMALL = Size(epochs=3, n_train=16, batch=8, dist_timeout=10.0, limit_s=300.0, issue_keys=False)


@dataclass
class Result:
    """One row of the table."""

    case: str
    expected: str
    observed: str = ""
    ok: bool = False
    seconds: float = 0.0
    epochs: str = "-"  # the epoch column of node 0's results.csv: "1-10" when each epoch is there once, in order
    checkpoint: str = "-"  # whether node 0's weights/last.pt loads with detrain's safe loader
    problems: list[str] = field(default_factory=list)
    skipped: bool = False  # the machine cannot make the case (network namespaces need root)

    def check(self, condition: bool, problem: str) -> None:
        if not condition:
            self.problems.append(problem)


# ------------------------------------------------------------------ processes, through /proc


def _stat(pid: int) -> list[str] | None:
    return stat_fields(pid)


def alive(pid: int) -> bool:
    """Running or stopped; not a zombie, not gone."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X", "x")


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and fields[1] == str(pid) and fields[0] not in ("Z", "X", "x"):
                found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def _started(pid: int) -> tuple[int, int]:
    fields = _stat(pid)
    return (int(fields[19]) if fields and len(fields) > 19 else 0, pid)  # field 22: start time in clock ticks


def workers_of(launcher: int) -> list[int]:
    """The training workers a launcher's elastic agent spawned (multiprocessing's ``spawn_main``; not its resource
    tracker), in the order they started: local rank 0 first."""
    found = []
    for pid in children(launcher):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return sorted(found, key=_started)


def tagged(tag: str) -> list[int]:
    """Live processes whose environment carries ``CHAOS_TAG=tag``: every process of one case."""
    needle = f"{TAG_ENV}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0") and alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def pending(pid: int, sig: signal.Signals) -> bool:
    """``sig`` waits for delivery to ``pid`` (e.g. a SIGTERM sent to a stopped process)."""
    mask = 0
    for key in ("SigPnd", "ShdPnd"):
        value = status_value(pid, key)
        with contextlib.suppress(TypeError, ValueError):
            mask |= int(value, 16)  # type: ignore[arg-type]
    return bool(mask & (1 << (int(sig) - 1)))


def send(pids: list[int] | int, sig: signal.Signals) -> None:
    for pid in [pids] if isinstance(pids, int) else pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_until(what: Callable[[], object], limit_s: float, step_s: float = 0.05) -> object:
    """``what()`` once it is truthy, else None after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while True:
        value = what()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(step_s)


# ------------------------------------------------------------------ nodes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_DATA_LOCK = threading.Lock()  # cases run in threads (tests/integration/test_chaos.py): one writes the set


def make_data(root: Path, n_train: int) -> Path:
    """The synthetic shapes set (64 px), written once per size under ``root``: whole, before any case copies it (a
    case that copied a set another thread was still writing gave its nodes different datasets, which they now
    refuse at start)."""
    from detrain.data.synthetic import generate_shapes

    folder = root / f"shapes{n_train}"
    with _DATA_LOCK:
        if not (folder / "data.yaml").is_file():
            generate_shapes(folder, n_train=n_train, n_val=2, imgsz=64, seed=0)
    return folder


RUN_SECRET = secrets.token_hex(16)  # the secret of every run this script starts (DETRAIN_RUN_SECRET)


def child_env(tag: str) -> dict[str, str]:
    """This checkout's detrain, one thread per process, outside any launcher or SLURM job, tagged, with the runs'
    secret."""
    drop = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_RUN_ID",
        "TEST_FAULT",
    )
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env[TAG_ENV] = tag
    env["DETRAIN_RUN_SECRET"] = RUN_SECRET  # every node of a case is given the run's secret, as a user would
    return env


class Node:
    """One ``detrain train`` launcher in its own folder (``home``) and session, output in ``home/out.txt``."""

    def __init__(
        self, home: Path, args: dict[str, object], env: dict[str, str], log: str = "out.txt", prefix: list[str] = ()
    ) -> None:
        self.home = home
        self.args = args
        self.log = log
        home.mkdir(parents=True, exist_ok=True)
        # prefix: ``ip netns exec NS`` for a node on its own network (it execs, so the pid is the launcher's)
        cmd = [*prefix, sys.executable, "-m", "detrain.cli", "train", *(f"{k}={v}" for k, v in args.items())]
        with open(home / log, "w") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                cmd, cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.pid = self.proc.pid

    @property
    def run(self) -> Path:
        return self.home / "runs" / "x"

    def out(self) -> str:
        try:
            return (self.home / self.log).read_text(errors="replace")
        except OSError:
            return ""

    def last_line(self) -> str:
        lines = [x for x in self.out().splitlines() if x.strip()]
        return lines[-1] if lines else ""

    def rows(self) -> list[str]:
        return results_epochs(self.run)

    def workers(self) -> list[int]:
        return workers_of(self.pid)

    def ended(self) -> bool:
        return self.proc.poll() is not None


def results_epochs(run: Path) -> list[str]:
    try:
        with open(run / "results.csv") as f:
            return [r["epoch"].strip() for r in csv.DictReader(f)]
    except (OSError, KeyError):
        return []


def epochs_text(epochs: list[str]) -> str:
    if not epochs:
        return "-"
    if epochs == [str(e) for e in range(1, len(epochs) + 1)]:
        return f"1-{len(epochs)}" if len(epochs) > 1 else "1"
    return ",".join(epochs)


def checkpoint_text(path: Path) -> tuple[bool, str, dict | None]:
    """Whether ``path`` loads with detrain's safe loader (:func:`detrain.weights.checkpoint.load_checkpoint`)."""
    from detrain.errors import CheckpointError
    from detrain.weights.checkpoint import load_checkpoint

    if not path.exists():
        return False, "none", None
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as e:
        return False, f"fails: {str(e)[:80]}", None
    return True, f"loads (epoch {int(ckpt['epoch']) + 1})", ckpt


class Cluster:
    """The nodes of one case; on exit every process carrying the case's tag is killed (SIGKILL works on stopped
    processes too), whatever happened."""

    def __init__(self, work: Path, size: Size, name: str) -> None:
        self.work = work / name
        if self.work.exists():
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True)
        self.size = size
        self.tag = f"{name}-{uuid.uuid4().hex[:12]}"
        self.data = make_data(work, size.n_train)
        self.nodes: list[Node] = []
        self.port = free_port()

    def common(self, issue: bool = False, **extra: object) -> dict[str, object]:
        """Every node's arguments: the fault-tolerance issue's two-node command (``issue``: its keys only, with the
        dataset and this size's epochs, batch and dist_timeout), else that with validation, plots, warmup and mosaic
        closing off (faster; what the case checks does not depend on them)."""
        s = self.size
        quick = {} if issue else {"warmup_epochs": 0, "close_mosaic": 0, "val": False, "plots": False, "seed": 0}
        return {
            "data": "data/data.yaml",
            "imgsz": 64,
            "batch": s.batch,
            "epochs": s.epochs,
            "workers": 0,
            "device": "cpu",
            **quick,
            "dist_timeout": s.dist_timeout,
            "master_addr": "127.0.0.1",
            "master_port": self.port,
            "project": "runs",
            "name": "x",
            "exist_ok": True,
            **extra,
        }

    def start(
        self,
        index: int,
        args: dict[str, object],
        prefix: list[str] = (),
        alter: Callable[[Path], None] | None = None,
        env: dict[str, str] | None = None,
    ) -> Node:
        """Node ``index`` in ``work/<case>/node<index>``, with its own copy of the dataset (``prefix``: the command
        that puts it on its own network; ``alter``: a change to that copy before it starts; ``env``: variables
        added to its environment, e.g. tests/_inject's fault rule)."""
        home = self.work / f"node{index}"
        shutil.copytree(self.data, home / "data")
        if alter is not None:
            alter(home / "data")
        node = Node(home, args, {**child_env(self.tag), **(env or {})}, prefix=prefix)
        self.nodes.append(node)
        return node

    def restart(self, index: int, args: dict[str, object]) -> Node:
        """Node ``index`` started again in its own folder (its dataset and run folder as they are)."""
        node = Node(self.work / f"node{index}", args, child_env(self.tag), log="out-again.txt")
        self.nodes.append(node)
        return node

    def wait_all(self, limit_s: float) -> bool:
        """Every node's launcher ended within ``limit_s``."""
        return bool(wait_until(lambda: all(n.ended() for n in self.nodes), limit_s, 0.2))

    def leftovers(self, grace_s: float = 10.0) -> list[int]:
        """Processes of the case still alive ``grace_s`` after the launchers ended (the OS may still be reaping)."""
        wait_until(lambda: not tagged(self.tag), grace_s, 0.2)
        return tagged(self.tag)

    def kill_all(self) -> None:
        for _ in range(3):
            pids = tagged(self.tag) + [n.pid for n in self.nodes if not n.ended()]
            if not pids:
                break
            send(pids, signal.SIGKILL)
            time.sleep(0.2)
        for node in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=5)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()


def _describe(node: Node, tail: int = 1) -> str:
    code = node.proc.poll()
    lines = [x.strip() for x in node.out().splitlines() if x.strip()][-tail:]
    return f"exit {code}: {' | '.join(lines)[:300]}" if lines else f"exit {code}"


def _wait_saved(node: Node, limit_s: float, others: list[Node] = ()) -> bool:
    """Node's first epoch is saved (weights/last.pt is written whole, after the epoch's results.csv row), before
    any node of the case ended."""
    last = node.run / "weights" / "last.pt"
    return bool(
        wait_until(lambda: last.exists() or node.ended() or any(o.ended() for o in others), limit_s) and last.exists()
    )


def _two_nodes_past_epoch_1(c: Cluster, args: dict[str, object], result: Result) -> tuple[Node, Node]:
    """Nodes 0 and 1 started with ``args``, once node 0's first epoch is saved (else a problem in ``result``)."""
    n0, n1 = c.start(0, {**args, "node_rank": 0}), c.start(1, {**args, "node_rank": 1})
    if not _wait_saved(n0, c.size.limit_s, [n1]):
        result.problems.append(f"no epoch 1: node 0 {_describe(n0, 3)}; node 1 {_describe(n1)}")
    return n0, n1


def _finish(result: Result, cluster: Cluster, main: Node, t0: float, epochs: int | None) -> Result:
    """Common checks of a run that must finish: every launcher exit 0, each epoch once, last.pt loads."""
    rows = main.rows()
    result.epochs = epochs_text(rows)
    loads, text, ckpt = checkpoint_text(main.run / "weights" / "last.pt")
    result.checkpoint = text
    if epochs is not None:
        for i, node in enumerate(cluster.nodes):
            result.check(node.proc.poll() == 0, f"node {i} {_describe(node, 3)}")
        result.check(rows == [str(e) for e in range(1, epochs + 1)], f"results.csv epochs {rows}")
        result.check(loads and ckpt is not None and int(ckpt["epoch"]) == epochs - 1, f"last.pt {text}")
        # the other nodes hold copies of node 0's run folder (save_replicas=2: the next node's disk), nothing else:
        # its checkpoints, and after each epoch best.pt and epochN.pt with the record (engine/train/state/replicas.py)
        copies = ("last.pt", "last.prev.pt", "mid.pt", "best.pt")
        final = (main.run / "weights" / "last.pt").read_bytes() if loads else None
        held = []
        for i, node in enumerate(cluster.nodes[1:], 1):
            found = list(node.home.rglob("*.pt"))
            stray = sorted(
                str(p.relative_to(node.home))
                for p in found
                if p.name not in copies and not re.fullmatch(r"epoch[0-9]+\.pt", p.name)
            )
            result.check(not stray, f"node {i} holds checkpoints {stray}")
            held += [p.read_bytes() == final for p in found if p.name == "last.pt"]
        if len(cluster.nodes) > 1:
            result.check(any(held), "no other node holds a copy of the final last.pt")

    result.seconds = time.monotonic() - t0
    return result


def _close(result: Result, observed: str) -> Result:
    result.ok = not result.problems
    result.observed = observed if result.ok else "; ".join(result.problems)[:600]
    return result


# ------------------------------------------------------------------ the cases


def case_worker_kill(work: Path, size: Size = FULL) -> Result:
    """(a) SIGKILL of node 1's worker after epoch 1, nnodes=2 max_restarts=1: both nodes resume and finish."""
    result = Result(
        "a worker_kill",
        f"both nodes exit 0; node 0 resumes ('restart 1'); epochs 1-{size.epochs} once; node 1 holds only copies",
    )
    t0 = time.monotonic()
    with Cluster(work, size, "worker_kill") as c:
        args = c.common(issue=size.issue_keys, nnodes=2, max_restarts=1)
        n0, n1 = _two_nodes_past_epoch_1(c, args, result)
        if result.problems:
            return _close(_finish(result, c, n0, t0, None), "")
        victims = n1.workers()
        result.check(len(victims) == 1, f"node 1 workers {victims}")
        send(victims, signal.SIGKILL)
        result.check(c.wait_all(size.limit_s), "the nodes did not end")
        _finish(result, c, n0, t0, size.epochs)
        resumed = re.search(r"restart 1: resuming from \S+last\.pt at epoch (\d+)", n0.out())
        result.check(resumed is not None, "node 0 did not say 'restart 1: resuming from ...last.pt'")
        return _close(
            result, f"killed node 1's worker after epoch 1; {resumed.group(0) if resumed else ''}; both exit 0"
        )


def case_node_leaves(work: Path, size: Size = FULL) -> Result:
    """(b) SIGKILL of node 1's launcher and workers under nnodes=1:2 c10d: node 0 continues alone and finishes."""
    result = Result("b node_leaves", f"node 0 goes on with 1 worker and exits 0; epochs 1-{size.epochs} once")
    t0 = time.monotonic()
    with Cluster(work, size, "node_leaves") as c:
        args = c.common(nnodes="1:2", rdzv_backend="c10d", max_restarts=1)
        n0, n1 = _two_nodes_past_epoch_1(c, args, result)
        if result.problems:
            return _close(_finish(result, c, n0, t0, None), "")
        two = "2 worker(s)" in n0.out()
        result.check(two, "node 1 was not in the group before it was killed")
        machine = [n1.pid, *descendants(n1.pid)]
        send(machine, signal.SIGKILL)  # the whole machine at once
        result.check(bool(wait_until(n0.ended, size.limit_s, 0.2)), "node 0 did not end")
        _finish(result, c, n0, t0, None)
        rows = n0.rows()
        result.check(n0.proc.poll() == 0, f"node 0 {_describe(n0, 3)}")
        result.check(rows == [str(e) for e in range(1, size.epochs + 1)], f"results.csv epochs {rows}")
        loads, text, ckpt = checkpoint_text(n0.run / "weights" / "last.pt")
        result.check(loads and ckpt is not None and int(ckpt["epoch"]) == size.epochs - 1, f"last.pt {text}")
        result.check(
            "1 worker(s) on cpu" in n0.out().split("2 worker(s) on cpu", 1)[-1], "node 0 did not go on with 1 worker"
        )
        after = n0.out().split("2 worker(s) on cpu", 1)[-1]  # what node 0 said once node 1 was gone
        resumed = re.search(r"(restart \d+|group restarted): resuming from \S+ at epoch (\d+)", after)
        result.check(
            resumed is not None and 2 <= int(resumed.group(2)) <= size.epochs,
            "node 0 did not resume from its checkpoint after node 1 left (a restart from scratch says no "
            f"'resuming from ... at epoch 2' or later): {resumed.group(0) if resumed else 'no resume line'}",
        )
        return _close(
            result,
            f"node 1 SIGKILLed (launcher + worker); node 0: "
            f"{resumed.group(0) if resumed else 'no resume line'}; exit 0",
        )


def case_node_joins(work: Path, size: Size = FULL) -> Result:
    """(c) node 1 starts after node 0's first epoch under nnodes=1:2 c10d: the group grows and finishes."""
    result = Result(
        "c node_joins",
        "the group grows to 2 workers, resumes from last.pt ('group restarted'); both "
        f"exit 0; epochs 1-{size.epochs} once",
    )
    t0 = time.monotonic()
    with Cluster(work, size, "node_joins") as c:
        args = c.common(nnodes="1:2", rdzv_backend="c10d")
        n0 = c.start(0, {**args, "node_rank": 0})
        if not _wait_saved(n0, size.limit_s):
            result.problems.append(f"no epoch 1: node 0 {_describe(n0, 3)}")
            return _close(_finish(result, c, n0, t0, None), "")
        held = n0.workers()
        result.check(len(held) == 1, f"node 0 workers {held}: none to hold while node 1 starts")
        send(held, signal.SIGSTOP)  # hold node 0's training while node 1 starts (released below)
        n1 = c.start(1, {**args, "node_rank": 1})
        # node 0's agent sees node 1 waiting and stops its worker (SIGTERM, pending while it is stopped)
        asked = wait_until(
            lambda: all(pending(p, signal.SIGTERM) or not alive(p) for p in held) or n1.ended(), size.limit_s
        )
        send(held, signal.SIGCONT)
        result.check(bool(asked) and not n1.ended(), f"node 0's agent did not restart for node 1: {_describe(n1)}")
        result.check(c.wait_all(size.limit_s), "the nodes did not end")
        _finish(result, c, n0, t0, size.epochs)
        resumed = re.search(r"group restarted: resuming from \S+last\.pt at epoch (\d+)", n0.out())
        result.check(
            resumed is not None and int(resumed.group(1)) >= 2,
            "node 0 did not say 'group restarted: resuming from ...last.pt at epoch 2' or later",
        )
        result.check(n0.out().count("2 worker(s) on cpu") >= 1, "node 0 never trained with 2 workers")
        return _close(
            result, f"node 1 joined after epoch 1; {resumed.group(0) if resumed else ''}; 2 workers; both exit 0"
        )


def case_rank_stopped(work: Path, size: Size = FULL) -> Result:
    """(d) SIGSTOP of rank 1 (node 1's worker) after epoch 1: every launcher ends naming rank 1, no orphans."""
    bound = size.dist_timeout + 30
    result = Result(
        "d rank_stopped",
        f"every launcher ends, its last line naming rank 1, within dist_timeout + 30 s "
        f"({bound:g} s) of the stop; no process left",
    )
    t0 = time.monotonic()
    with Cluster(work, size, "rank_stopped") as c:
        args = c.common(nnodes=2)
        n0, n1 = _two_nodes_past_epoch_1(c, args, result)
        if result.problems:
            return _close(_finish(result, c, n0, t0, None), "")
        stopped = n1.workers()
        result.check(len(stopped) == 1, f"node 1 workers {stopped}")
        send(stopped, signal.SIGSTOP)
        t_stop = time.monotonic()
        ends: list[float | None] = [None, None]
        while time.monotonic() - t_stop < bound + 30 and not all(n.ended() for n in c.nodes):
            for i, n in enumerate(c.nodes):
                if ends[i] is None and n.ended():
                    ends[i] = time.monotonic() - t_stop
            time.sleep(0.1)
        for i, n in enumerate(c.nodes):
            if ends[i] is None and n.ended():
                ends[i] = time.monotonic() - t_stop
        left = c.leftovers()
        _finish(result, c, n0, t0, None)
        for i, n in enumerate(c.nodes):
            line = n.last_line()
            result.check(
                ends[i] is not None and ends[i] <= bound,
                f"node {i} {'still running' if ends[i] is None else f'ended after {ends[i]:.0f} s'}",
            )
            result.check(n.proc.poll() not in (0, None), f"node {i} exit {n.proc.poll()}")
            result.check(bool(re.search(r"\brank 1\b", line)), f"node {i} last line: {line[:200]!r}")
        result.check(not left, f"processes left: {left}")
        said = "; ".join(
            f"node {i} after {e:.0f} s: '{c.nodes[i].last_line()[:200]}'" for i, e in enumerate(ends) if e is not None
        )
        return _close(result, f"{said}; no process left")


def case_launcher_sigterm(work: Path, size: Size = FULL) -> Result:
    """(e) SIGTERM of node 0's launcher (nnodes=2, grace=0: no preemption save) after epoch 1: every process of
    both nodes gone within 10 s, each node's last line says why, last.pt loads."""
    result = Result(
        "e launcher_sigterm",
        "grace=0: every process of both nodes gone within 10 s; each ends with one line ('stopped by SIGTERM'); "
        "last.pt loads",
    )
    t0 = time.monotonic()
    with Cluster(work, size, "launcher_sigterm") as c:
        args = c.common(nnodes=2, grace=0)
        n0, _n1 = _two_nodes_past_epoch_1(c, args, result)
        if result.problems:
            return _close(_finish(result, c, n0, t0, None), "")
        send(n0.pid, signal.SIGTERM)
        t_term = time.monotonic()
        gone = wait_until(lambda: not tagged(c.tag), 10.0, 0.1)
        took = time.monotonic() - t_term
        left = tagged(c.tag)
        c.wait_all(5.0)
        _finish(result, c, n0, t0, None)
        result.check(bool(gone), f"left after 10 s: {left}")
        for i, n in enumerate(c.nodes):
            result.check(n.proc.poll() == 2, f"node {i} {_describe(n)}")
            result.check("stopped by SIGTERM" in n.last_line(), f"node {i} last line: {n.last_line()[:200]!r}")
        loads, text, _ = checkpoint_text(n0.run / "weights" / "last.pt")
        result.check(loads, f"last.pt {text}")
        return _close(result, f"all gone after {took:.1f} s; " + " / ".join(_describe(n) for n in c.nodes))


def case_preempted(work: Path, size: Size = FULL) -> Result:
    """(i) SIGTERM of node 0's launcher (nnodes=2, the default grace) after epoch 1: node 0's workers get it, every
    rank of both nodes saves mid.pt at one step (last.pt when that step ends an epoch), both launchers exit 75
    within the grace; both nodes started again with resume= naming node 0's checkpoint finish, each epoch once."""
    grace = 25.0
    result = Result(
        "i preempted",
        f"both nodes exit 75 ('preempted by SIGTERM: saved ...mid.pt') within grace ({grace:g} s); the same "
        f"command with resume=mid.pt resumes at its batch on both nodes; epochs 1-{size.epochs} once",
    )
    t0 = time.monotonic()
    with Cluster(work, size, "preempted") as c:
        args = c.common(nnodes=2, grace=grace)
        n0, _n1 = _two_nodes_past_epoch_1(c, args, result)
        if result.problems:
            return _close(_finish(result, c, n0, t0, None), "")
        send(n0.pid, signal.SIGTERM)
        t_term = time.monotonic()
        ended = wait_until(lambda: all(n.ended() for n in c.nodes), grace + 10, 0.1)
        took = time.monotonic() - t_term
        result.check(bool(ended) and took <= grace, f"the nodes ended after {took:.1f} s (grace {grace:g} s)")
        said = [n.last_line() for n in c.nodes]
        for i, n in enumerate(c.nodes):
            result.check(n.proc.poll() == 75, f"node {i} {_describe(n)}")
            result.check(said[i].startswith("preempted by SIGTERM: saved "), f"node {i} last line: {said[i][:200]!r}")
        # mid.pt at the step every rank agreed on; last.pt when that step was an epoch's last (a loaded machine
        # can hold the signal back that long), as the line names it
        at = re.search(r"saved \S*/(mid|last)\.pt at (epoch \d+(?:, \d+/\d+ batches done)?);", said[0])
        mid = n0.run / "weights" / f"{at.group(1) if at else 'mid'}.pt"
        loads, text, ckpt = checkpoint_text(mid)
        partway = at is not None and at.group(1) == "mid"
        result.check(loads and ckpt is not None and ("mid_epoch" in ckpt) == partway, f"{mid.name} {text}")
        if result.problems:
            return _close(_finish(result, c, n0, t0, None), "")
        c.wait_all(5.0)
        c.nodes.clear()  # the same command again on both nodes, resuming from node 0's mid.pt
        args = {**args, "resume": str(mid.relative_to(n0.home)), "master_port": free_port()}
        again = [c.restart(0, {**args, "node_rank": 0}), c.restart(1, {**args, "node_rank": 1})]
        result.check(c.wait_all(size.limit_s), "the resumed nodes did not end")
        _finish(result, c, again[0], t0, size.epochs)
        where = at.group(2) if at else "?"
        resumed = f"resuming from {mid.relative_to(n0.home)} at {where}" in again[0].out()
        result.check(resumed, f"node 0 did not resume at {where}: {_describe(again[0], 3)}")
        return _close(
            result,
            f"both nodes exit 75 {took:.1f} s after the SIGTERM, saved {mid.name} at {where}; resumed there on both "
            "nodes; both exit 0",
        )


def case_mid_epoch_kill(work: Path, size: Size = FULL) -> Result:
    """(f) SIGKILL of rank 0 right after a mid.pt half-way through epoch 2 or later (save_interval; half this size's
    batch, for more steps per epoch), device=cpu,cpu max_restarts=1: the restart resumes at the batch after mid.pt;
    each epoch once."""
    result = Result(
        "f mid_epoch_kill",
        f"the restart resumes from mid.pt at its batch; exit 0; epochs 1-{size.epochs} once; no mid.pt left",
    )
    t0 = time.monotonic()
    with Cluster(work, size, "mid_epoch_kill") as c:
        n0 = c.start(
            0, c.common(device="cpu,cpu", max_restarts=1, batch=max(2, size.batch // 2), save_interval=1e-9)
        )  # mid.pt after every step
        mid, last = n0.run / "weights" / "mid.pt", n0.run / "weights" / "last.pt"
        if not _wait_saved(n0, size.limit_s):
            result.problems.append(f"no epoch 1: {_describe(n0, 3)}")
            return _close(_finish(result, c, n0, t0, None), "")
        where, seen = None, None
        deadline = time.monotonic() + size.limit_s
        while where is None and time.monotonic() < deadline and not n0.ended():
            if _identity(mid) in (None, seen):  # no mid.pt, or the one already looked at
                time.sleep(0.005)
                continue
            rank0 = n0.workers()[:1]
            send(rank0, signal.SIGSTOP)  # only rank 0 writes: mid.pt and last.pt stand still now
            seen = _identity(mid)
            _, _, m = checkpoint_text(mid)
            _, _, done = checkpoint_text(last)
            # a mid.pt of the epoch after last.pt's (not one the epoch's last.pt already superseded), half-way
            if (
                m is not None
                and done is not None
                and int(m["epoch"]) == int(done["epoch"])
                and int(m["mid_epoch"]["next_batch"]) >= max(1, int(m["batches_per_epoch"]) // 2)
            ):
                where = (int(m["epoch"]) + 2, int(m["mid_epoch"]["next_batch"]), int(m["batches_per_epoch"]))
                send(rank0, signal.SIGKILL)
            else:
                send(rank0, signal.SIGCONT)
        result.check(where is not None, "no mid.pt within an epoch to kill at")
        result.check(c.wait_all(size.limit_s), "the launcher did not end")
        _finish(result, c, n0, t0, size.epochs)
        if where is not None:
            epoch, batch, nb = where
            line = (
                f"restart 1: resuming from {Path('runs/x/weights/mid.pt')} at epoch {epoch}, {batch}/{nb} batches done"
            )
            result.check(
                line in n0.out() or line.replace("runs/x", str(n0.run)) in n0.out(), f"no '{line}' in the output"
            )
        result.check(not mid.exists(), "mid.pt left after the run")
        return _close(
            result,
            f"killed rank 0 after mid.pt at epoch {where[0]}, batch {where[1]}/{where[2]}; resumed there; exit 0"
            if where
            else "",
        )


def _identity(path: Path) -> tuple[int, int] | None:
    """(inode, modification time) of a file: a new one replaced atomically has another."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def case_busy_port(work: Path, size: Size = FULL) -> Result:
    """(g) master_port held by another socket: one line before training, exit code 2."""
    result = Result("g busy_port", "exit 2; one line 'master_port=P is already in use'; no run folder")
    t0 = time.monotonic()
    with Cluster(work, size, "busy_port") as c, socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        n0 = c.start(0, c.common(nnodes=2, node_rank=0, master_port=port))
        result.check(bool(wait_until(n0.ended, size.limit_s, 0.1)), "the launcher did not end")
        _finish(result, c, n0, t0, None)
        lines = [x for x in n0.out().splitlines() if x.strip()]
        result.check(n0.proc.poll() == 2, f"exit {n0.proc.poll()}")
        line = f"error: master_port={port} is already in use on this machine; choose another port or stop what holds it"
        result.check(lines == [line], f"output {lines[-5:]}")
        result.check(not (n0.home / "runs").exists(), "a run folder was made")
        return _close(result, f"{_describe(n0)}")


def case_no_master(work: Path, size: Size = FULL) -> Result:
    """(h) node_rank=1 with nobody at master_addr:master_port: one line before training, exit code 2."""
    result = Result(
        "h no_master", "exit 2; one line 'cannot reach the master at 127.0.0.1:P within 60s'; no run folder"
    )
    t0 = time.monotonic()
    with Cluster(work, size, "no_master") as c:
        n1 = c.start(1, c.common(nnodes=2, node_rank=1))
        result.check(bool(wait_until(n1.ended, size.limit_s, 0.2)), "the launcher did not end")
        _finish(result, c, n1, t0, None)
        lines = [x for x in n1.out().splitlines() if x.strip()]
        result.check(n1.proc.poll() == 2, f"exit {n1.proc.poll()}")
        result.check(
            len(lines) == 1 and lines[0].startswith(f"error: cannot reach the master at 127.0.0.1:{c.port} within 60s"),
            f"output {lines[-5:]}",
        )
        result.check(not (n1.home / "runs").exists(), "a run folder was made")
        return _close(result, f"{_describe(n1)[:150]}")


def _on_two_networks(c: Cluster, args: dict[str, object], result: Result, net) -> tuple[Node, Node]:
    """Nodes 0 and 1 each in its own network namespace of ``net`` (a :class:`_netns.Pair`), node 0's address the
    master, started with ``args`` once node 0's first epoch is saved (else a problem in ``result``)."""
    args = {**args, "master_addr": net.addrs[0]}
    n0 = c.start(0, {**args, "node_rank": 0}, net.exec_prefix(0))
    n1 = c.start(1, {**args, "node_rank": 1}, net.exec_prefix(1))
    if not _wait_saved(n0, c.size.limit_s, [n1]):
        result.problems.append(f"no epoch 1: node 0 {_describe(n0, 3)}; node 1 {_describe(n1)}")
    return n0, n1


def _no_netns(name: str, expected: str) -> Result | None:
    why = _netns.available()
    if why is None:
        return None
    result = Result(name, expected, f"skipped: {why}", ok=True)
    result.skipped = True
    return result


def case_net_blip(work: Path, size: Size = FULL) -> Result:
    """(j) nnodes=2, each node in its own network namespace: the cable between them is cut after epoch 1 for
    ``BLIP_S`` seconds (no RST, no ICMP: packets just stop), then mended. The drop is shorter than dist_timeout
    (``BLIP_TIMEOUT_S`` here), so nobody gives up: both nodes finish with no restart, each epoch once."""
    expected = (
        f"a {BLIP_S:g} s drop (dist_timeout {BLIP_TIMEOUT_S:g} s) is ridden out: both nodes exit 0 with no "
        f"restart; epochs 1-{size.epochs} once"
    )
    skipped = _no_netns("j net_blip", expected)
    if skipped is not None:
        return skipped
    result = Result("j net_blip", expected)
    t0 = time.monotonic()
    with _netns.Pair() as net, Cluster(work, size, "net_blip") as c:
        args = c.common(nnodes=2, dist_timeout=BLIP_TIMEOUT_S)
        n0, _n1 = _on_two_networks(c, args, result, net)
        if result.problems:
            return _close(_finish(result, c, n0, t0, None), "")
        net.cut(1)
        time.sleep(BLIP_S)
        net.mend(1)
        mended = time.monotonic()
        result.check(c.wait_all(size.limit_s), "the nodes did not end")
        after = time.monotonic() - mended
        _finish(result, c, n0, t0, size.epochs)
        for i, n in enumerate(c.nodes):
            result.check("restart" not in n.out(), f"node {i} restarted: {_describe(n, 3)}")
        return _close(
            result,
            f"cable cut {BLIP_S:g} s after epoch 1, then mended; both nodes went on and exit 0 {after:.0f} s later, "
            "no restart",
        )


def case_net_partition(work: Path, size: Size = FULL) -> Result:
    """(k) nnodes=1:2 rdzv_backend=c10d max_restarts=1, each node in its own network namespace: the cable is cut
    after epoch 1 for good. Node 0's collective times out after dist_timeout, its launcher restarts it, and the
    group re-forms without node 1 (torch's 30 s wait for more nodes), resuming from last.pt; node 1, cut off, ends
    with one line once node 0's store has been silent for dist_timeout."""
    bound = size.dist_timeout + 30 + 30  # the collective's timeout, torch's wait for more nodes, a restart
    expected = (
        f"node 0 resumes alone within dist_timeout + 60 s ({bound:g} s) of the cut and exits 0, epochs "
        f"1-{size.epochs} once; node 1 ends with one line"
    )
    skipped = _no_netns("k net_partition", expected)
    if skipped is not None:
        return skipped
    result = Result("k net_partition", expected)
    t0 = time.monotonic()
    with _netns.Pair() as net, Cluster(work, size, "net_partition") as c:
        args = c.common(nnodes="1:2", rdzv_backend="c10d", max_restarts=1)
        n0, n1 = _on_two_networks(c, args, result, net)
        if result.problems:
            return _close(_finish(result, c, n0, t0, None), "")
        before = n0.out()
        net.cut(1)
        t_cut = time.monotonic()
        resumed_at: list[float] = []

        def resumed() -> bool:
            if not resumed_at and re.search(r"(restart \d+|group restarted): resuming from", n0.out()[len(before) :]):
                resumed_at.append(time.monotonic() - t_cut)
            return bool(resumed_at) or n0.ended()

        wait_until(resumed, size.limit_s, 0.2)
        result.check(bool(resumed_at) and resumed_at[0] <= bound, f"node 0 resumed after {resumed_at or '-'} s")
        result.check(bool(wait_until(lambda: all(n.ended() for n in c.nodes), size.limit_s, 0.2)), "not ended")
        _finish(result, c, n0, t0, None)
        rows = n0.rows()
        result.check(n0.proc.poll() == 0, f"node 0 {_describe(n0, 3)}")
        result.check(rows == [str(e) for e in range(1, size.epochs + 1)], f"results.csv epochs {rows}")
        said = [x for x in n1.out().splitlines() if x.startswith("error: ")]  # Python's resource tracker may
        line = said[0] if said else ""  # warn after it, from its own process
        result.check(n1.proc.poll() != 0 and len(said) == 1, f"node 1 {_describe(n1, 3)}")
        return _close(
            result,
            f"cable cut for good after epoch 1; node 0 resumed alone {resumed_at[0] if resumed_at else -1:.0f} s "
            f"later and exits 0; node 1: {line[:160]}",
        )


def _inject_env(variable: str, rule: dict[str, object]) -> dict[str, str]:
    """A node's extra environment for one of tests/_inject's rules (``TEST_FAULT``: a checkpoint write in rank 0's
    process; ``TEST_NONFINITE``: NaN losses on a rank), acting from outside detrain."""
    return {variable: json.dumps(rule), "PYTHONPATH": f"{REPO / 'tests' / '_inject'}{os.pathsep}{REPO}"}


def _fault_env(rule: dict[str, object]) -> dict[str, str]:
    return _inject_env("TEST_FAULT", rule)


def case_node0_lost(work: Path, size: Size = FULL) -> Result:
    """(l) nnodes=2: node 0's rank 0 is held right after it wrote epoch 2's last.pt (before it could send the file
    on), then node 0's launcher and workers are SIGKILLed at once (its machine dies): node 1 ends with one line, and
    started again alone with ``resume=`` naming its own copy of last.pt (save_replicas=2, the default) it resumes at
    epoch 2 (the newest checkpoint it received) and finishes."""
    result = Result(
        "l node0_lost",
        "node 1 ends with one line; alone, with resume= its copy of last.pt, it resumes at epoch 2 and exits 0; "
        "its results.csv has epochs 2 on, once",
    )
    t0 = time.monotonic()
    with Cluster(work, size, "node0_lost") as c:
        until = c.work / "release"  # never made: node 0 dies while held
        hold = _fault_env({"after": "last.pt", "epoch": 1, "then": "hold", "until": str(until)})
        args = c.common(nnodes=2)
        n0 = c.start(0, {**args, "node_rank": 0}, env=hold)
        n1 = c.start(1, {**args, "node_rank": 1})
        held = Path(f"{until}.held")
        if not wait_until(lambda: held.exists() or n0.ended() or n1.ended(), size.limit_s, 0.1) or not held.exists():
            result.problems.append(f"node 0 never wrote epoch 2's last.pt: {_describe(n0, 3)}")
            return _close(_finish(result, c, n0, t0, None), "")
        send([n0.pid, *descendants(n0.pid)], signal.SIGKILL)  # the whole machine at once
        killed = time.monotonic()
        result.check(bool(wait_until(n1.ended, size.limit_s, 0.2)), "node 1 did not end")
        ended_s, line = time.monotonic() - killed, n1.last_line()
        result.check(n1.proc.poll() != 0 and line.startswith("error: "), f"node 1 {_describe(n1, 3)}")
        again = c.restart(1, {"resume": "runs/x/weights/last.pt", "device": "cpu"})
        result.check(bool(wait_until(again.ended, size.limit_s, 0.2)), "node 1 alone did not end")
        resumed = re.search(r"resuming from runs/x/weights/last\.pt at epoch (\d+)", again.out())
        result.check(again.proc.poll() == 0, f"node 1 alone {_describe(again, 3)}")
        result.check(resumed is not None and resumed.group(1) == "2", f"node 1 alone: {_describe(again, 3)}")
        rows = again.rows()
        result.check(rows == [str(e) for e in range(2, size.epochs + 1)], f"node 1's results.csv epochs {rows}")
        loads, result.checkpoint, ckpt = checkpoint_text(again.run / "weights" / "last.pt")
        result.check(loads and ckpt is not None and int(ckpt["epoch"]) == size.epochs - 1, result.checkpoint)
        result.epochs = f"{rows[0]}-{rows[-1]} (node 1)" if rows else "-"
        result.seconds = time.monotonic() - t0
        return _close(
            result, f"node 0 SIGKILLed after writing epoch 2's last.pt; node 1 ended {ended_s:.1f} s later: "
            f"{line[:120]}; alone it resumed from its copy at epoch 2 and exits 0",
        )  # fmt: skip


def _one_image_fewer(data: Path) -> None:
    gone = sorted((data / "images" / "train").iterdir())[-1]
    gone.unlink()
    (data / "labels" / "train" / f"{gone.stem}.txt").unlink(missing_ok=True)


def case_nodes_differ(work: Path, size: Size = FULL) -> Result:
    """(m) nnodes=2, node 1's copy of the dataset one image short: both nodes refuse before training, with one
    line naming node_rank=1 and the counts, exit code 2."""
    result = Result("m nodes_differ", "both exit 2 before training; one line naming node_rank=1 and the image counts")
    t0 = time.monotonic()
    with Cluster(work, size, "nodes_differ") as c:
        args = c.common(nnodes=2)
        n0 = c.start(0, {**args, "node_rank": 0})
        n1 = c.start(1, {**args, "node_rank": 1}, alter=_one_image_fewer)
        result.check(c.wait_all(size.limit_s), "the nodes did not end")
        _finish(result, c, n0, t0, None)
        want = f"train images {size.n_train - 1} there, {size.n_train} on node 0"
        for i, node in enumerate((n0, n1)):
            out = node.out()
            result.check(node.proc.poll() == 2, f"node {i} {_describe(node, 3)}")
            result.check("node_rank=1 (host " in node.last_line() and want in node.last_line(), f"node {i} line")
            result.check(out.count("error: ") == 1 and "Traceback" not in out, f"node {i}: not one line")
        result.check(not list(c.work.rglob("last.pt")), "a checkpoint was written")
        return _close(result, f"node 0: {n0.last_line()[:200]}; node 1 exit {n1.proc.poll()}")


def case_repeated_failure(work: Path, size: Size = FULL) -> Result:
    """(n) nnodes=2 max_restarts=5: every attempt's first last.pt write fails (an I/O error injected into rank 0's
    rename by tests/_inject, on every attempt): one line naming the file each time, restarts that wait longer each
    time, and the third attempt stops the run with 'the same failure repeated' instead of using up the restarts."""
    result = Result(
        "n repeated_failure",
        "each failed save is one line naming last.pt; the run stops at attempt 3 with 'the same failure repeated "
        "2 times'; not 5 restarts",
    )
    t0 = time.monotonic()
    fault = _fault_env({"after": "last.pt", "epoch": 0, "then": "raise", "every_attempt": True})
    with Cluster(work, size, "repeated_failure") as c:
        args = c.common(nnodes=2, max_restarts=5)
        n0 = c.start(0, {**args, "node_rank": 0}, env=fault)
        c.start(1, {**args, "node_rank": 1})
        result.check(c.wait_all(size.limit_s), "the nodes did not end")
        _finish(result, c, n0, t0, None)
        out = n0.out()
        stop = re.search(r"the same failure repeated (\d+) times with no progress[^\n]*", out)
        result.check(stop is not None and stop.group(1) == "2", f"node 0 {_describe(n0, 3)}")
        result.check(n0.proc.poll() not in (0, None), f"node 0 {_describe(n0)}")
        result.check("restart 3" not in out, "the restarts were used up past the third attempt")
        result.check("injected failure" in out and "last.pt" in out, "the failed save was not named")
        return _close(result, f"node 0: {stop.group(0)[:220] if stop else _describe(n0, 2)}")


def _damaged_copy(path: Path) -> None:
    """``path`` replaced by a copy with 64 bytes flipped mid-file (a new file: its previous generation, a hard link
    to the old one, stays whole), as a disk that returns bad blocks would give it."""
    data = bytearray(path.read_bytes())
    for k in range(len(data) // 2, len(data) // 2 + 64):
        data[k] ^= 0xFF
    tmp = path.with_name(f"{path.name}.damaged")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)


def case_save_fails(work: Path, size: Size = FULL) -> Result:
    """(o) nnodes=2: rank 0's write of epoch 2's last.pt fails (an I/O error injected into its rename: a full disk
    or a dying one): one line naming the file, epoch 1's last.pt intact, no temporary file left. Then last.pt is
    damaged on disk and both nodes are started again with resume= naming it: they fall back to last.prev.pt with a
    warning and a checkpoint_fallback event, and finish with each epoch once."""
    result = Result(
        "o save_fails",
        "one line 'cannot write ...last.pt'; epoch 1's last.pt loads, no temporary file; resumed on a damaged "
        "last.pt, both nodes fall back to last.prev.pt and finish; epochs once",
    )
    t0 = time.monotonic()
    with Cluster(work, size, "save_fails") as c:
        args = c.common(nnodes=2)
        n0 = c.start(0, {**args, "node_rank": 0}, env=_fault_env({"after": "last.pt", "epoch": 1, "then": "raise"}))
        n1 = c.start(1, {**args, "node_rank": 1})
        result.check(c.wait_all(size.limit_s), "the nodes did not end")
        line = n0.last_line()
        result.check(n0.proc.poll() not in (0, None), f"node 0 {_describe(n0)}")
        ended_badly = n1.proc.poll() not in (0, None) and n1.last_line().startswith("error: ")
        result.check(ended_badly, f"node 1 {_describe(n1)}")
        want = "cannot write runs/x/weights/last.pt: injected failure; the previous last.pt is intact"
        result.check(want in line and line.startswith("error: "), f"node 0's line: {line[:200]}")
        weights = n0.run / "weights"
        loads, text, ckpt = checkpoint_text(weights / "last.pt")
        result.check(loads and ckpt is not None and int(ckpt["epoch"]) == 0, f"last.pt after the failed save: {text}")
        left = sorted(p.name for p in weights.iterdir() if p.name.endswith(".tmp"))
        result.check(not left, f"temporary files left: {left}")
        if result.problems:
            return _close(_finish(result, c, n0, t0, None), "")
        _damaged_copy(weights / "last.pt")
        again = {**args, "resume": "runs/x/weights/last.pt"}
        m0, m1 = c.restart(0, {**again, "node_rank": 0}), c.restart(1, {**again, "node_rank": 1})
        result.check(c.wait_all(size.limit_s), "the nodes started again did not end")
        out = m0.out()
        fell_back = re.search(r"resuming from \S*last\.prev\.pt at epoch (\d+)", out)
        result.check(fell_back is not None and fell_back.group(1) == "2", f"node 0 again: {_describe(m0, 3)}")
        result.check(m0.proc.poll() == 0 and m1.proc.poll() == 0, f"again: {_describe(m0)} / {_describe(m1)}")
        events = (n0.run / "events.jsonl").read_text() if (n0.run / "events.jsonl").exists() else ""
        result.check('"checkpoint_fallback"' in events, "no checkpoint_fallback event")
        rows = n0.rows()
        result.check(rows == [str(e) for e in range(1, size.epochs + 1)], f"results.csv epochs {rows}")
        result.epochs = epochs_text(rows)
        _, result.checkpoint, _ = checkpoint_text(weights / "last.pt")
        result.seconds = time.monotonic() - t0
        return _close(
            result, f"{line[7:120]}; epoch 1's last.pt loads; damaged, then {fell_back.group(0) if fell_back else ''}"
            "; both exit 0",
        )  # fmt: skip


def case_nan_steps(work: Path, size: Size = FULL) -> Result:
    """(p) nnodes=2 nonfinite_limit=2: node 1's rank makes every loss NaN from epoch 2 on (tests/_inject, in that
    process only): both ranks skip those updates together and stop after two in a row with one line, exit 2;
    last.pt stays epoch 1's and finite."""
    result = Result(
        "p nan_steps",
        "both nodes end with one line '2 updates in a row had a non-finite loss', exit 2; last.pt epoch 1, finite",
    )
    t0 = time.monotonic()
    with Cluster(work, size, "nan_steps") as c:
        args = c.common(nnodes=2, nonfinite_limit=2)
        nb = max(1, -(-size.n_train // size.batch))  # batches per epoch of each rank
        nan = _inject_env("TEST_NONFINITE", {"rank": 1, "from": nb})
        n0 = c.start(0, {**args, "node_rank": 0})
        n1 = c.start(1, {**args, "node_rank": 1}, env=nan)
        result.check(c.wait_all(size.limit_s), "the nodes did not end")
        _finish(result, c, n0, t0, None)
        for i, node in enumerate((n0, n1)):
            line = node.last_line()
            result.check(node.proc.poll() == 2, f"node {i} {_describe(node)}")
            result.check("2 updates in a row had a non-finite loss" in line, f"node {i}'s line: {line[:200]}")
        loads, _, ckpt = checkpoint_text(n0.run / "weights" / "last.pt")
        result.check(loads and ckpt is not None and int(ckpt["epoch"]) == 0, "last.pt is not epoch 1's")
        result.check(n0.rows() == ["1"], f"results.csv epochs {n0.rows()}")
        return _close(result, f"node 0: {n0.last_line()[:220]}; node 1 exit {n1.proc.poll()}")


CASES: dict[str, Callable[[Path, Size], Result]] = {
    "a": case_worker_kill,
    "b": case_node_leaves,
    "c": case_node_joins,
    "d": case_rank_stopped,
    "e": case_launcher_sigterm,
    "f": case_mid_epoch_kill,
    "g": case_busy_port,
    "h": case_no_master,
    "i": case_preempted,
    "j": case_net_blip,
    "k": case_net_partition,
    "l": case_node0_lost,
    "m": case_nodes_differ,
    "n": case_repeated_failure,
    "o": case_save_fails,
    "p": case_nan_steps,
}
NAMES = {case.__name__.removeprefix("case_"): letter for letter, case in CASES.items()}  # worker_kill -> a ...


def run_case(letter: str, work: Path, size: Size) -> Result:
    """One case; an unexpected error in the harness itself is a failed row, not a crash of the matrix."""
    try:
        return CASES[letter](work, size)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - reported in the row
        return Result(f"{letter} {CASES[letter].__name__[5:]}", "-", f"harness error: {type(e).__name__}: {e}")


def table(results: list[Result]) -> str:
    """A Markdown table of the results."""
    head = ["case", "expected", "observed", "ok", "seconds", "epochs in results.csv", "last.pt"]
    rows = [
        [r.case, r.expected, r.observed, "yes" if r.ok else "NO", f"{r.seconds:.0f}", r.epochs, r.checkpoint]
        for r in results
    ]
    clean = [[c.replace("|", "\\|").replace("\n", " ") for c in row] for row in rows]
    return "\n".join(
        ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(row) + " |" for row in clean]
    )


def pick(text: str) -> list[str]:
    """``"a,f"``, ``"af"``, ``"worker_kill,busy_port"`` -> case letters, in the order given."""
    picked: list[str] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part in NAMES:
            picked.append(NAMES[part])
        elif all(ch in CASES for ch in part):
            picked += list(part)
        else:
            choices = f"letters {min(CASES)}-{max(CASES)} or the names {', '.join(NAMES)}"
            raise SystemExit(f"error: --cases: {part!r} is not a case; use {choices}")
    return picked


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default="".join(CASES), help="letters or names, comma-separated (default: all)")
    parser.add_argument("--small", action="store_true", help="the smallest runs that exercise each case")
    parser.add_argument("--work", type=Path, default=None, help="folder for the nodes (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the nodes' folders (with --work, always kept)")
    a = parser.parse_args(argv)
    letters = pick(a.cases)
    signal.signal(signal.SIGTERM, _interrupt)  # a terminated matrix cleans up as Ctrl-C does
    size = SMALL if a.small else FULL
    work = a.work or Path(tempfile.mkdtemp(prefix="detrain_chaos_"))
    results = []
    try:
        for letter in letters:
            r = run_case(letter, work, size)
            results.append(r)
            print(f"{'ok  ' if r.ok else 'FAIL'} {r.case}: {r.observed} ({r.seconds:.0f} s)", flush=True)
    except KeyboardInterrupt:
        print("interrupted; every process of the cases was stopped", file=sys.stderr)
        return 130
    finally:
        if a.work is None and not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif results:
            print(f"nodes' folders in {work}")
    print()
    print(table(results))
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
