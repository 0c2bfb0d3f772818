"""Read Ultralytics YOLOv8 checkpoints without Ultralytics and without running anything from the file.

An Ultralytics ``.pt`` is a torch zip archive: ``<archive>/data.pkl`` pickles the whole training state,
including Ultralytics classes (``ultralytics.nn.tasks.DetectionModel``, ``ultralytics.nn.modules.Conv``)
and ``torch.nn`` modules, and each tensor's bytes live in ``<archive>/data/<key>``. A plain
``torch.load(weights_only=False)`` would import those classes and let the pickle call any function it
names, so a downloaded file could run code. Here the pickle is read by :class:`_RestrictedUnpickler`:

- a short allow-list of reconstructors (tensors, parameters, storages, ``torch.Size``, dtypes,
  ``OrderedDict``, ``set`` ...) is served by *our own* small functions that check their arguments;
- classes from namespaces that only hold data for us (``ultralytics.*``, ``torch.nn.modules.*``,
  ``types.SimpleNamespace`` ...) become :class:`InertObject` records that keep their constructor
  arguments and ``__setstate__`` state and never call anything;
- any other global (``os.system``, ``builtins.eval``, ``subprocess.Popen``, ``functools.partial`` ...)
  stops the load with :class:`~detrain.errors.CheckpointError` before it can be called.

Example:
    >>> info = load_ultralytics_checkpoint("yolov8n.pt")          # doctest: +SKIP
    >>> info["names"][0], info["scale"], info["stride"]            # doctest: +SKIP
    ('person', 'n', [8.0, 16.0, 32.0])
    >>> model = to_detrain_model(info)                             # doctest: +SKIP
"""

from __future__ import annotations

import _compat_pickle  # the stdlib's own table of Python 2 -> 3 names, used by pickle
import io
import pickle
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from detrain.errors import CheckpointError

if TYPE_CHECKING:  # the model module is only needed by to_detrain_model
    from detrain.nn.model import DetectionModel

__all__ = [
    "InertObject",
    "is_ultralytics_checkpoint",
    "load_ultralytics_checkpoint",
    "read_torch_zip",
    "to_detrain_model",
    "state_dict_of",
]


# --------------------------------------------------------------------------------------------------
# Inert records
# --------------------------------------------------------------------------------------------------


class InertObject:
    """Stands in for an object of a class we will not import: keeps its arguments and state, runs nothing.

    Each pickled class name gets its own subclass (see :func:`_inert_class`), so ``type(obj).__name__``
    still reads ``Conv`` or ``DetectionModel``; the full name is in ``obj.inert_name``.

    Example:
        >>> cls = _inert_class("ultralytics.nn.modules", "Conv")
        >>> obj = cls.__new__(cls); obj.__setstate__({"c": 1})
        >>> obj.inert_name, obj.inert_state
        ('ultralytics.nn.modules.Conv', {'c': 1})
    """

    inert_module: str = ""
    inert_qualname: str = ""

    # The pickled attributes stay inside inert_state, so nothing in a file can shadow a record's own names.
    def __new__(cls, *args: Any, **kwargs: Any) -> InertObject:
        obj = object.__new__(cls)
        object.__setattr__(obj, "inert_args", args)
        object.__setattr__(obj, "inert_kwargs", kwargs)
        object.__setattr__(obj, "inert_state", None)
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # a REDUCE calls cls(*args): just record
        pass

    def __setstate__(self, state: Any) -> None:
        object.__setattr__(self, "inert_state", state)

    @property
    def inert_name(self) -> str:
        return f"{self.inert_module}.{self.inert_qualname}"

    def attrs(self) -> dict[str, Any]:
        """The object's attribute dict as pickled (``__dict__`` state, or the slots half of a pair)."""
        state = self.inert_state
        if isinstance(state, tuple) and len(state) == 2:  # (dict_state, slot_state)
            merged: dict[str, Any] = {}
            for part in state:
                if isinstance(part, dict):
                    merged.update(part)
            return merged
        if isinstance(state, dict):
            return state
        return {}

    def __repr__(self) -> str:
        return f"<inert {self.inert_name}>"


_INERT_CLASSES: dict[tuple[str, str], type[InertObject]] = {}


def _inert_class(module: str, qualname: str) -> type[InertObject]:
    key = (module, qualname)
    if key not in _INERT_CLASSES:
        name = qualname.rsplit(".", 1)[-1] or "Inert"
        _INERT_CLASSES[key] = type(name, (InertObject,), {"inert_module": module, "inert_qualname": qualname})
    return _INERT_CLASSES[key]


