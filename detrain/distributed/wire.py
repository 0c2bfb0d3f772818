"""What the ranks send each other in their object collectives: plain data, arrays and tensors, never a pickle.

``dist.all_gather_object`` and ``dist.broadcast_object`` carry Python values from one rank to others. torch's own
object collectives pickle them, and unpickling runs whatever the bytes name: one rank (a compromised node, a process
that got into the group) could run code on every other. Here a value becomes a message of this module's own format,
and the receiver only ever builds data from it:

* plain data: ``None``, ``bool``, ``int``, ``float`` (NaN and infinities included), ``str``, ``bytes``, and
  ``list``, ``tuple``, ``dict`` (any of these as keys), ``set`` and ``frozenset`` of them, ``pathlib.Path``;
* numpy arrays and numpy scalars, and torch tensors (rebuilt on the CPU), of the numeric dtypes in :data:`DTYPES`
  (no object arrays): the dtype's name, the shape and the raw bytes, whose length must be what they say;
* dataclasses marked with :func:`carried` (their fields, each a value of this list), rebuilt by name from that
  registry without calling anything of theirs, as pickle rebuilds them;
* detrain's own errors (:class:`detrain.errors.DetrainError` and the subclasses defined in this process), rebuilt
  from their arguments.

No name read from a message is ever imported: a type not in the receiver's registry is refused. A message is
``DTW1``, the length of its JSON header, the header (the value's tree, the length of each blob) and the blobs
(arrays, tensors, bytes), checked before anything is built: lengths add up, nesting and counts are bounded, every
array's bytes match its shape and dtype. Anything else (a pickle, a truncated or forged message) is
:class:`WireError`, one line.

>>> import numpy as np
>>> back = decode(encode({"a": (1, 2.5, None), 3: np.arange(3, dtype=np.int32), "b": b"x"}))
>>> back["a"], back[3].dtype, back[3].tolist(), back["b"]
((1, 2.5, None), dtype('int32'), [0, 1, 2], b'x')
>>> decode(b"\\x80\\x04\\x95...")
Traceback (most recent call last):
    ...
detrain.distributed.wire.WireError: not a detrain message (it starts b'\\x80\\x04\\x95.': a pickle?); refused
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from detrain.errors import DetrainError

MAGIC = b"DTW1"
MAX_MESSAGE = 16 << 30  # bytes: a resumed run's checkpoint and run record (each bounded at 4 GiB) fit with room
MAX_HEADER = 256 << 20  # bytes of JSON: the per-image statistics of a 1.5-million-image validation split
MAX_DEPTH = 64  # nested containers; detrain's own values go 6 deep
MAX_NODES = 50_000_000  # values in one message
MAX_DIMS = 32  # numpy's own limit on an array's dimensions

# numpy / torch dtypes a message may carry, by the name it carries (little-endian on the wire)
DTYPES: dict[str, tuple[np.dtype[Any] | None, torch.dtype]] = {
    "bool": (np.dtype(np.bool_), torch.bool),
    "int8": (np.dtype("<i1"), torch.int8),
    "int16": (np.dtype("<i2"), torch.int16),
    "int32": (np.dtype("<i4"), torch.int32),
    "int64": (np.dtype("<i8"), torch.int64),
    "uint8": (np.dtype("<u1"), torch.uint8),
    "uint16": (np.dtype("<u2"), torch.uint16),
    "uint32": (np.dtype("<u4"), torch.uint32),
    "uint64": (np.dtype("<u8"), torch.uint64),
    "float16": (np.dtype("<f2"), torch.float16),
    "float32": (np.dtype("<f4"), torch.float32),
    "float64": (np.dtype("<f8"), torch.float64),
    "bfloat16": (None, torch.bfloat16),  # torch only
}
_TORCH_NAMES = {t: name for name, (_, t) in DTYPES.items()}
_PATH = type(Path())  # PosixPath here
_CONTAINER_TAGS: dict[type, str] = {list: "l", tuple: "t", set: "s", frozenset: "z"}

T = TypeVar("T")
_CARRIED: dict[str, type] = {}


class WireError(ValueError):
    """A message that is not one this module made, or that breaks one of its bounds: refused, nothing built."""


def carried(cls: type[T]) -> type[T]:
    """Mark the dataclass ``cls`` as one a collective may carry (a class decorator). The receiver rebuilds it from
    its fields without calling ``__init__`` (as pickle does); the fields' values must be carried values too.

    >>> @carried
    ... @dataclasses.dataclass(frozen=True)
    ... class Fit:
    ...     images: int
    >>> decode(encode(Fit(3)))
    Fit(images=3)
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__qualname__} is not a dataclass")
    _CARRIED[_name(cls)] = cls  # a module loaded again replaces its classes
    return cls


