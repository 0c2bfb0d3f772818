"""A run's record, carried with the checkpoint it resumes from when rank 0 is on another node than that checkpoint.

Nodes share no disk, and rank 0 alone writes the run folder. When a start resumes from a checkpoint that another
node holds (rank 0 moved: torchrun or srun numbered the nodes of a re-formed group otherwise), that node sends,
with the checkpoint, what its run folder says of the run so far: ``results.csv``, ``events.jsonl``,
``manifest.json`` and ``weights/best.pt``. Rank 0 puts them in its own run folder before it writes anything, so
the folder it goes on in holds the run's whole history, each epoch once (``results.csv`` keeps the rows up to
the checkpoint's epoch, as after any resume).

The files are read from the holder's disk, which is as hostile as any: only regular files (no symlink is
followed, no FIFO blocks the read), each up to its size limit; an ``events.jsonl`` over its limit travels as its
last whole lines. Received, each known name is written atomically; anything else in a record is ignored.

>>> import tempfile, pathlib
>>> a, b = pathlib.Path(tempfile.mkdtemp()), pathlib.Path(tempfile.mkdtemp())
>>> _ = (a / "results.csv").write_text("epoch\\n1\\n")
>>> restore(b, collect(a)); (b / "results.csv").read_text()
'epoch\\n1\\n'
"""

from __future__ import annotations

from pathlib import Path

from detrain.log import atomic_write_bytes
from detrain.system.file_tail import read_regular

# what travels (path in the run folder -> the most bytes read); a run's results and manifest are small, its
# events grow by a few lines an epoch, best.pt is the model and its EMA
LIMITS = {"results.csv": 16 << 20, "events.jsonl": 64 << 20, "manifest.json": 1 << 20, "weights/best.pt": 4 << 30}
TAIL = ("events.jsonl",)  # over its limit: its last whole lines (the others: not sent)


def collect(folder: str | Path) -> dict[str, bytes]:
    """The record's files that ``folder`` holds as regular files, by their path in it."""
    out: dict[str, bytes] = {}
    for name, limit in LIMITS.items():
        data = read_regular(Path(folder) / name, limit, tail=name in TAIL)
        if data is not None:
            out[name] = data
    return out


def restore(folder: str | Path, record: object) -> None:
    """Write a received record's files into ``folder``, each atomically (rank 0, before the run writes there)."""
    if not isinstance(record, dict):
        return
    for name, limit in LIMITS.items():
        data = record.get(name)
        if isinstance(data, bytes) and len(data) <= limit:
            atomic_write_bytes(Path(folder) / name, data)
