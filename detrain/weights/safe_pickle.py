"""Read torch zip checkpoints with a restricted unpickler: nothing named in the file is imported or run.

A plain ``torch.load(weights_only=False)`` would import every class the pickle names and let it call any
function, so a downloaded file could run code. Here the archive is checked first (:mod:`.torch_zip`), then
its ``data.pkl`` is run by :class:`_RestrictedUnpickler`, which serves only what a YOLOv8 (or detrain)
checkpoint needs:

- opcodes of pickle protocols 0-4 that build plain data; INST/OBJ/NEWOBJ_EX, the copyreg extension
  registry, text persistent ids and protocol-5 buffers are refused;
- a short allow-list of reconstructors served by *our own* functions that check their arguments:
  tensors and storages (:mod:`.safe_torch`), numpy number scalars/arrays by dtype name (:mod:`.safe_numpy`),
  ``OrderedDict``, ``set``, ``slice``, ``complex`` and protocol-2 bytes;
- classes from namespaces that only hold data for us (``torch.nn.modules.*``, ``types.SimpleNamespace``,
  plus the caller's ``inert_modules`` such as ``ultralytics``) become :class:`InertObject` records (see
  :mod:`detrain.weights.inert`) that keep their arguments and state and never call anything;
- BUILD (``__setstate__``) only on those records and on our pending numpy records, never on a numpy or torch
  object; SETITEM/APPEND/ADDITEMS only on real dicts, lists and sets, and only keys whose hash is cheap and
  cannot be made to collide (:mod:`.hash_keys`);
- bounded work: opcodes, memo entries, distinct globals, bytes copied by reconstructors and nesting depth
  are capped (:mod:`.limits`), so no file can make the reader loop, recurse or allocate on its word.

Any other global (``os.system``, ``builtins.eval``, ``subprocess.Popen``, ``functools.partial`` ...) or
request stops the load with :class:`~detrain.errors.CheckpointError`: "refusing to load <file>: <reason>".

Example (a file whose pickle would run a shell command is refused before anything runs):
    >>> import os, torch
    >>> class Payload:
    ...     def __reduce__(self):
    ...         return os.system, ("echo pwned",)
    >>> torch.save({"model": Payload()}, "evil.pt")
    >>> read_torch_zip("evil.pt")
    Traceback (most recent call last):
    ...
    detrain.errors.CheckpointError: refusing to load evil.pt: it asks to call posix.system
"""

from __future__ import annotations

import _compat_pickle  # the stdlib's own table of Python 2 -> 3 names, used by pickle
import io
import pickle
import pickletools
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from detrain.errors import CheckpointError
from detrain.weights import limits, safe_numpy
from detrain.weights.hash_keys import check_key, check_keys
from detrain.weights.inert import InertObject, inert_class, is_inert_namespace
from detrain.weights.limits import Refused, size_text
from detrain.weights.nesting import check_nesting
from detrain.weights.safe_torch import DTYPES, STORAGE_TYPES, TORCH_GLOBALS, StorageReader, StorageType
from detrain.weights.torch_zip import TorchZip

__all__ = ["InertObject", "read_torch_zip"]


# --------------------------------------------------------------------------------------------------
# Python-level reconstructors
# --------------------------------------------------------------------------------------------------


def _ordered_dict(*args: Any) -> OrderedDict:
    if len(args) > 1 or (args and not isinstance(args[0], (list, tuple, dict))):
        raise Refused("an OrderedDict made from something other than one list of pairs")
    if args and not isinstance(args[0], dict):  # a dict's keys were checked as it was filled
        for pair in args[0]:
            if type(pair) not in (list, tuple) or len(pair) != 2:
                raise Refused("an OrderedDict made from something other than (key, value) pairs")
            check_key(pair[0])
    return OrderedDict(*args)


def _container(kind: type) -> Callable[..., Any]:
    hashed = kind in (set, frozenset)

    def build(*args: Any) -> Any:
        if len(args) > 1 or (args and not isinstance(args[0], (list, tuple, set, frozenset))):
            raise Refused(f"a {kind.__name__} made from something other than one list")
        if hashed and args and type(args[0]) in (list, tuple):  # a set's items were checked as it was filled
            check_keys(args[0])
        return kind(*args)

    return build


