"""Tensors and storages in a checkpoint, rebuilt by our own small functions from checked arguments.

torch pickles a tensor as ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`` where the
storage is a persistent id ``('storage', torch.HalfStorage, key, location, numel)`` naming zip record
``data/<key>``. The pickle's word on sizes is checked before anything is allocated:

- a storage's declared ``numel * itemsize`` must equal its zip record's size, the same key must always be
  declared alike, and all storages together stay under ``limits.MAX_TOTAL_BYTES``;
- a tensor view must lie inside its storage and hold no more elements than the storage (no stride-0
  views that a later ``.float()`` would blow up), with at most ``limits.MAX_TENSOR_DIMS`` dimensions.

Example (the calls a pickle of a 2 x 2 half tensor makes, by hand):
    >>> from pathlib import Path
    >>> torch.save(torch.arange(4, dtype=torch.half), "t.pt")
    >>> with TorchZip(Path("t.pt")) as tz:
    ...     storage = StorageReader(tz).load(("storage", StorageType(torch.half), "0", "cpu", 4))
    >>> rebuild_tensor_v2(storage, 0, (2, 2), (2, 1))
    tensor([[0., 1.],
            [2., 3.]], dtype=torch.float16)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from detrain.weights import limits
from detrain.weights.limits import Refused, shown, size_text
from detrain.weights.torch_zip import TorchZip

__all__ = ["DTYPES", "STORAGE_TYPES", "TORCH_GLOBALS", "Storage", "StorageReader", "StorageType"]

STORAGE_TYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
    "UntypedStorage": torch.uint8,
}

# dtypes as pickled (``torch.float16`` is GLOBAL torch float16). A fixed list rather than getattr(torch,
# name): torch's module __getattr__ imports submodules lazily, and a file should not choose what we import.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64 double float32 float float16 half bfloat16 int64 long int32 int int16 short int8 uint8 "
        "bool complex64 cfloat complex128 cdouble uint16 uint32 uint64 float8_e4m3fn float8_e5m2"
    ).split()
    if isinstance(getattr(torch, name, None), torch.dtype)
}

_ITEMSIZE: dict[torch.dtype, int] = {d: torch.empty((), dtype=d).element_size() for d in {*DTYPES.values()}}
_MAX_INDEX = 1 << 62  # any size, stride or offset past this overflows torch's int64 arithmetic anyway


class StorageType:
    """What a pickled ``torch.HalfStorage`` (etc.) global stands for: only its dtype matters."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class Storage:
    """One ``data/<key>`` record as a flat tensor of its dtype (shared by every view into it)."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        try:
            return value.decode("ascii")
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None


class StorageReader:
    """Serves the pickle's persistent ids from a checked :class:`TorchZip`, reading each record once."""

    def __init__(self, archive: TorchZip) -> None:
        self._archive = archive
        self._cache: dict[str, tuple[torch.dtype, int, Storage]] = {}
        self._declared = 0

    def load(self, pid: Any) -> Storage:
        # torch writes ('storage', StorageType, key, location, numel) for every storage it saves.
        if not (isinstance(pid, tuple) and len(pid) == 5):
            raise Refused("a persistent id that is not torch's ('storage', type, key, location, numel)")
        kind, storage_type, key, _location, numel = pid
        key = _text(key)
        if _text(kind) != "storage" or not isinstance(storage_type, StorageType):
            raise Refused("a persistent id that is not a torch storage")
        if key is None or not (0 < len(key) <= 32 and key.isascii() and key.isalnum()):
            raise Refused("a storage key that is not a short alphanumeric name")
        if not _is_int(numel) or not 0 <= numel < _MAX_INDEX:
            raise Refused(f"storage data/{key} declares {shown(numel)} elements")
        dtype = storage_type.dtype
        cached = self._cache.get(key)
        if cached is not None:
            if cached[:2] != (dtype, numel):
                raise Refused(f"storage data/{key} is declared twice with different types or sizes")
            return cached[2]
        nbytes = numel * _ITEMSIZE[dtype]
        record = self._archive.storage_nbytes(key)
        if record is None:
            raise Refused(f"its pickle names storage data/{key}, which the zip does not hold")
        if record != nbytes:  # checked before allocating: the record, not the pickle, says what is there
            raise Refused(f"storage data/{key} is declared as {nbytes} bytes but its zip record holds {record}")
        self._declared += nbytes
        if self._declared > limits.MAX_TOTAL_BYTES:
            raise Refused(f"its storages add up to more than the {size_text(limits.MAX_TOTAL_BYTES)} allowed")
        storage = Storage(self._read(key, nbytes, dtype))
        self._cache[key] = (dtype, numel, storage)
        return storage

    def _read(self, key: str, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        if not nbytes:
            return torch.empty(0, dtype=dtype)
        raw = self._archive.read_storage(key, nbytes)
        # A numpy copy: aligned for every dtype (a bytearray need not be), and cheaper than clone().
        flat = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
        itemsize = _ITEMSIZE[dtype]
        if self._archive.byteorder != sys.byteorder and itemsize > 1:  # reverse the bytes of every element
            flat = flat.view(-1, itemsize).flip(1).reshape(-1)
        return flat.view(dtype)


# --------------------------------------------------------------------------------------------------
# Reconstructors the pickle may call
# --------------------------------------------------------------------------------------------------


def _int_tuple(value: Any, what: str, max_len: int) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list, torch.Size)) or len(value) > max_len:
        raise Refused(f"a {what} that is not a tuple of at most {max_len} integers")
    if not all(_is_int(v) and -_MAX_INDEX < v < _MAX_INDEX for v in value):
        raise Refused(f"a {what} holding something other than integers of a sane size")
    return tuple(value)


def rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any) -> torch.Tensor:
    if not isinstance(storage, Storage):
        raise Refused("a tensor without a storage record")
    size_t = _int_tuple(size, "tensor size", limits.MAX_TENSOR_DIMS)
    stride_t = _int_tuple(stride, "tensor stride", limits.MAX_TENSOR_DIMS)
    available = storage.flat.numel()
    if not _is_int(storage_offset) or not 0 <= storage_offset <= available:
        raise Refused("a tensor whose storage offset lies outside its storage")
    if len(size_t) != len(stride_t) or any(s < 0 for s in size_t + stride_t):
        raise Refused("a tensor with negative sizes or strides, or as many strides as sizes")
    numel = 1
    for s in size_t:
        numel *= s
    if numel:
        # The largest element a view touches must lie inside its storage: as_strided would read past it.
        last = storage_offset + sum((s - 1) * st for s, st in zip(size_t, stride_t))
        if last >= available or numel > available:
            raise Refused(f"a tensor of shape {size_t} that reaches past its storage of {available} elements")
    return storage.flat.as_strided(size_t, stride_t, storage_offset)


def rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> torch.Tensor:
    # requires_grad, hooks and metadata (conj/neg bits) are ignored on purpose: we want plain weights.
    return rebuild_tensor(storage, storage_offset, size, stride)


def rebuild_tensor_v3(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> torch.Tensor:
    if not isinstance(dtype, torch.dtype) or dtype not in _ITEMSIZE:
        raise Refused("a tensor whose dtype is not a torch dtype")
    if not isinstance(storage, Storage):
        raise Refused("a tensor without a storage record")
    flat = storage.flat
    if flat.dtype != dtype:
        raw = flat.view(torch.uint8)
        if raw.numel() % _ITEMSIZE[dtype]:
            raise Refused(f"a {dtype} tensor over a storage of {raw.numel()} bytes")
        flat = raw.view(dtype)
    return rebuild_tensor(Storage(flat), storage_offset, size, stride)


def rebuild_parameter(data: Any, requires_grad: Any = False, backward_hooks: Any = None, *_: Any) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise Refused("a parameter without a tensor")
    return data  # a Parameter is only a flag on a tensor; state_dict() values are plain tensors anyway


def torch_size(dims: Any = ()) -> torch.Size:
    return torch.Size(_int_tuple(dims, "torch.Size", 64))


def torch_device(kind: Any, index: Any = None) -> torch.device:
    if not (isinstance(kind, str) and len(kind) <= 32 and (index is None or (_is_int(index) and 0 <= index < 1024))):
        raise Refused("a torch.device that is not a short name and a small index")
    return torch.device(kind) if index is None else torch.device(kind, index)


TORCH_GLOBALS: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch._utils", "_rebuild_tensor"): rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): rebuild_parameter,
    ("torch", "Size"): torch_size,
    ("torch", "device"): torch_device,
}
