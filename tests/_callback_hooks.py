"""Callbacks for tests/integration/test_callbacks.py that spawned workers can import by name (top level of a module).

``record`` appends one JSON line per call to a file, with the rank and the process id that ran it, so a test
can count how often, where and in what order each event fired.
"""

from __future__ import annotations

import json
import os

from detrain.distributed import dist
from detrain.engine.train.callbacks import TrainEvent


def record(path: str, event: TrainEvent) -> None:
    """Append ``event`` (bound first with functools.partial) as one line: name, epoch, rank, pid, metric keys."""
    line = {
        "event": event.event,
        "epoch": event.epoch,
        "rank": dist.rank(),
        "env_rank": os.environ.get("RANK"),
        "pid": os.getpid(),
        "metrics": sorted(event.metrics),
        "last": str(event.last) if event.last else None,
    }
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def fail(event: TrainEvent) -> None:
    raise RuntimeError(f"callback failed on purpose at {event.event}")
