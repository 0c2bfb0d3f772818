"""Restarts that cannot help, and a growing pause before each restart.

torch's elastic agent restarts the worker group after any failure, at once, until ``max_restarts`` is used up, and
has no hook to do otherwise. So detrain decides in the workers, where the restart is seen:

* **A pause** (:func:`pause_before_restart`): a restarted worker waits ``restart_backoff`` seconds times 2 to the
  power (restart - 1), at most ``restart_backoff_max`` (and below half of ``dist_timeout``), before it joins the
  process group: 1, 2, 4 ... s by default. The agent's rendezvous has finished by then and every worker of the
  attempt waits the same time, so the group's own start (which waits up to ``dist_timeout``) is not at risk; a
  node that joins an elastic group mid-run starts at restart 0 and waits for the others within that timeout.
* **No restart for a failure that only repeats** (:func:`check_progress`): when the same failure ended
  ``restart_same_failures`` attempts in a row and the run made no progress in between, the next attempt stops the
  run with one line, ``the same failure repeated N times with no progress since epoch E batch B: <the failure>``,
  instead of using up the restarts. *The same failure*: the same set of error lines (``Type: first line``) of the
  ranks that failed on their own (a rank that only saw a peer go is a consequence and is left out); a failure
  with no Python error (a worker killed by a signal) has no line and never counts as the same. *No progress*:
  every attempt after the first of them started from the same point (the resumed checkpoint's epoch and batch, or
  the beginning when none was saved): no ``last.pt`` or ``mid.pt`` further on was written in between. With the
  default 2: a deterministic crash at one step fails the attempt that first reaches it and the restart that
  resumes before it, and the third attempt stops before training.
* **An agreed stop** (:class:`AgreedStop`): a verdict every rank reached alike (this one, or nodes that differ:
  :mod:`detrain.distributed.launch.node_consistency`) must not be restarted. Under detrain's launcher each worker
  returns a :class:`Stopped` instead of raising, so the agent ends the group as finished, and the launcher raises the
  line (:func:`raise_if_stopped`); elsewhere (torchrun, srun, one process) the error is raised.

The attempts are noted in the folder the launcher keeps for its launch on each node (:data:`ATTEMPTS_ENV`; nodes
share no disk): a failing worker leaves its line there (:func:`note_failure`), and rank 0, always on node 0,
keeps the history of starting points and failures beside it.

>>> [backoff_s(k, 1.0, 60.0) for k in range(5)], backoff_s(9, 1.0, 60.0)
([0.0, 1.0, 2.0, 4.0, 8.0], 60.0)
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from detrain.distributed import dist
from detrain.distributed.world import World
from detrain.errors import DistributedError
from detrain.log import console
from detrain.system.tempfiles import write_atomic

ATTEMPTS_ENV = "DETRAIN_ATTEMPTS"  # the launcher's folder for this launch on this node (spawned workers only)
_HISTORY = "history.json"
_LINE_CHARS = 300
_MAX_NOTE = 1 << 16

T = TypeVar("T")


class AgreedStop(DistributedError):
    """Raised on every rank alike once all ranks reached the same verdict: a stop that no restart can mend."""


@dataclass(frozen=True)
class Stopped:
    """What a worker of detrain's launcher returns for an :class:`AgreedStop`: the agent then ends the group as
    finished instead of restarting it, and the launcher raises ``line`` (:func:`raise_if_stopped`)."""

    line: str


def stopped(e: AgreedStop, world: World) -> Stopped:
    """``e`` as a worker's return value under detrain's launcher; raised again anywhere else."""
    if world.launcher != "detrain":
        raise e
    return Stopped(str(e))


def raise_if_stopped(results: Iterable[Any]) -> None:
    """In the launcher: the agreed stop of this node's workers as one line (an :class:`AgreedStop`, which a node
    raises as its own line even when another node said it first: :mod:`job_watch`), if they stopped."""
    for result in results:
        if isinstance(result, Stopped):
            raise AgreedStop(result.line)


def finished(result: T | Stopped) -> T:
    """A worker's result as the caller gets it: an agreed stop raised as its line (DistributedError)."""
    raise_if_stopped([result])
    return result  # type: ignore[return-value]  # not a Stopped: raise_if_stopped let it through


def backoff_s(restart: int, base_s: float, max_s: float) -> float:
    """The pause before attempt ``restart`` (0: the first start, no pause): ``base_s`` * 2 ** (restart - 1), at
    most ``max_s``."""
    if restart <= 0 or base_s <= 0:
        return 0.0
    return float(min(max_s, base_s * 2.0 ** min(restart - 1, 60)))


def pause_before_restart(world: World, base_s: float, max_s: float, dist_timeout_s: float) -> float:
    """In a restarted worker, before it joins the group: wait :func:`backoff_s` (below half of ``dist_timeout_s``,
    which the group's start waits for the last rank); rank 0 says how long. Returns the seconds waited."""
    delay = min(backoff_s(world.restart_count, base_s, max_s), dist_timeout_s / 2)
    if delay <= 0:
        return 0.0
    if world.is_main:
        console.print(
            f"restart {world.restart_count}: waiting {delay:g} s before the workers start again "
            f"(restart_backoff={base_s:g} s, doubled at each restart up to {max_s:g} s)"
        )
    time.sleep(delay)
    return delay


