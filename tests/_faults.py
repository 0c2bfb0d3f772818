"""Fault injection for the process tests, from outside detrain: real signals sent by the test to processes found in
/proc (scripts/chaos.py's helpers), and, where a test needs an exact point inside rank 0, a rule for
``tests/_inject/sitecustomize.py`` (it watches rank 0's checkpoint writes through Python's audit hooks).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from _processes import child_env
from _scripts import load_script

INJECT = Path(__file__).resolve().parent / "_inject"


chaos = load_script("chaos")
workers_of = chaos.workers_of
descendants = chaos.descendants
send = chaos.send


def fault_env(
    after: str, epoch: int, then: str, next_batch: int | None = None, until: Path | None = None, **extra: str
) -> dict[str, str]:
    """A child environment (:func:`_processes.child_env`) whose rank 0, on the launcher's first attempt, kills
    itself (``then="kill"``) or waits for the file ``until`` (``then="hold"``, after writing ``<until>.held``)
    right after it wrote ``weights/<after>`` (``"last.pt"`` or ``"mid.pt"``: in rank 0's checkpoint writer thread,
    while the loop goes on) holding ``epoch`` (and, for mid.pt, a ``next_batch`` at least this), or ``results.csv``
    with epoch ``epoch``'s row (0-based: in the loop's own thread, just before that epoch's save)."""
    rule: dict[str, object] = {"after": after, "epoch": epoch, "then": then}
    if next_batch is not None:
        rule["next_batch"] = next_batch
    if until is not None:
        rule["until"] = str(until)
    env = child_env(**extra)
    env["PYTHONPATH"] = os.pathsep.join([str(INJECT), env["PYTHONPATH"]])
    env["TEST_FAULT"] = json.dumps(rule)
    return env


def wait_for(what, limit_s: float, message: str):
    """``what()`` once truthy; fails the test with ``message`` after ``limit_s`` (a hang guard, not a timing)."""
    value = chaos.wait_until(what, limit_s)
    assert value, message() if callable(message) else message
    return value


def rank_of_torchrun(torchrun: int, rank: int) -> int | None:
    """The torchrun rank ``rank`` among its children (their environment holds ``RANK``)."""
    for pid in chaos.children(torchrun):
        try:
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    return None


def held(until: Path, limit_s: float) -> int:
    """The pid of the rank 0 that holds for ``until`` (see :func:`fault_env`), once it holds."""
    marker = Path(f"{until}.held")
    wait_for(marker.exists, limit_s, f"rank 0 never held at its point ({marker})")
    return int(marker.read_text())


__all__ = ["chaos", "descendants", "fault_env", "held", "rank_of_torchrun", "send", "wait_for", "workers_of"]