def _slice(*args: Any) -> slice:
    if len(args) > 3 or not all(a is None or type(a) is int for a in args):
        raise Refused("a slice of something other than integers")
    return slice(*args)


def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    if type(real) not in (int, float) or type(imag) not in (int, float):
        raise Refused("a complex number made of something other than numbers")
    return complex(real, imag)


def _codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    # Protocol 2 pickles bytes as _codecs.encode(str, "latin1"); nothing else is needed.
    if not (isinstance(text, str) and isinstance(encoding, str) and encoding in ("latin1", "latin-1")):
        raise Refused("a bytes record that is not _codecs.encode(text, 'latin1')")
    return text.encode("latin1")


def _empty_bytes(*args: Any) -> bytes:
    # Protocol 2 pickles b"" as builtins.bytes() (numpy writes it for an empty array's data).
    if args:
        raise Refused("a bytes() call with arguments")
    return b""


def _reconstructor(cls: Any, base: Any, state: Any) -> Any:
    # copyreg._reconstructor(cls, object, None) is how protocols 0/1 pickle plain objects.
    if not (isinstance(cls, type) and issubclass(cls, InertObject) and base is object):
        raise Refused("a copyreg._reconstructor call for something other than a data record")
    return cls.__new__(cls)


_PY_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): _ordered_dict,
    ("builtins", "set"): _container(set),
    ("builtins", "frozenset"): _container(frozenset),
    ("builtins", "list"): _container(list),
    ("builtins", "tuple"): _container(tuple),
    ("builtins", "slice"): _slice,
    ("builtins", "complex"): _complex,
    ("builtins", "object"): object,  # only ever an argument of copyreg._reconstructor, never called
    ("_codecs", "encode"): _codecs_encode,
    ("builtins", "bytes"): _empty_bytes,
    ("copyreg", "_reconstructor"): _reconstructor,
}

# numpy 1.x pickles from numpy.core, numpy 2.x from numpy._core.
_NUMPY_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy", "dtype"): safe_numpy.numpy_dtype,
    ("numpy", "ndarray"): safe_numpy.NDARRAY,
    **{(m, "scalar"): safe_numpy.numpy_scalar for m in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(m, "_reconstruct"): safe_numpy.numpy_reconstruct for m in ("numpy.core.multiarray", "numpy._core.multiarray")},
}

_SAFE_GLOBALS: dict[tuple[str, str], Any] = {**TORCH_GLOBALS, **_PY_GLOBALS, **_NUMPY_GLOBALS}
_CALLABLE = {id(f) for f in _SAFE_GLOBALS.values() if callable(f) and f is not object}