def failure_line(error: BaseException) -> str:
    """``Type: first line`` of an error, as the run's last line names it."""
    text = str(error).strip()
    line = f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
    return line[:_LINE_CHARS]


def note_failure(world: World, error: BaseException, consequence: bool) -> None:
    """In a spawned worker that fails: leave its line for the next attempt's :func:`check_progress`
    (``consequence``: it only saw a peer go). Nothing without detrain's launcher; a note that cannot be written is
    left out (the failure itself matters more)."""
    folder = os.environ.get(ATTEMPTS_ENV)
    if not folder:
        return
    note = json.dumps({"line": failure_line(error), "consequence": consequence})
    with contextlib.suppress(OSError):
        write_atomic(Path(folder) / f"failed-{world.restart_count}-{world.rank}.json", note)


def check_progress(world: World, point: tuple[int, int] | None, same: int) -> None:
    """At the start of every attempt under detrain's launcher (a collective: every rank calls it): record where
    this attempt starts (``point``: the resumed checkpoint's (epoch, batch), 0-based, or None for the beginning),
    and raise :class:`AgreedStop` on every rank when the same failure repeated ``same`` times with no progress (see
    the module; ``same`` 0: never)."""
    folder = os.environ.get(ATTEMPTS_ENV)
    if world.launcher != "detrain" or not folder:
        return  # every rank of one launch alike: all spawned by detrain's launchers, or none
    mine = _failures(Path(folder), world.restart_count - 1) if world.restart_count > 0 else []
    # collective: one all_gather_object of each rank's notes of the previous attempt (its node's), once at start
    gathered: list[list[dict[str, Any]]] = dist.all_gather_object(mine)
    verdict = None
    if world.is_main:
        failed = _signature([note for notes in gathered for note in notes])
        verdict = _judge(Path(folder), world.restart_count, point, failed, same)
    verdict = dist.broadcast_object(verdict)  # collective: rank 0's verdict on every rank
    if verdict:
        raise AgreedStop(verdict)


def _failures(folder: Path, attempt: int) -> list[dict[str, Any]]:
    """The notes this node's workers left when ``attempt`` failed."""
    notes = []
    for path in sorted(folder.glob(f"failed-{attempt}-*.json")):
        with contextlib.suppress(OSError, ValueError):
            note = json.loads(path.read_bytes()[:_MAX_NOTE])
            if isinstance(note, dict) and isinstance(note.get("line"), str):
                notes.append(note)
    return notes


def _signature(notes: list[dict[str, Any]]) -> list[str]:
    """The failure of an attempt: the sorted lines of the ranks that failed on their own; [] when none left one."""
    return sorted({n["line"] for n in notes if not n.get("consequence")})


def _judge(folder: Path, attempt: int, point: tuple[int, int] | None, failed: list[str], same: int) -> str | None:
    """Rank 0: the history with this attempt's start (and the previous attempt's failure) added, and the verdict."""
    path = folder / _HISTORY
    history: list[dict[str, Any]] = []
    if attempt > 0:
        with contextlib.suppress(OSError, ValueError):
            read = json.loads(path.read_text())
            history = [a for a in read if isinstance(a, dict)][:attempt] if isinstance(read, list) else []
        # an attempt that failed before it got here has no start on record: its point is unknown, never the same
        history += [{"point": "unknown", "failure": []} for _ in range(attempt - len(history))]
        history[-1]["failure"] = failed
    history.append({"point": list(point) if point is not None else None, "failure": []})
    with contextlib.suppress(OSError):
        write_atomic(path, json.dumps(history))
    return repeated_without_progress(history, same)


def repeated_without_progress(history: list[dict[str, Any]], same: int) -> str | None:
    """The line that stops the run when the ``same`` attempts before the last one in ``history`` (each
    ``{"point": [epoch, batch] | None, "failure": [lines]}``, oldest first; the last is the attempt starting now)
    failed alike and the attempts after the first of them all started from the same point; else None.

    >>> crash = ["RuntimeError: boom"]
    >>> h = [{"point": None, "failure": crash}, {"point": [1, 0], "failure": crash}, {"point": [1, 0]}]
    >>> repeated_without_progress(h, 2)
    'the same failure repeated 2 times with no progress since epoch 2 batch 0: RuntimeError: boom'
    >>> repeated_without_progress([*h[:2], {"point": [2, 0]}], 2) is None  # the second attempt saved an epoch
    True
    """
    if same < 2 or len(history) <= same:
        return None
    failed, starts = history[-same - 1 : -1], history[-same:]
    first = failed[0].get("failure")
    if not first or any(a.get("failure") != first for a in failed):
        return None
    if any(a.get("point") != starts[0].get("point") for a in starts):
        return None
    point = starts[-1].get("point")
    since = f"epoch {point[0] + 1} batch {point[1]}" if point else "the start"
    more = f" (and {len(first) - 1} other rank(s) failing otherwise)" if len(first) > 1 else ""
    return f"the same failure repeated {same} times with no progress since {since}: {first[0]}{more}"
