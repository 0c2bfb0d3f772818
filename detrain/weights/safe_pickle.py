"""Read torch zip checkpoints with a restricted unpickler: nothing named in the file is imported or run.

A torch ``.pt`` (torch >= 1.6) is a zip archive: ``<archive>/data.pkl`` pickles the saved object, and each
tensor's bytes live in ``<archive>/data/<key>``. A plain ``torch.load(weights_only=False)`` would import every
class the pickle names and let it call any function, so a downloaded file could run code. Here the pickle is
read by :class:`_RestrictedUnpickler`:

- a short allow-list of reconstructors (tensors, parameters, storages, ``torch.Size``, dtypes,
  ``OrderedDict``, ``set`` ...) is served by *our own* small functions that check their arguments;
- classes from namespaces that only hold data for us (``torch.nn.modules.*``, ``types.SimpleNamespace``,
  plus the caller's ``inert_modules`` such as ``ultralytics``) become :class:`InertObject` records (see
  :mod:`detrain.weights.inert`) that keep their constructor arguments and ``__setstate__`` state and never
  call anything;
- any other global (``os.system``, ``builtins.eval``, ``subprocess.Popen``, ``functools.partial`` ...)
  stops the load with :class:`~detrain.errors.CheckpointError` before it can be called.

What the records mean (which one is the model, how to name its weights) is for the caller:
:mod:`detrain.weights.ultralytics` maps YOLOv8 checkpoints.

Example:
    >>> ckpt = read_torch_zip("yolov8n.pt", inert_modules=("ultralytics",))   # doctest: +SKIP
    >>> type(ckpt["model"]).__name__                                           # doctest: +SKIP
    'DetectionModel'
"""

from __future__ import annotations

import _compat_pickle  # the stdlib's own table of Python 2 -> 3 names, used by pickle
import io
import pickle
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from detrain.errors import CheckpointError
from detrain.weights.inert import InertObject, inert_class, is_inert_namespace

__all__ = ["InertObject", "read_torch_zip"]

# --------------------------------------------------------------------------------------------------
# Safe reconstructors: our own code, called by the pickle with arguments we check
# --------------------------------------------------------------------------------------------------

_STORAGE_DTYPES: dict[str, torch.dtype] = {
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
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64 double float32 float float16 half bfloat16 int64 long int32 int int16 short int8 uint8 "
        "bool complex64 cfloat complex128 cdouble uint16 uint32 uint64 float8_e4m3fn float8_e5m2"
    ).split()
    if isinstance(getattr(torch, name, None), torch.dtype)
}


class _StorageType:
    """What a pickled ``torch.HalfStorage`` (etc.) global stands for: only its dtype matters."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class _Storage:
    """One ``data/<key>`` record as a flat tensor of its dtype (shared by every view into it)."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat


class _Refused(Exception):
    """Raised inside the unpickler for a forbidden request; becomes "refusing to load <file>: <reason>"."""


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise pickle.UnpicklingError(what)


def _to_int_tuple(value: Any, what: str) -> tuple[int, ...]:
    _check(isinstance(value, (tuple, list, torch.Size)), f"{what} is not a tuple")
    _check(all(isinstance(v, int) and not isinstance(v, bool) for v in value), f"{what} holds non-integers")
    return tuple(value)


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any) -> torch.Tensor:
    _check(isinstance(storage, _Storage), "tensor without a storage record")
    _check(isinstance(storage_offset, int) and storage_offset >= 0, "bad storage offset")
    size_t = _to_int_tuple(size, "tensor size")
    stride_t = _to_int_tuple(stride, "tensor stride")
    _check(len(size_t) == len(stride_t), "size and stride differ in length")
    _check(all(s >= 0 for s in size_t) and all(s >= 0 for s in stride_t), "negative size or stride")
    # The largest element a view touches must lie inside its storage: as_strided would read past it.
    numel = 1
    for s in size_t:
        numel *= s
    if numel:
        last = storage_offset + sum((s - 1) * st for s, st in zip(size_t, stride_t))
        _check(last < storage.flat.numel(), "tensor view reaches past its storage")
    return storage.flat.as_strided(size_t, stride_t, storage_offset)


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> torch.Tensor:
    # requires_grad, hooks and metadata (conj/neg bits) are ignored on purpose: we want plain weights.
    return _rebuild_tensor(storage, storage_offset, size, stride)


