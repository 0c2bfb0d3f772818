"""Read back a W&B offline run folder (``offline-run-*/run-*.wandb``) without W&B's own reader (recent wandb
releases ship none in Python): the file is a 7-byte header (``:W&B``, a 2-byte magic, a version byte) followed by
32 KiB blocks of LevelDB-log records (crc32, 2-byte length, a type: full, first, middle, last), each record's data
one ``wandb.proto`` ``Record`` message.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

HEADER = 7
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    """Every Record message of a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", f"{path}: not a W&B run file"
    out, pending, pos = [], b"", HEADER
    while pos + 7 <= len(raw):
        left = BLOCK - (pos % BLOCK)
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        pending = data if kind in (FULL, FIRST) else pending + data
        if kind in (FULL, LAST):
            message = pb.Record()
            message.ParseFromString(pending)
            out.append(message)
            pending = b""
    return out


def history(path: Path) -> list[dict[str, Any]]:
    """Each logged row as {key: value}, with ``_step``."""
    rows = []
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return rows


def config(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind in ("run", "config"):
            update = r.run.config.update if kind == "run" else r.config.update
            out.update({i.key: json.loads(i.value_json) for i in update})
    return out


def artifacts(path: Path) -> list[tuple[str, str, list[str]]]:
    """(name, type, [file paths]) of each artifact the run logged."""
    out = []
    for r in records(path):
        if r.WhichOneof("record_type") == "artifact":
            out.append((r.artifact.name, r.artifact.type, [e.path for e in r.artifact.manifest.contents]))
    return out
