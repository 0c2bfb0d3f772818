"""Copies of the run's resumable checkpoints on other nodes, so that node 0 is not the only place they live.

Only rank 0 writes files, on node 0's disk. With ``save_replicas=N`` (2 by default; it matters on a run of several
nodes only) every ``last.pt`` and ``mid.pt`` rank 0 writes is also sent, as the file's bytes, to the first process
of each of the next N - 1 nodes (in the order of their lowest rank), which writes it into the same run folder on its
own disk, atomically and keeping the previous generation as rank 0 does (``last.prev.pt``). Sending is point to
point: only rank 0 and those processes take part, and the others go on.

A node whose disk already holds the very same bytes at that path (a disk the nodes share, or two launchers on one
machine given the same absolute folder) writes nothing: rank 0 has written the file before it is sent.

After node 0 is lost, the rest resume from their copy: every start already looks on each node's own disk for the
furthest checkpoint of the run (:mod:`detrain.engine.train.state.resume_state`), and a new run started on another node
with ``resume=true`` (or a path to the copy) continues from it (docs/distributed.md).

>>> targets([{"rank": 0, "node": 0}, {"rank": 1, "node": 0}, {"rank": 2, "node": 1}, {"rank": 3, "node": 2}], 2)
[2]
>>> targets([{"rank": 0, "node": 0}, {"rank": 1, "node": 1}], 1)
[]
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from detrain.distributed import dist
from detrain.engine.build import run_dir_problem
from detrain.errors import CheckpointError
from detrain.system.tempfiles import atomic_file, keep_generation
from detrain.weights.hub import file_sha256


def targets(layout: list[dict[str, Any]], copies: int) -> list[int]:
    """The ranks that keep a copy: the lowest rank of each node other than rank 0's, in node order, for
    ``copies`` - 1 nodes (``copies`` counts node 0's own file). ``layout``: every rank's ``rank`` and ``node``."""
    home = next(p["node"] for p in layout if p["rank"] == 0)
    firsts: dict[int, int] = {}  # node -> its lowest rank, in the order of those ranks (insertion order)
    for p in sorted(layout, key=lambda p: p["rank"]):
        if p["node"] != home:
            firsts.setdefault(p["node"], p["rank"])
    return list(firsts.values())[: max(copies - 1, 0)]


class Replicas:
    """Sends the files rank 0 has just written to the ranks of :func:`targets`, which write them to their disk."""

    def __init__(self, layout: list[dict[str, Any]], copies: int, rank: int) -> None:
        self.to = targets(layout, copies)
        self.rank = rank

    def copy(self, path: Path, keep_previous: str | None = None, supersedes: str | None = None) -> None:
        """Rank 0 sends ``path`` (written whole already); each target writes what it receives to ``path`` on its
        own disk (the file there before kept as ``keep_previous``; ``supersedes``, a file beside it that the new one
        makes obsolete, removed: the epoch's ``mid.pt`` once ``last.pt`` holds the epoch). Call on every rank after
        rank 0 has written ``path``: ranks that keep no copy return at once."""
        if not self.to:  # one node, or save_replicas=1: rank 0 need not read the file it has just written
            return
        if self.rank == 0:
            data = path.read_bytes()
            for dst in self.to:
                dist.send_bytes(data, dst)  # collective: point to point, rank 0 and this target only
        elif self.rank in self.to:
            data = dist.recv_bytes(0)  # collective: point to point, from rank 0
            if write_copy(path, data, keep_previous) and supersedes:
                (path.parent / supersedes).unlink(missing_ok=True)


def write_copy(path: Path, data: bytes, keep_previous: str | None) -> bool:
    """``data`` into ``path`` on this node's disk, atomically (the folder made if needed, never through a link;
    the file there before kept as ``keep_previous``); False, and nothing written, where ``path`` already holds
    exactly ``data`` (a disk shared with node 0). A folder that cannot take it is one line (CheckpointError)."""
    try:
        if path.is_file() and file_sha256(path) == hashlib.sha256(data).hexdigest():
            return False
        problem = run_dir_problem(path.parent.parent)
        if problem is not None:
            raise CheckpointError(f"the copy of {path.name} for this node: {problem}")
        path.parent.mkdir(parents=True, exist_ok=True)
        if keep_previous:
            keep_generation(path, keep_previous)
        with atomic_file(path, sync=True) as f:
            f.write(data)
    except OSError as e:
        raise CheckpointError(f"cannot write this node's copy of {path}: {e.strerror or e}") from None
    return True