# Namespaces whose classes we only ever need as data. Nothing is imported from them: every name in them
# becomes an InertObject record, so even a function among them can only be "called" into a record.
_INERT_MODULE_PREFIXES = ("ultralytics.", "torch.nn.modules.")
_INERT_NAMES = {
    "ultralytics": None,  # None: any name in the module
    "types": {"SimpleNamespace"},
    "argparse": {"Namespace"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "datetime": {"datetime", "date", "time", "timedelta", "timezone"},
}


def _is_inert_namespace(module: str, name: str) -> bool:
    if module.startswith(_INERT_MODULE_PREFIXES):
        return True
    if module in _INERT_NAMES:
        names = _INERT_NAMES[module]
        return names is None or name in names
    return False


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

    def __init__(self, file: io.BytesIO, storages: Callable[[str, torch.dtype, int], torch.Tensor]) -> None:
        super().__init__(file, encoding="utf-8")
        self._storages = storages
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
        if _is_inert_namespace(module, name):
            return _inert_class(module, name)
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


def read_torch_zip(path: str | Path) -> Any:
    """Unpickle a torch zip checkpoint with the restricted unpickler; tensors come back on the CPU.

    Raises CheckpointError if the file is missing, not a torch zip, or names anything off the allow-list.

    Example:
        >>> ckpt = read_torch_zip("yolov8n.pt")                    # doctest: +SKIP
        >>> sorted(ckpt)[:3]                                        # doctest: +SKIP
        ['best_fitness', 'date', 'ema']
    """
    path = Path(path)
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
            return _RestrictedUnpickler(io.BytesIO(data), storage).load()
        except _Refused as e:
            raise CheckpointError(f"refusing to load {path}: {e}") from None
        except CheckpointError:
            raise
        except Exception as e:  # any malformed pickle: one line, never a traceback into pickle internals
            raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from None


_PEEK_BYTES = 4 << 20


def is_ultralytics_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a torch zip whose pickle names Ultralytics classes; reads bytes, unpickles nothing.

    Example:
        >>> is_ultralytics_checkpoint("yolov8n.pt")                 # doctest: +SKIP
        True
    """
    try:
        with zipfile.ZipFile(path) as zf:
            pkl = [n for n in zf.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            if not pkl:
                return False
            with zf.open(pkl[0]) as f:  # the model's class names come early; no need to read it all
                return b"ultralytics" in f.read(_PEEK_BYTES)
    except (OSError, zipfile.BadZipFile):
        return False


# --------------------------------------------------------------------------------------------------
# From the pickled module tree to a state dict and metadata
# --------------------------------------------------------------------------------------------------


def state_dict_of(module: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The ``nn.Module.state_dict()`` an inert module record would have: same names, same order.

    Walks ``_parameters``, then persistent ``_buffers``, then ``_modules`` recursively, as torch does.

    Example:
        >>> sd = state_dict_of(read_torch_zip("yolov8n.pt")["model"])   # doctest: +SKIP
        >>> next(iter(sd))                                              # doctest: +SKIP
        'model.0.conv.weight'
    """
    out: dict[str, torch.Tensor] = {}
    _walk(module, prefix, out, depth=0)
    return out


def _walk(module: Any, prefix: str, out: dict[str, torch.Tensor], depth: int) -> None:
    if depth > 64:
        raise CheckpointError("module tree nested deeper than 64 levels")
    if not isinstance(module, InertObject):
        raise CheckpointError(f"expected a pickled module at '{prefix or '<root>'}', found {type(module).__name__}")
    attrs = module.attrs()
    non_persistent = attrs.get("_non_persistent_buffers_set") or set()
    for group in ("_parameters", "_buffers"):
        for name, value in (attrs.get(group) or {}).items():
            if value is None or (group == "_buffers" and name in non_persistent):
                continue
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"'{prefix}{name}' is a {type(value).__name__}, not a tensor")
            out[prefix + name] = value
    for name, child in (attrs.get("_modules") or {}).items():
        if child is not None:
            _walk(child, f"{prefix}{name}.", out, depth + 1)


_SCALE_BY_STEM_WIDTH = {16: "n", 32: "s", 48: "m", 64: "l", 80: "x"}


def _plain(value: Any) -> Any:
    """Inert records of plain containers (SimpleNamespace, Namespace) -> their attribute dict."""
    return value.attrs() if isinstance(value, InertObject) else value