# --------------------------------------------------------------------------------------------------- encode


def encode(value: Any) -> bytes:
    """``value`` as one message. A value of a type this module does not carry is a TypeError naming the type (a
    mistake in the sender's code, not something a peer did)."""
    blobs: list[bytes] = []
    tree = _Encoder(blobs).tree(value, 0)
    header = json.dumps({"v": tree, "b": [len(b) for b in blobs]}, separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<Q", len(header)), header, *blobs])


class _Encoder:
    def __init__(self, blobs: list[bytes]) -> None:
        self.blobs = blobs

    def blob(self, data: bytes) -> int:
        self.blobs.append(data)
        return len(self.blobs) - 1

    def tree(self, v: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise TypeError(f"a value nested more than {MAX_DEPTH} deep cannot be sent")
        t = type(v)
        if v is None or t in (bool, int, str):
            return v
        if t is float:
            return v if math.isfinite(v) else ["f", repr(v)]
        if t in (list, tuple, set, frozenset):
            return [_CONTAINER_TAGS[t], [self.tree(x, depth + 1) for x in v]]
        if t is dict:
            return ["d", [[self.tree(k, depth + 1), self.tree(x, depth + 1)] for k, x in v.items()]]
        if t is bytes:
            return ["b", self.blob(v)]
        if t is _PATH:
            return ["p", str(v)]
        if t is np.ndarray:
            raw = v.astype(v.dtype.newbyteorder("<"), order="C", copy=False).tobytes()
            return ["a", _numpy_name(v.dtype), list(v.shape), self.blob(raw)]
        if isinstance(v, np.generic):
            return ["n", _numpy_name(v.dtype), v.item()]
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        if isinstance(v, DetrainError) and _DETRAIN_ERRORS().get(_name(t)) is t:
            state = [[k, self.tree(x, depth + 1)] for k, x in vars(v).items()]
            return ["e", _name(t), [self.tree(x, depth + 1) for x in v.args], state]
        if dataclasses.is_dataclass(v) and _CARRIED.get(_name(t)) is t:
            fields = [[f.name, self.tree(getattr(v, f.name), depth + 1)] for f in dataclasses.fields(v)]
            return ["c", _name(t), fields]
        raise TypeError(f"a collective cannot carry a {t.__module__}.{t.__qualname__} (see detrain.distributed.wire)")

    def tensor(self, v: torch.Tensor) -> Any:
        if v.dtype not in _TORCH_NAMES:
            raise TypeError(f"a collective cannot carry a tensor of {v.dtype}")
        flat = v.detach().to("cpu").contiguous().reshape(-1)
        raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return ["g", _TORCH_NAMES[v.dtype], list(v.shape), self.blob(raw), bool(v.requires_grad)]


def _numpy_name(dtype: np.dtype[Any]) -> str:
    name = dtype.name
    if name not in DTYPES or DTYPES[name][0] is None:
        raise TypeError(f"a collective cannot carry a numpy array of dtype {dtype}")
    return name


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _DETRAIN_ERRORS() -> dict[str, type]:
    """detrain's errors defined in this process, by name: DetrainError and every subclass of it."""
    out: dict[str, type] = {}
    todo: list[type] = [DetrainError]
    while todo:
        cls = todo.pop()
        out[_name(cls)] = cls
        todo.extend(cls.__subclasses__())
    return out


# --------------------------------------------------------------------------------------------------- decode


def decode(data: bytes | bytearray | memoryview) -> Any:
    """The value :func:`encode` made ``data`` of; :class:`WireError` (one line) for anything else."""
    view = memoryview(data).cast("B")
    if len(view) > MAX_MESSAGE:
        raise WireError(f"a message of {len(view)} bytes is over the bound of {MAX_MESSAGE}; refused")
    if bytes(view[:4]) != MAGIC:
        start = bytes(view[:4])
        hint = ": a pickle?" if start[:1] == b"\x80" else ""
        raise WireError(f"not a detrain message (it starts {start!r}{hint}); refused")
    if len(view) < 12:
        raise WireError("a message shorter than its own header; refused")
    (size,) = struct.unpack("<Q", view[4:12])
    if size > min(MAX_HEADER, len(view) - 12):
        raise WireError(f"a message whose header claims {size} bytes, of {len(view) - 12} there; refused")
    try:
        header = json.loads(bytes(view[12 : 12 + size]))
    except (ValueError, RecursionError) as e:
        raise WireError(f"a message whose header is not JSON ({str(e)[:80]}); refused") from None
    if not isinstance(header, dict) or set(header) != {"v", "b"} or not isinstance(header["b"], list):
        raise WireError("a message whose header is not {v, b}; refused")
    lengths = header["b"]
    if not all(type(n) is int and n >= 0 for n in lengths) or sum(lengths) != len(view) - 12 - size:
        raise WireError(f"a message whose blobs do not add up to its {len(view) - 12 - size} bytes; refused")
    starts = [12 + size]
    for n in lengths:
        starts.append(starts[-1] + n)
    blobs = [view[starts[i] : starts[i + 1]] for i in range(len(lengths))]
    try:
        return _Decoder(blobs).value(header["v"], 0)
    except WireError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, OverflowError, RecursionError) as e:
        raise WireError(f"a malformed message ({type(e).__name__}: {str(e)[:120]}); refused") from None


class _Decoder:
    def __init__(self, blobs: list[memoryview]) -> None:
        self.blobs = blobs
        self.used = [False] * len(blobs)
        self.nodes = 0

    def blob(self, index: Any) -> memoryview:
        if type(index) is not int or not 0 <= index < len(self.blobs) or self.used[index]:
            raise WireError(f"a message names blob {str(index)[:20]}, which is not one of its unused ones; refused")
        self.used[index] = True
        return self.blobs[index]

    def value(self, v: Any, depth: int) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES or depth > MAX_DEPTH:
            raise WireError(f"a message of more than {MAX_NODES} values or {MAX_DEPTH} levels; refused")
        if v is None or type(v) in (bool, int, str, float):
            return v
        if type(v) is not list or not v or type(v[0]) is not str:
            raise WireError(f"a message holds {type(v).__name__} where a tagged value belongs; refused")
        tag, args = v[0], v[1:]
        if tag in ("l", "t", "s", "z") and len(args) == 1 and type(args[0]) is list:
            items = [self.value(x, depth + 1) for x in args[0]]
            return {"l": list, "t": tuple, "s": set, "z": frozenset}[tag](items)
        if tag == "d" and len(args) == 1 and type(args[0]) is list:
            pairs = args[0]
            if not all(type(p) is list and len(p) == 2 for p in pairs):
                raise WireError("a message holds a dict entry that is not a pair; refused")
            return {self.value(k, depth + 1): self.value(x, depth + 1) for k, x in pairs}
        if tag == "f" and args in (["nan"], ["inf"], ["-inf"]):
            return float(args[0])
        if tag == "b" and len(args) == 1:
            return bytes(self.blob(args[0]))
        if tag == "p" and len(args) == 1 and type(args[0]) is str:
            return Path(args[0])
        if tag == "a" and len(args) == 3:
            return self.array(*args)
        if tag == "n" and len(args) == 2:
            return self.scalar(*args)
        if tag == "g" and len(args) == 4:
            return self.tensor(*args)
        if tag == "c" and len(args) == 2:
            return self.dataclass(args[0], args[1], depth)
        if tag == "e" and len(args) == 3:
            return self.error(args[0], args[1], args[2], depth)
        raise WireError(f"a message holds an unknown value {_shown(v)}; refused")

    def array(self, dtype: Any, shape: Any, index: Any) -> np.ndarray:
        np_dtype = _numpy_dtype(dtype)
        raw = self.blob(index)
        _check_bytes(shape, np_dtype.itemsize, len(raw))
        return np.frombuffer(raw, dtype=np_dtype).reshape(shape).astype(np_dtype.newbyteorder("="))

    def scalar(self, dtype: Any, item: Any) -> np.generic:
        np_dtype = _numpy_dtype(dtype)
        if type(item) not in (bool, int, float):
            raise WireError(f"a numpy {dtype} scalar holds {type(item).__name__}; refused")
        return np_dtype.type(item)

    def tensor(self, dtype: Any, shape: Any, index: Any, grad: Any) -> torch.Tensor:
        if dtype not in DTYPES or type(grad) is not bool:
            raise WireError(f"a message holds a tensor of dtype {_shown(dtype)}; refused")
        t_dtype = DTYPES[dtype][1]
        raw = self.blob(index)
        _check_bytes(shape, t_dtype.itemsize, len(raw))
        out = torch.frombuffer(bytearray(raw), dtype=t_dtype) if len(raw) else torch.empty(0, dtype=t_dtype)
        out = out.reshape(shape)
        return out.requires_grad_(grad) if grad and out.is_floating_point() else out

    def dataclass(self, name: Any, fields: Any, depth: int) -> Any:
        cls = _CARRIED.get(name) if type(name) is str else None
        if cls is None:
            raise WireError(f"a message holds a {_shown(name)}, which this process does not carry; refused")
        expected = [f.name for f in dataclasses.fields(cls)]
        if type(fields) is not list or [p[0] if type(p) is list and len(p) == 2 else None for p in fields] != expected:
            raise WireError(f"a message holds a {name} whose fields are not {expected}; refused")
        obj: Any = object.__new__(cls)
        for key, raw in fields:
            object.__setattr__(obj, key, self.value(raw, depth + 1))
        return obj

    def error(self, name: Any, args: Any, state: Any, depth: int) -> DetrainError:
        cls = _DETRAIN_ERRORS().get(name) if type(name) is str else None
        if cls is None or type(args) is not list or type(state) is not list:
            raise WireError(f"a message holds an error {_shown(name)} that is not one of detrain's; refused")
        made = cls(*(self.value(a, depth + 1) for a in args))
        for pair in state:
            if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not str or pair[0].startswith("__"):
                raise WireError(f"a message holds a {name} with a bad attribute; refused")
            setattr(made, pair[0], self.value(pair[1], depth + 1))
        return made


def _numpy_dtype(name: Any) -> np.dtype[Any]:
    spec = DTYPES.get(name) if type(name) is str else None
    if spec is None or spec[0] is None:
        raise WireError(f"a message holds an array of dtype {_shown(name)}; refused")
    return spec[0]


def _check_bytes(shape: Any, itemsize: int, nbytes: int) -> None:
    """The shape is a list of at most MAX_DIMS sizes whose product times ``itemsize`` is ``nbytes``."""
    if type(shape) is not list or len(shape) > MAX_DIMS or not all(type(s) is int and s >= 0 for s in shape):
        raise WireError(f"a message holds an array of shape {_shown(shape)}; refused")
    count = math.prod(shape)
    if count * itemsize != nbytes:
        raise WireError(f"a message holds an array of shape {shape} in {nbytes} bytes; refused")


def _shown(v: Any) -> str:
    return repr(v)[:60]