def _rebuild_tensor_v3(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> torch.Tensor:
    _check(isinstance(dtype, torch.dtype), "bad tensor dtype")
    _check(isinstance(storage, _Storage), "tensor without a storage record")
    flat = storage.flat if storage.flat.dtype == dtype else storage.flat.view(torch.uint8).view(dtype)
    return _rebuild_tensor(_Storage(flat), storage_offset, size, stride)


def _rebuild_parameter(data: Any, requires_grad: Any = False, backward_hooks: Any = None, *_: Any) -> torch.Tensor:
    _check(isinstance(data, torch.Tensor), "parameter without a tensor")
    return data  # a Parameter is only a flag on a tensor; state_dict() values are plain tensors anyway


def _ordered_dict(*args: Any) -> OrderedDict:
    _check(len(args) <= 1, "OrderedDict with extra arguments")
    if not args:
        return OrderedDict()
    items = args[0]
    _check(isinstance(items, (list, tuple, dict)), "OrderedDict from a non-container")
    return OrderedDict(items)


def _container(kind: type) -> Callable[..., Any]:
    def build(*args: Any) -> Any:
        _check(len(args) <= 1, f"{kind.__name__} with extra arguments")
        if not args:
            return kind()
        _check(isinstance(args[0], (list, tuple, set, frozenset)), f"{kind.__name__} from a non-container")
        return kind(args[0])

    return build


def _slice(*args: Any) -> slice:
    _check(len(args) <= 3 and all(a is None or isinstance(a, int) for a in args), "bad slice")
    return slice(*args)


def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    _check(isinstance(real, (int, float)) and isinstance(imag, (int, float)), "bad complex")
    return complex(real, imag)


def _codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    # Protocol 2 pickles bytes as _codecs.encode(str, "latin1"); nothing else is needed.
    _check(isinstance(text, str) and encoding in ("latin1", "latin-1"), "bad bytes record")
    return text.encode("latin1")


def _torch_size(dims: Any = ()) -> torch.Size:
    return torch.Size(_to_int_tuple(dims, "torch.Size"))


def _torch_device(kind: Any, index: Any = None) -> torch.device:
    _check(isinstance(kind, str) and (index is None or isinstance(index, int)), "bad torch.device")
    return torch.device(kind) if index is None else torch.device(kind, index)


def _reconstructor(cls: Any, base: Any, state: Any) -> Any:
    # copyreg._reconstructor(cls, object, None) is how protocols 0/1 pickle plain objects.
    _check(isinstance(cls, type) and issubclass(cls, InertObject) and base is object, "bad copyreg record")
    return cls.__new__(cls)


_NDARRAY = object()  # stands for numpy.ndarray: only ever an argument of _reconstruct, never called


def _numpy_reconstructors(module: str, name: str) -> Any | None:
    """numpy's own scalar/array/dtype rebuilders, guarded so they only ever build plain data."""
    if module not in ("numpy", "numpy.core.multiarray", "numpy._core.multiarray"):
        return None
    def dtype(spec: Any, align: Any = False, copy: Any = True) -> Any:
        _check(isinstance(spec, str), "bad numpy dtype")
        return np.dtype(spec, bool(align), True)  # always a copy: BUILD must never touch numpy's singletons

    def scalar(dt: Any, data: Any = None) -> Any:
        _check(isinstance(dt, np.dtype) and not dt.hasobject and isinstance(data, bytes), "bad numpy scalar")
        return np.frombuffer(data, dtype=dt, count=1)[0]

    def reconstruct(subtype: Any, shape: Any, typecode: Any) -> Any:
        # An empty array: ndarray.__setstate__ (run by BUILD next) gives it its shape, dtype and data.
        _check(subtype is _NDARRAY, "numpy array of a foreign class")
        return np.ndarray((0,), np.uint8)

    table: dict[tuple[str, str], Any] = {
        ("numpy", "dtype"): dtype,
        ("numpy", "ndarray"): _NDARRAY,
        ("numpy.core.multiarray", "scalar"): scalar,
        ("numpy._core.multiarray", "scalar"): scalar,
        ("numpy.core.multiarray", "_reconstruct"): reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): reconstruct,
    }
    return table.get((module, name))


