"""A worker's note to the launcher that spawned it: "preempted, resumable", and where the run stands.

A worker that stopped on a preemption signal (:mod:`detrain.engine.train.state.preemption`) returns normally, so that
torch's elastic agent neither restarts it nor reports a failure; the line it leaves in its node's launch folder
(the path in :data:`MARK_ENV`, a folder only this node's launcher and workers use: nodes share no disk) tells the
launcher to end with :class:`detrain.errors.Preempted` instead of reporting a finished run.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from detrain.system.tempfiles import write_atomic

SIGNALS = ("SIGTERM", "SIGUSR1")  # the warning signals of SLURM, Kubernetes and spot reclaims
MARK_ENV = "DETRAIN_PREEMPT_MARK"
MARK_SPARE_S = 10  # the elastic agent waits grace + this for its workers before SIGKILL


def leave_mark(line: str) -> bool:
    """A spawned worker's note to its launcher (:data:`MARK_ENV`): written whole or not at all; False when this
    process has no launcher of detrain's to tell."""
    path = os.environ.get(MARK_ENV)
    if not path:
        return False
    write_atomic(path, line)
    return True


def read_mark(path: str | Path) -> str | None:
    """The note a worker left for this launcher, if any."""
    try:
        return Path(path).read_text()[:2000] or None
    except OSError:
        return None


def stop_path(mark: str) -> str:
    """The file a launcher makes when it was signalled itself: its agent is stopping the workers (see below)."""
    return f"{mark}.stop"


def relayed_signal() -> str | None:
    """In a worker: the signal its launcher got, when the launcher passed one on (it sends SIGUSR1 for either)."""
    path = os.environ.get(MARK_ENV)
    said = read_mark(stop_path(path)) if path else None
    return said if said in SIGNALS else None


def exit_when_launcher_stops() -> None:
    """In a worker that left its line: end this process as soon as its launcher says it is stopping.

    torch's agent, once signalled itself, stops its workers and waits for them to exit, while a worker that
    returned waits for the agent to read its return value: each would wait for the other until the agent's SIGKILL
    at the end of the grace period. A daemon thread watches for the launcher's file and exits the process (its
    line and checkpoint are written; its group is closed)."""
    path = os.environ.get(MARK_ENV)
    if not path:
        return
    stop = stop_path(path)

    def watch() -> None:
        while not os.path.exists(stop):
            time.sleep(0.05)
        os._exit(0)

    threading.Thread(target=watch, name="detrain-preempt-exit", daemon=True).start()
