"""Copies of the run's resumable checkpoints on other nodes, so that node 0 is not the only place they live.

Only rank 0 writes files, on node 0's disk. With ``save_replicas=N`` (2 by default; it matters on a run of several
nodes only) every ``last.pt`` and ``mid.pt`` rank 0 writes is also sent, as the file's bytes, to the first process
of each of the next N - 1 nodes (in the order of their lowest rank), which writes it into the same run folder on its
own disk, atomically and keeping the previous generation as rank 0 does (``last.prev.pt``). Sending is point to
point: only rank 0 and those processes take part, and the others go on. Rank 0 writes its files in a thread beside
the loop (:mod:`.writer`); a save's copies are sent by the loop's thread on every rank once that write has finished,
when the next save begins or the run ends (:meth:`Checkpointer.drain`), so a copy lags one save behind node 0.

After each epoch the rest of the run folder follows (:meth:`Replicas.copy_record`): ``results.csv``,
``events.jsonl``, ``args.yaml``, ``manifest.json``, ``weights/best.pt`` and the ``weights/epochN.pt`` of
``save_period``, so that losing node 0 loses neither the deliverable nor the history. A node whose disk already
holds the very same bytes at a path (an unchanged best.pt, a disk the nodes share, two launchers on one machine
given the same absolute folder) is sent nothing for it. A copy that fails is a warning and a ``replica_failed``
event, not the end of the run; the temporary files of copies killed mid-write are removed on every node keeping
copies when a run starts there.

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
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detrain.distributed import dist
from detrain.engine.build import run_dir_problem
from detrain.errors import CheckpointError
from detrain.system.tempfiles import atomic_file, keep_generation, remove_unfinished
from detrain.system.text import excerpt
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


RECORD = ("results.csv", "events.jsonl", "args.yaml", "manifest.json")  # the run folder's own record
WEIGHTS_RECORD = re.compile(r"best\.pt|epoch[0-9]{1,9}\.pt")  # weights/ files of the record (last/mid: copy())


@dataclass(frozen=True)
class Entry:
    """One file rank 0 sends: its path as rank 0 names it, its sha256, and what the target does around it."""

    path: str
    sha256: str
    keep_previous: str | None = None
    supersedes: str | None = None


class Replicas:
    """Sends the files rank 0 has just written to the ranks of :func:`targets`, which write them to their disk.

    Each exchange with a target: rank 0 sends the list of files (path, sha256); the target answers with those its
    disk does not hold already; rank 0 sends their bytes; the target writes them and answers with what it could not
    write. A copy that fails is a warning on rank 0 (the caller's line and event), never the end of the run: the
    run goes on with one copy fewer."""

    def __init__(self, layout: list[dict[str, Any]], copies: int, rank: int, save_dir: Path | None = None) -> None:
        self.to = targets(layout, copies)
        self.rank = rank
        self.save_dir = save_dir  # a target writes nothing outside it (rank 0 names the paths)
        self._sha: dict[str, tuple[int, int, str]] = {}  # path -> (size, mtime_ns, sha256), not to hash twice

    def clean(self) -> list[str]:
        """A target, at its start: the temporary files of copies killed mid-write removed from its run folder (as
        rank 0 removes its own); the names removed. Others: nothing."""
        if self.rank not in self.to or self.save_dir is None or run_dir_problem(self.save_dir) is not None:
            return []  # a folder that will take no copy is left as it is (the copies say why)
        folders = (self.save_dir, self.save_dir / "weights")
        return [name for f in folders if f.is_dir() and not f.is_symlink() for name in remove_unfinished(f)]

    def copy(self, path: Path, keep_previous: str | None = None, supersedes: str | None = None) -> list[str]:
        """Rank 0 sends ``path`` (written whole already); each target writes it to ``path`` on its own disk (the
        file there before kept as ``keep_previous``; ``supersedes``, a file beside it that the new one makes
        obsolete, removed: the epoch's ``mid.pt`` once ``last.pt`` holds the epoch). Call on every rank after
        rank 0 has written ``path``: ranks that keep no copy return at once. Returns, on rank 0, the targets'
        failures (one line each)."""
        if not self.to:  # one node, or save_replicas=1: rank 0 need not read the file it has just written
            return []
        entries = [Entry(str(path), self._hash(path), keep_previous, supersedes)] if self.rank == 0 else []
        return self._exchange(entries)

    def copy_record(self, save_dir: Path) -> list[str]:
        """Rank 0 sends the run's record as it stands: ``results.csv``, ``events.jsonl``, ``args.yaml``,
        ``manifest.json``, ``weights/best.pt`` and every ``weights/epochN.pt`` (regular files only); a target takes
        those its disk does not hold yet (best.pt travels when it changed). Every rank calls it."""
        if not self.to:
            return []
        entries = []
        if self.rank == 0:
            names = [save_dir / n for n in RECORD]
            weights = save_dir / "weights"
            if weights.is_dir():
                names += sorted(p for p in weights.iterdir() if WEIGHTS_RECORD.fullmatch(p.name))
            entries = [Entry(str(p), self._hash(p)) for p in names if p.is_file() and not p.is_symlink()]
        return self._exchange(entries)

    def _hash(self, path: Path) -> str:
        info = path.stat()
        known = self._sha.get(str(path))
        if known is not None and known[:2] == (info.st_size, info.st_mtime_ns):
            return known[2]
        sha = file_sha256(path)
        self._sha[str(path)] = (info.st_size, info.st_mtime_ns, sha)
        return sha

    def _exchange(self, entries: list[Entry]) -> list[str]:
        problems: list[str] = []
        if self.rank == 0:
            header = json.dumps([e.__dict__ for e in entries]).encode()
            for dst in self.to:
                dist.send_bytes(header, dst)  # collective: point to point, rank 0 and this target only
                wanted = json.loads(dist.recv_bytes(dst))
                for i in wanted:
                    dist.send_bytes(Path(entries[i].path).read_bytes(), dst)
                problems += [f"rank {dst}: {p}" for p in json.loads(dist.recv_bytes(dst))]
        elif self.rank in self.to:
            problems = self._receive()
        return problems

    def _receive(self) -> list[str]:
        """A target's side of :meth:`_exchange`."""
        entries = [Entry(**e) for e in json.loads(dist.recv_bytes(0))]  # collective: point to point, from rank 0
        wanted = [i for i, e in enumerate(entries) if not self._holds(e)]
        dist.send_bytes(json.dumps(wanted).encode(), 0)
        problems = []
        for i in wanted:
            e = entries[i]
            data = dist.recv_bytes(0)
            try:
                self._check_place(Path(e.path))
                # _holds found the disk without these bytes: the file there is not hashed a second time
                if write_copy(Path(e.path), data, e.keep_previous, compared=True) and e.supersedes:
                    (Path(e.path).parent / e.supersedes).unlink(missing_ok=True)
                self._sha.pop(e.path, None)
            except (CheckpointError, OSError) as err:
                problems.append(str(err))
        dist.send_bytes(json.dumps(problems).encode(), 0)
        return problems

    def _holds(self, e: Entry) -> bool:
        path = Path(e.path)
        try:
            return path.is_file() and not path.is_symlink() and self._hash(path) == e.sha256
        except OSError:
            return False

    def _check_place(self, path: Path) -> None:
        """A path rank 0 names must be one of the record's, in this node's run folder (rank 0 is trusted to run
        the same code; its paths are still checked, so that no message can make a target write elsewhere)."""
        if self.save_dir is None:
            return
        where = path.parent.parent if path.parent.name == "weights" else path.parent
        ok_name = path.name in RECORD or path.name in ("last.pt", "mid.pt") or WEIGHTS_RECORD.fullmatch(path.name)
        if os.path.abspath(where) != os.path.abspath(self.save_dir) or not ok_name:
            raise CheckpointError(f"refused a copy to {excerpt(str(path), 80)}: not a file of this run's folder")


def write_copy(path: Path, data: bytes, keep_previous: str | None, compared: bool = False) -> bool:
    """``data`` into ``path`` on this node's disk, atomically (the folder made if needed, never through a link;
    the file there before kept as ``keep_previous``); False, and nothing written, where ``path`` already holds
    exactly ``data`` (a disk shared with node 0). ``compared``: the caller has found that it does not (the file is
    not read again). A folder that cannot take it is one line (CheckpointError)."""
    try:
        if not compared and path.is_file() and file_sha256(path) == hashlib.sha256(data).hexdigest():
            return False
        problem = run_dir_problem(path.parent.parent if path.parent.name == "weights" else path.parent)
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
