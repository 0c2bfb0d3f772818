"""Zip-level mutations of a torch checkpoint: records truncated, dropped, duplicated or recompressed, header
fields rewritten, bytes flipped, NaN or infinity written into a tensor. Each takes a seeded ``random.Random`` and
returns the new file's bytes.

A checkpoint is handled as its list of records (name, bytes), rebuilt with :func:`write_zip` (stored, as torch
writes them, fixed timestamps so a seed always gives the same bytes), or as the finished file's bytes.

Example:
    >>> records = read_records(Path("yolov8n.pt"))                       # doctest: +SKIP
    >>> data = MUTATIONS["record_truncate"](random.Random(0), records)   # doctest: +SKIP
"""

from __future__ import annotations

import io
import random
import re
import struct
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["MUTATIONS", "Record", "read_records", "write_zip"]

Record = tuple[str, bytes]
_EPOCH = (2026, 11, 24, 0, 0, 0)


def read_records(path: Path) -> list[Record]:
    """Every record of a (trusted) zip, in the archive's order."""
    with zipfile.ZipFile(path) as zf:
        return [(info.filename, zf.read(info)) for info in zf.infolist()]


def write_zip(records: list[Record], methods: list[int] | None = None, level: int | None = None) -> bytes:
    """The records as a zip (stored unless ``methods`` gives each one's compression); duplicates allowed."""
    out = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Duplicate name": on purpose
        with zipfile.ZipFile(out, "w") as zf:
            for i, (name, data) in enumerate(records):
                info = zipfile.ZipInfo(name, date_time=_EPOCH)
                info.compress_type = methods[i] if methods else zipfile.ZIP_STORED
                zf.writestr(info, data, compresslevel=level)
    return out.getvalue()


def _pick(rng: random.Random, records: list[Record]) -> int:
    """A record index, data.pkl a quarter of the time (the one every load reads)."""
    pkl = [i for i, (name, _) in enumerate(records) if name.endswith("data.pkl")]
    return pkl[0] if pkl and rng.random() < 0.25 else rng.randrange(len(records))


def truncate_file(rng: random.Random, records: list[Record]) -> bytes:
    """The whole file cut short, half the time within its last 2 KB (the central directory)."""
    data = write_zip(records)
    cut = len(data) - rng.randrange(1, 2048) if rng.random() < 0.5 else rng.randrange(len(data))
    return data[: max(0, cut)]


def truncate_record(rng: random.Random, records: list[Record]) -> bytes:
    """One record shorter (or a few bytes longer), written as a well-formed zip."""
    i = _pick(rng, records)
    name, data = records[i]
    if rng.random() < 0.8 and data:
        data = data[: rng.randrange(len(data))]
    else:
        data = data + rng.randbytes(rng.randrange(1, 64))
    return write_zip(records[:i] + [(name, data)] + records[i + 1 :])


def drop_record(rng: random.Random, records: list[Record]) -> bytes:
    i = _pick(rng, records)
    return write_zip(records[:i] + records[i + 1 :])


def duplicate_record(rng: random.Random, records: list[Record]) -> bytes:
    """A second record under an existing name: same or other bytes, next to it or at the end."""
    i = _pick(rng, records)
    name, data = records[i]
    twin = (name, data if rng.random() < 0.5 else records[rng.randrange(len(records))][1])
    at = i + 1 if rng.random() < 0.5 else len(records)
    return write_zip(records[:at] + [twin] + records[at:])


def recompress(rng: random.Random, records: list[Record]) -> bytes:
    """Deflate all records or some of them: a different but valid file, which must still load."""
    share = 1.0 if rng.random() < 0.5 else rng.random()
    methods = [zipfile.ZIP_DEFLATED if rng.random() < share else zipfile.ZIP_STORED for _ in records]
    return write_zip(records, methods, level=rng.randrange(10))


# (offset in the header, field size) of the fields worth lying in, per header signature
_FIELDS = {
    b"PK\x03\x04": [(6, 2), (8, 2), (14, 4), (18, 4), (22, 4), (26, 2), (28, 2)],  # local header
    b"PK\x01\x02": [(8, 2), (10, 2), (16, 4), (20, 4), (24, 4), (28, 2), (30, 2), (32, 2), (42, 4)],  # directory
    b"PK\x05\x06": [(8, 2), (10, 2), (12, 4), (16, 4), (20, 2)],  # end of central directory
}


def _lie(rng: random.Random, old: int, size: int) -> int:
    top = (1 << (8 * size)) - 1
    choices = [0, 1, top, top - 1, old + 1, old - 1, old * 2, old // 2, 8, 12, 14, 99, rng.randrange(top + 1)]
    return min(max(rng.choice(choices), 0), top)


def patch_header(rng: random.Random, records: list[Record]) -> bytes:
    """One field of one local header, directory entry or end record set to a lie: sizes, offsets, method,
    flags (encryption, data descriptor), CRC, name and extra lengths, record counts."""
    data = bytearray(write_zip(records))
    signature = rng.choice(list(_FIELDS))
    spots = [m.start() for m in re.finditer(re.escape(signature), data)]
    if not spots:
        return bytes(data)
    at = rng.choice(spots)
    offset, size = rng.choice(_FIELDS[signature])
    if at + offset + size > len(data):
        return bytes(data)
    fmt = "<H" if size == 2 else "<I"
    (old,) = struct.unpack_from(fmt, data, at + offset)
    struct.pack_into(fmt, data, at + offset, _lie(rng, old, size))
    return bytes(data)


def flip_bytes(rng: random.Random, records: list[Record]) -> bytes:
    """1-16 random bytes of the finished file XORed with a random non-zero byte."""
    data = bytearray(write_zip(records))
    for _ in range(rng.randint(1, 16)):
        data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
    return bytes(data)


# 4 bytes that read as NaN or infinity whether a float32 or two float16 values sit there (little-endian)
_NONFINITE = [b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x00\x80\xff", b"\x00\x7e\x00\x7c"]


def nonfinite_weights(rng: random.Random, records: list[Record]) -> bytes:
    """NaN or infinity written into 1-4 places of one tensor record (``data/<key>``): a float weight that no longer
    is finite must be refused in one line naming it (an integer record just holds another number)."""
    tensors = [i for i, (name, data) in enumerate(records) if "/data/" in name and len(data) >= 4]
    if not tensors:
        return write_zip(records)
    i = rng.choice(tensors)
    name, data = records[i]
    patched = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        at = 4 * rng.randrange(len(data) // 4)
        patched[at : at + 4] = rng.choice(_NONFINITE)
    return write_zip(records[:i] + [(name, bytes(patched))] + records[i + 1 :])


MUTATIONS: dict[str, Callable[[random.Random, list[Record]], bytes]] = {
    "zip_truncate": truncate_file,
    "record_truncate": truncate_record,
    "record_drop": drop_record,
    "record_duplicate": duplicate_record,
    "recompress": recompress,
    "header_patch": patch_header,
    "byte_flip": flip_bytes,
    "weight_nonfinite": nonfinite_weights,
}
