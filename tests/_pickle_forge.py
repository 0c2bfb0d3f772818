"""A tiny pickle assembler for hostile checkpoints: tests write the exact opcodes an attacker would.

``pickle.dumps`` can only write what Python objects reduce to; an attack needs opcodes no honest object
produces (BUILD on a numpy dtype with its flags cleared, a storage that lies about its size, ten thousand
classes). Each helper returns the bytes of one pushed value, so payloads read like the object they build:

    >>> data = proto() + dict_({"a": int_(1)}) + b"."
    >>> import pickle; pickle.loads(data)
    {'a': 1}
"""

from __future__ import annotations

import pickle
import struct
import zipfile
from pathlib import Path


def proto(n: int = 2) -> bytes:
    return pickle.PROTO + bytes([n])


def global_(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode("utf-8", "surrogatepass")


def str_(s: str) -> bytes:
    raw = s.encode("utf-8", "surrogatepass")
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def int_(n: int) -> bytes:
    if 0 <= n < 256:
        return pickle.BININT1 + bytes([n])
    if -(2**31) <= n < 2**31:
        return pickle.BININT + struct.pack("<i", n)
    raw = pickle.encode_long(n)
    if len(raw) < 256:
        return pickle.LONG1 + bytes([len(raw)]) + raw
    return pickle.LONG4 + struct.pack("<i", len(raw)) + raw


def bool_(b: bool) -> bytes:
    return pickle.NEWTRUE if b else pickle.NEWFALSE


def none() -> bytes:
    return pickle.NONE


def bytes_(b: bytes) -> bytes:
    """Bytes the way protocol 2 writes them: ``_codecs.encode(latin-1 text, 'latin1')``."""
    return reduce_(global_("_codecs", "encode"), str_(b.decode("latin1")), str_("latin1"))


def tuple_(*items: bytes) -> bytes:
    return pickle.MARK + b"".join(items) + pickle.TUPLE


def list_(*items: bytes) -> bytes:
    return pickle.EMPTY_LIST + (pickle.MARK + b"".join(items) + pickle.APPENDS if items else b"")


def dict_(items: dict[str, bytes]) -> bytes:
    body = b"".join(str_(k) + v for k, v in items.items())
    return pickle.EMPTY_DICT + (pickle.MARK + body + pickle.SETITEMS if items else b"")


def reduce_(fn: bytes, *args: bytes) -> bytes:
    """``fn(*args)``."""
    return fn + tuple_(*args) + pickle.REDUCE


def build(obj: bytes, state: bytes) -> bytes:
    """``obj`` with ``state`` applied by BUILD (``__setstate__``)."""
    return obj + state + pickle.BUILD


def inert(module: str, name: str, state: dict[str, bytes]) -> bytes:
    """An object of class ``module.name`` (NEWOBJ) with a ``__dict__`` state: how nn.Modules pickle."""
    return build(global_(module, name) + pickle.EMPTY_TUPLE + pickle.NEWOBJ, dict_(state))


def np_dtype(spec: str, state: bytes | None = None) -> bytes:
    """``numpy.dtype(spec, False, True)``, with a BUILD of ``state`` when given."""
    made = reduce_(global_("numpy", "dtype"), str_(spec), bool_(False), bool_(True))
    return build(made, state) if state is not None else made


def np_dtype_state(byteorder: str = "<", flags: int = 0) -> bytes:
    """What ``numpy.dtype.__reduce__`` gives as state for a plain numeric dtype (flags is the field attacks set)."""
    return tuple_(int_(3), str_(byteorder), none(), none(), none(), int_(-1), int_(-1), int_(flags))


def np_array(dtype: bytes, shape: tuple[int, ...], raw: bytes, multiarray: str = "numpy.core.multiarray") -> bytes:
    """``numpy.core.multiarray._reconstruct(ndarray, (0,), b'b')`` then BUILD ``(1, shape, dtype, False, raw)``."""
    empty = reduce_(global_(multiarray, "_reconstruct"), global_("numpy", "ndarray"), tuple_(int_(0)), bytes_(b"b"))
    state = tuple_(int_(1), tuple_(*(int_(s) for s in shape)), dtype, bool_(False), bytes_(raw))
    return build(empty, state)


def storage_tensor(key: str, numel: int, size: tuple[int, ...], storage: str = "HalfStorage") -> bytes:
    """``torch._utils._rebuild_tensor_v2`` over persistent storage ``key`` declaring ``numel`` elements."""
    pid = tuple_(str_("storage"), global_("torch", storage), str_(key), str_("cpu"), int_(numel))
    stride: list[int] = []
    step = 1
    for s in reversed(size):
        stride.insert(0, step)
        step *= s
    return reduce_(
        global_("torch._utils", "_rebuild_tensor_v2"),
        pid + pickle.BINPERSID,
        int_(0),
        tuple_(*(int_(s) for s in size)),
        tuple_(*(int_(s) for s in stride)),
        bool_(False),
        reduce_(global_("collections", "OrderedDict")),
    )


def write_torch_zip(
    path: Path,
    data_pkl: bytes,
    records: dict[str, bytes] | None = None,
    *,
    compression: int = zipfile.ZIP_STORED,
) -> Path:
    """A torch-style zip: ``<stem>/data.pkl``, ``<stem>/data/<key>`` records and the small version files."""
    stem = path.stem
    with zipfile.ZipFile(path, "w", compression=compression) as zf:
        zf.writestr(f"{stem}/data.pkl", data_pkl)
        zf.writestr(f"{stem}/byteorder", "little")
        for key, raw in (records or {}).items():
            zf.writestr(f"{stem}/data/{key}", raw)
        zf.writestr(f"{stem}/version", "3\n")
    return path


def ultralytics_model(**state: bytes) -> bytes:
    """A ``ultralytics.nn.tasks.DetectionModel`` record with the given ``__dict__`` entries (and empty module dicts)."""
    base = {"_parameters": dict_({}), "_buffers": dict_({}), "_modules": dict_({})}
    return inert("ultralytics.nn.tasks", "DetectionModel", {**base, **state})


def checkpoint(model: bytes, **extra: bytes) -> bytes:
    """A whole Ultralytics-shaped checkpoint pickle: ``{'model': model, ...}``, ending in STOP."""
    return proto() + dict_({"model": model, **extra}) + pickle.STOP