_SAFE_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch", "Size"): _torch_size,
    ("torch", "device"): _torch_device,
    ("collections", "OrderedDict"): _ordered_dict,
    ("builtins", "set"): _container(set),
    ("builtins", "frozenset"): _container(frozenset),
    ("builtins", "list"): _container(list),
    ("builtins", "tuple"): _container(tuple),
    ("builtins", "slice"): _slice,
    ("builtins", "complex"): _complex,
    ("builtins", "object"): object,  # only ever an argument of copyreg._reconstructor
    ("_codecs", "encode"): _codecs_encode,
    ("copyreg", "_reconstructor"): _reconstructor,
}


def _python3_name(module: str, name: str) -> tuple[str, str]:
    """Python 2 spellings (``__builtin__.set``, ``commands.Popen``) as pickle itself maps them for protocols < 3."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def _load_build(self: _RestrictedUnpickler) -> None:
    """BUILD sets an object's state: allowed only on our inert records and on numpy's plain data objects.

    The stock BUILD would look up ``__setstate__`` on, or ``setattr`` into, whatever sits on the stack
    (a tensor, one of our functions, a class), letting a file change objects outside itself.
    """
    state = self.stack.pop()
    inst = self.stack[-1]
    if isinstance(inst, InertObject):
        InertObject.__setstate__(inst, state)
        return
    if type(inst) is np.ndarray or isinstance(inst, np.dtype):
        type(inst).__setstate__(inst, state)  # numpy's own C code: copies bytes or already-safe objects
        return
    raise _Refused(f"it sets the state of a {type(inst).__name__} object, which only plain records may have")


class _RestrictedUnpickler(pickle._Unpickler):  # the Python one: its opcode table can be changed
    """Unpickles a torch zip's data.pkl from an allow-list only; storages come from the zip records."""

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = _load_build

    def __init__(
        self,
        file: io.BytesIO,
        storages: Callable[[str, torch.dtype, int], torch.Tensor],
        inert_modules: tuple[str, ...] = (),
    ) -> None:
        super().__init__(file, encoding="utf-8")
        self._storages = storages
        self._inert_modules = inert_modules
        self._cache: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if not isinstance(module, str) or not isinstance(name, str):
            raise pickle.UnpicklingError("malformed global")
        module, name = _python3_name(module, name)
        if (module, name) in _SAFE_GLOBALS:
            return _SAFE_GLOBALS[(module, name)]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]  # a dtype object, not a callable
        numpy_fn = _numpy_reconstructors(module, name)
        if numpy_fn is not None:
            return numpy_fn
        if is_inert_namespace(module, name, self._inert_modules):
            return inert_class(module, name)
        raise _Refused(f"it asks to call {module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        # torch writes ('storage', StorageType, key, location, numel) for every storage it saves.
        _check(isinstance(pid, tuple) and len(pid) == 5, "bad persistent id")
        kind, storage_type, key, _location, numel = pid
        kind = kind.decode("ascii") if isinstance(kind, bytes) else kind
        key = key.decode("ascii") if isinstance(key, bytes) else key
        _check(kind == "storage" and isinstance(storage_type, _StorageType), "bad persistent id")
        _check(isinstance(key, str) and key.isalnum(), "bad storage key")
        _check(isinstance(numel, int) and numel >= 0, "bad storage size")
        if key not in self._cache:
            self._cache[key] = _Storage(self._storages(key, storage_type.dtype, numel))
        return self._cache[key]


# --------------------------------------------------------------------------------------------------
# The torch zip archive
# --------------------------------------------------------------------------------------------------


# Weights live in data/<key> records; the pickle only describes them. Real ones are well under 1 MiB.
_MAX_PICKLE_BYTES = 256 << 20


def _zip_prefix(zf: zipfile.ZipFile, path: Path) -> str:
    """The archive's top folder ('yolov8n/'): torch names it after the file it first saved to."""
    for name in zf.namelist():
        if name == "data.pkl" or name.endswith("/data.pkl"):
            prefix = name[: -len("data.pkl")]
            if prefix.count("/") <= 1:
                return prefix
    raise CheckpointError(f"not a torch checkpoint (no data.pkl inside): {path}")


def _open_zip(path: Path) -> zipfile.ZipFile:
    if not path.is_file():
        raise CheckpointError(f"weights file not found: {path}")
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(f"not a torch zip checkpoint (saved by torch >= 1.6): {path} ({e})") from None


def read_torch_zip(path: str | Path, inert_modules: Iterable[str] = ()) -> Any:
    """Unpickle a torch zip checkpoint with the restricted unpickler; tensors come back on the CPU.

    ``inert_modules`` names whole modules (``"ultralytics"`` covers ``ultralytics.nn.tasks`` too) whose
    classes become :class:`InertObject` records, beside the built-in data-only ones.
    Raises CheckpointError if the file is missing, not a torch zip, or names anything off the allow-list.

    Example:
        >>> ckpt = read_torch_zip("yolov8n.pt")                    # doctest: +SKIP
        >>> sorted(ckpt)[:3]                                        # doctest: +SKIP
        ['best_fitness', 'date', 'ema']
    """
    path = Path(path)
    extra = tuple(str(m).rstrip(".") for m in inert_modules)
    if any(not m for m in extra):
        raise ValueError("inert_modules holds an empty module name")
    with _open_zip(path) as zf:
        prefix = _zip_prefix(zf, path)
        names = set(zf.namelist())
        byteorder = "little"  # what torch assumes for files without a byteorder record
        if f"{prefix}byteorder" in names:
            byteorder = zf.read(f"{prefix}byteorder").decode("ascii", "replace").strip()
            if byteorder not in ("little", "big"):
                raise CheckpointError(f"unknown byte order {byteorder!r} in {path}")

        def storage(key: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
            record = f"{prefix}data/{key}"
            if record not in names:
                raise pickle.UnpicklingError(f"missing storage record data/{key}")
            itemsize = torch.empty((), dtype=dtype).element_size()
            nbytes = numel * itemsize
            _check(zf.getinfo(record).file_size >= nbytes, f"storage data/{key} is truncated")
            if not numel:
                return torch.empty(0, dtype=dtype)
            with zf.open(record) as f:  # read only what the pickle declared, whatever the record claims
                raw = f.read(nbytes)
            _check(len(raw) == nbytes, f"storage data/{key} is truncated")
            # A numpy copy: aligned for every dtype (a bytearray need not be), and cheaper than clone().
            flat = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
            if byteorder != sys.byteorder and itemsize > 1:  # reverse the bytes of every element
                flat = flat.view(-1, itemsize).flip(1).reshape(-1)
            return flat.view(dtype)

        if zf.getinfo(f"{prefix}data.pkl").file_size > _MAX_PICKLE_BYTES:
            raise CheckpointError(f"refusing to load {path}: its data.pkl is larger than {_MAX_PICKLE_BYTES >> 20} MiB")
        try:
            data = zf.read(f"{prefix}data.pkl")
            return _RestrictedUnpickler(io.BytesIO(data), storage, extra).load()
        except _Refused as e:
            raise CheckpointError(f"refusing to load {path}: {e}") from None
        except CheckpointError:
            raise
        except Exception as e:  # any malformed pickle: one line, never a traceback into pickle internals
            raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from None