def load_ultralytics_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read an Ultralytics YOLOv8 detection checkpoint safely into plain data.

    Returns a dict with ``state_dict`` (name -> tensor, as ``DetectionModel.state_dict()`` names them;
    from the EMA model when the file has one), ``nc``, ``names`` (dict[int, str]), ``stride`` (list),
    ``imgsz`` (from the training arguments, or None), ``scale`` ('n'..'x'), ``yaml`` (the model yaml
    dict), ``epoch``, and ``date`` / ``version`` when present.

    Example:
        >>> info = load_ultralytics_checkpoint("yolov8n.pt")          # doctest: +SKIP
        >>> info["nc"], len(info["names"]), info["scale"]              # doctest: +SKIP
        (80, 80, 'n')
    """
    path = Path(path)
    ckpt = read_torch_zip(path)
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{path} holds a {type(ckpt).__name__}, not an Ultralytics checkpoint dict")
    model = ckpt.get("ema") if ckpt.get("ema") is not None else ckpt.get("model")
    if not isinstance(model, InertObject):
        raise CheckpointError(f"{path} has no 'model' or 'ema' entry: not an Ultralytics checkpoint")
    attrs = model.attrs()
    state_dict = state_dict_of(model)
    if not state_dict:
        raise CheckpointError(f"{path} holds a model without any weights")

    yaml_cfg = attrs.get("yaml") if isinstance(attrs.get("yaml"), dict) else {}
    raw_names = _plain(attrs.get("names"))
    if isinstance(raw_names, (list, tuple)):
        raw_names = dict(enumerate(raw_names))
    names = {int(k): str(v) for k, v in raw_names.items()} if isinstance(raw_names, dict) else {}
    nc = yaml_cfg.get("nc") or attrs.get("nc") or len(names)
    if not names and nc:
        names = {i: f"class{i}" for i in range(int(nc))}
    if len(names) != int(nc):
        raise CheckpointError(f"{path} names {len(names)} classes but its model has nc={nc}")
    stride = attrs.get("stride")
    stride_list = [float(s) for s in stride.tolist()] if isinstance(stride, torch.Tensor) else list(stride or [])

    train_args = _plain(ckpt.get("train_args"))
    imgsz = train_args.get("imgsz") if isinstance(train_args, dict) else None

    scale = yaml_cfg.get("scale")
    if scale not in _SCALE_BY_STEM_WIDTH.values():
        stem = state_dict.get("model.0.conv.weight")
        scale = _SCALE_BY_STEM_WIDTH.get(int(stem.shape[0])) if stem is not None and stem.ndim == 4 else None
    if scale is None:
        raise CheckpointError(f"cannot tell the YOLOv8 scale (n/s/m/l/x) of {path}: unknown stem width")

    info: dict[str, Any] = {
        "state_dict": state_dict,
        "nc": int(nc),
        "names": names,
        "stride": stride_list,
        "imgsz": imgsz,
        "scale": scale,
        "yaml": yaml_cfg,
        "epoch": ckpt.get("epoch"),
    }
    for key in ("date", "version"):
        if key in ckpt:
            info[key] = ckpt[key]
    return info


# --------------------------------------------------------------------------------------------------
# Onto our own model
# --------------------------------------------------------------------------------------------------


def to_detrain_model(info: dict[str, Any]) -> DetectionModel:
    """Build a detrain ``DetectionModel`` from :func:`load_ultralytics_checkpoint` output, in float32.

    Every key of our model must be in the checkpoint with the same shape (and no extra ones), else a
    CheckpointError lists the first differences.

    Example:
        >>> model = to_detrain_model(load_ultralytics_checkpoint("yolov8n.pt"))   # doctest: +SKIP
        >>> model.eval()(torch.zeros(1, 3, 640, 640)).shape                      # doctest: +SKIP
        torch.Size([1, 84, 8400])
    """
    from detrain.nn.model import DetectionModel

    model = DetectionModel(scale=info["scale"], nc=info["nc"], names=info["names"])
    ours = model.state_dict()
    theirs: dict[str, torch.Tensor] = info["state_dict"]
    problems: list[str] = []
    for key, ref in ours.items():
        if key not in theirs:
            problems.append(f"missing {key} (expected shape {tuple(ref.shape)})")
        elif tuple(theirs[key].shape) != tuple(ref.shape):
            problems.append(f"{key} has shape {tuple(theirs[key].shape)}, expected {tuple(ref.shape)}")
    problems += [f"unexpected {key}" for key in theirs if key not in ours]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(
            f"checkpoint does not fit YOLOv8{info['scale']} with nc={info['nc']}: {'; '.join(problems[:3])}{more}"
        )
    converted = {
        k: (v.to(torch.float32) if v.is_floating_point() else v.to(ours[k].dtype)).contiguous()
        for k, v in theirs.items()
    }
    model.load_state_dict(converted, strict=True)
    model.float()
    return model