def _python3_name(module: str, name: str) -> tuple[str, str]:
    """Python 2 spellings (``__builtin__.set``, ``commands.Popen``) as pickle itself maps them for protocols < 3."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def _valid_dotted(text: str) -> bool:
    return 0 < len(text) <= limits.MAX_NAME_CHARS and all(part.isidentifier() for part in text.split("."))


# --------------------------------------------------------------------------------------------------
# The unpickler
# --------------------------------------------------------------------------------------------------

# Every opcode a torch.save of plain data, tensors, numpy numbers or nn.Modules writes (protocols 0-4).
_ALLOWED_OPS = frozenset(
    "PROTO STOP FRAME MARK POP POP_MARK DUP NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 LONG LONG1 LONG4 "
    "FLOAT BINFLOAT STRING BINSTRING SHORT_BINSTRING UNICODE BINUNICODE SHORT_BINUNICODE BINUNICODE8 BINBYTES "
    "SHORT_BINBYTES BINBYTES8 EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3 EMPTY_LIST LIST APPEND APPENDS EMPTY_DICT "
    "DICT SETITEM SETITEMS EMPTY_SET ADDITEMS FROZENSET GLOBAL STACK_GLOBAL REDUCE BUILD NEWOBJ BINPERSID "
    "PUT BINPUT LONG_BINPUT MEMOIZE GET BINGET LONG_BINGET".split()
)
_OP_NAMES = {op.code.encode("latin1")[0]: op.name for op in pickletools.opcodes}


def _refuse_op(code: int) -> Callable[[Any], None]:
    name = _OP_NAMES.get(code)
    reason = f"pickle opcode {name} is not used by torch checkpoints" if name else f"unknown pickle opcode 0x{code:02x}"

    def refuse(self: Any) -> None:
        raise Refused(reason)

    return refuse


class _RestrictedUnpickler(pickle._Unpickler):  # the Python one: its opcode table can be changed
    """Unpickles a torch zip's data.pkl from an allow-list only, within :mod:`.limits`."""

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = {
        code: (pickle._Unpickler.dispatch[code] if _OP_NAMES.get(code) in _ALLOWED_OPS else _refuse_op(code))
        for code in range(256)
    }
    # the pure-Python unpickler's own state that this class drives; typeshed describes only its public surface
    memo: dict[int, Any]
    stack: list[Any]
    metastack: list[list[Any]]
    append: Callable[[Any], None]
    read: Callable[[int], bytes]
    readline: Callable[[], bytes]
    proto: int
    _file_read: Callable[[int], bytes]
    _file_readline: Callable[[], bytes]
    pop_mark: Callable[[], list[Any]]

    def __init__(self, data: bytes, storages: StorageReader, inert_modules: tuple[str, ...] = ()) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._storages = storages
        self._inert_modules = inert_modules
        self._globals: dict[tuple[str, str], Any] = {}
        self._made = 0  # bytes copied by reconstructors, against MAX_MADE_BYTES
        self._depth: dict[int, tuple[int, Any]] = {}  # id -> (nesting, the object itself, kept alive)

    # ---- the opcode loop, counted ---------------------------------------------------------------

    def load(self) -> Any:
        # pickle's private framing reader and STOP signal are missing from typeshed
        self._unframer = pickle._Unframer(self._file_read, self._file_readline)  # type: ignore[attr-defined]
        self.read = self._unframer.read
        self.readinto = self._unframer.readinto
        self.readline = self._unframer.readline
        self.metastack = []
        self.stack = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = self.read, self.dispatch
        try:
            for _ in range(limits.MAX_PICKLE_OPS):
                key = read(1)
                if not key:
                    raise EOFError("the pickle ends without a STOP")
                dispatch[key[0]](self)
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value
        raise Refused(f"its pickle runs more than {limits.MAX_PICKLE_OPS} opcodes")

    def spend(self, nbytes: int, what: str) -> None:
        self._made += nbytes
        if self._made > limits.MAX_MADE_BYTES:
            raise Refused(f"its {what} would copy more than {size_text(limits.MAX_MADE_BYTES)}")

    # ---- globals and calls ----------------------------------------------------------------------

    def find_class(self, module: str, name: str) -> Any:
        if not isinstance(module, str) or not isinstance(name, str):
            raise Refused("a global whose name is not text")
        if not (_valid_dotted(module) and _valid_dotted(name)):
            raise Refused(f"a malformed global name {module[:64]!r} {name[:64]!r}")
        module, name = _python3_name(module, name)
        if (module, name) not in self._globals:
            if len(self._globals) >= limits.MAX_GLOBALS:
                raise Refused(f"it names more than {limits.MAX_GLOBALS} distinct classes and functions")
            self._globals[(module, name)] = self._resolve(module, name)
        return self._globals[(module, name)]

    def _resolve(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return _SAFE_GLOBALS[(module, name)]
        if module == "torch" and name in STORAGE_TYPES:
            return StorageType(STORAGE_TYPES[name])
        if module == "torch" and name in DTYPES:
            return DTYPES[name]  # a dtype object, not a callable
        if is_inert_namespace(module, name, self._inert_modules):
            return inert_class(module, name)
        raise Refused(f"it asks to call {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return self._storages.load(pid)

    def _charge_args(self, args: Any, what: str) -> None:
        """A call copies its argument tuple, and our reconstructors copy what they are given: pay up front."""
        self.spend(64 * len(args), what)  # first: the loop below is then bounded by the allowance too
        cost = 0
        for a in args:
            if isinstance(a, (str, bytes)):
                cost += len(a)
            elif isinstance(a, (tuple, list, dict, set, frozenset)):
                cost += 64 * len(a)
        self.spend(cost, what)

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if not isinstance(args, tuple):
            raise Refused("a call whose arguments are not a tuple")
        if id(func) not in _CALLABLE and not (isinstance(func, type) and issubclass(func, InertObject)):
            raise Refused(f"it calls a {type(func).__name__} object")
        self._charge_args(args, "calls")
        self.stack[-1] = self._note_depth(func(*args))

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not (isinstance(cls, type) and issubclass(cls, InertObject)) or not isinstance(args, tuple):
            what = cls.__name__ if isinstance(cls, type) else type(cls).__name__
            raise Refused(f"it creates an object of type {what}, which is not a data record")
        self._charge_args(args, "objects")
        self.append(cls.__new__(cls, *args))

    def load_build(self) -> None:
        """BUILD sets an object's state: allowed only on our inert records and our pending numpy records.

        The stock BUILD would look up ``__setstate__`` on, or ``setattr`` into, whatever sits on the stack
        (a tensor, a numpy dtype whose flags decide what its bytes mean, one of our functions, a class).
        """
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, InertObject):
            InertObject.__setstate__(inst, state)
            return
        if type(inst) is OrderedDict and type(state) is dict and len(state) == 1 and "_metadata" in state:
            if not isinstance(state["_metadata"], dict):
                raise Refused("a state dict whose _metadata is not a dict")
            inst._metadata = state["_metadata"]  # type: ignore[attr-defined]  # what module.state_dict() carries
            return
        if isinstance(inst, safe_numpy.PendingDtype):
            built: Any = inst.build(state)
        elif isinstance(inst, safe_numpy.PendingArray):
            built = inst.build(state, self.spend)
        elif isinstance(inst, (np.ndarray, np.dtype, np.generic)):
            raise Refused("it applies BUILD to a numpy object (numpy would take flags or pointers from the file)")
        else:
            raise Refused(f"it sets the state of a {type(inst).__name__} object, which only plain records may have")
        self.stack[-1] = built
        for key in inst.memo_keys:  # the record was memoized before its BUILD: later GETs see the result
            if self.memo.get(key) is inst:
                self.memo[key] = built

    # ---- memo -----------------------------------------------------------------------------------

    def _memo_put(self, key: int) -> None:
        if not self.stack:
            raise Refused("a memo write with nothing on the stack")
        if key not in self.memo and len(self.memo) >= limits.MAX_MEMO:
            raise Refused(f"its pickle keeps more than {limits.MAX_MEMO} memo entries")
        value = self.stack[-1]
        self.memo[key] = value
        if isinstance(value, (safe_numpy.PendingDtype, safe_numpy.PendingArray)):
            value.memo_keys.append(key)

    def load_put(self) -> None:
        line = self.readline()[:-1]
        if not line.isdigit() or len(line) > 10:
            raise Refused("a malformed memo index")
        self._memo_put(int(line))

    def load_binput(self) -> None:
        self._memo_put(self.read(1)[0])

    def load_long_binput(self) -> None:
        self._memo_put(int.from_bytes(self.read(4), "little"))

    def load_memoize(self) -> None:
        self._memo_put(len(self.memo))

    # ---- containers: only real ones are filled, immutable ones have a bounded depth -------------

    def _note_depth(self, obj: Any) -> Any:
        """Record how deep a new tuple/frozenset nests: hashing one recurses in C without a limit."""
        if type(obj) in (tuple, frozenset) and obj:
            depth = 1 + max((self._depth.get(id(x), (1,))[0] if type(x) in (tuple, frozenset) else 0) for x in obj)
            if depth > limits.MAX_NESTING:
                raise Refused(f"its data nests deeper than {limits.MAX_NESTING} levels")
            if depth > 1:
                self._depth[id(obj)] = (depth, obj)
        return obj

    def load_tuple(self) -> None:
        items = self.pop_mark()  # first: it switches self.append to the outer stack
        self.append(self._note_depth(tuple(items)))

    def load_tuple1(self) -> None:
        self.stack[-1] = self._note_depth((self.stack[-1],))

    def load_tuple2(self) -> None:
        self.stack[-2:] = [self._note_depth((self.stack[-2], self.stack[-1]))]

    def load_tuple3(self) -> None:
        self.stack[-3:] = [self._note_depth((self.stack[-3], self.stack[-2], self.stack[-1]))]

    def load_frozenset(self) -> None:
        items = self.pop_mark()
        check_keys(items)
        self.append(self._note_depth(frozenset(items)))

    def _target(self, kinds: tuple[type, ...], op: str) -> Any:
        target = self.stack[-1]
        if type(target) not in kinds:
            raise Refused(f"it applies {op} to a {type(target).__name__} object")
        return target

    def load_append(self) -> None:
        value = self.stack.pop()
        self._target((list,), "APPEND").append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._target((list,), "APPENDS").extend(items)

    # Every key and set item is checked before it is hashed: see detrain.weights.hash_keys.

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        target = self._target((dict, OrderedDict), "SETITEM")
        check_key(key)
        target[key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._target((dict, OrderedDict), "SETITEMS")
        if len(items) % 2:
            raise Refused("SETITEMS with a key but no value")
        check_keys(items[::2])
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def load_dict(self) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            raise Refused("DICT with a key but no value")
        check_keys(items[::2])
        self.append({items[i]: items[i + 1] for i in range(0, len(items), 2)})

    def load_additems(self) -> None:
        items = self.pop_mark()
        target = self._target((set,), "ADDITEMS")
        check_keys(items)
        target.update(items)


for _name in (
    "reduce",
    "newobj",
    "build",
    "put",
    "binput",
    "long_binput",
    "memoize",
    "tuple",
    "tuple1",
    "tuple2",
    "tuple3",
    "frozenset",
    "append",
    "appends",
    "setitem",
    "setitems",
    "dict",
    "additems",
):
    _code = getattr(pickle, _name.upper())[0]
    _RestrictedUnpickler.dispatch[_code] = getattr(_RestrictedUnpickler, f"load_{_name}")


# --------------------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------------------


def _one_line(e: BaseException) -> str:
    """An exception as one short line; never fails, whatever the file put into its message."""
    try:
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    except Exception:  # noqa: BLE001 - a message whose str() itself fails (a deep repr, a huge number)
        text = ""
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


def read_torch_zip(path: str | Path, inert_modules: Iterable[str] = (), data: bytes | None = None) -> Any:
    """Unpickle a torch zip checkpoint with the restricted unpickler; tensors come back on the CPU.

    ``inert_modules`` names whole modules (``"ultralytics"`` covers ``ultralytics.nn.tasks`` too) whose
    classes become :class:`InertObject` records, beside the built-in data-only ones.
    ``data``: the file's bytes, read once by the caller so that what is checked is what it loads (``path`` then
    only names the file in messages).
    Raises CheckpointError if the file is missing, not a torch zip, names anything off the allow-list or
    asks for more than :mod:`detrain.weights.limits` allows.

    Example:
        >>> import torch
        >>> torch.save({"epoch": 3, "model": {"w": torch.ones(2)}}, "ckpt.pt")
        >>> read_torch_zip("ckpt.pt")
        {'epoch': 3, 'model': {'w': tensor([1., 1.])}}
    """
    path = Path(path)
    extra = tuple(str(m).rstrip(".") for m in inert_modules)
    if any(not m for m in extra):
        raise ValueError("inert_modules holds an empty module name")
    try:
        with TorchZip(path, data) as archive:
            pickled = archive.pickle_bytes()
            result = _RestrictedUnpickler(pickled, StorageReader(archive), extra).load()
            check_nesting(result, limits.MAX_NESTING)
            archive.check_all_vetted()
            return result
    except Refused as e:
        raise CheckpointError(f"refusing to load {path}: {e}") from None
    except CheckpointError:
        raise
    except (MemoryError, RecursionError):
        raise  # the limits above exist so that these never happen: let them show, loudly
    except Exception as e:  # noqa: BLE001 - any malformed pickle: one line, never a traceback into pickle internals
        raise CheckpointError(f"cannot read {path}: {_one_line(e)}") from None
