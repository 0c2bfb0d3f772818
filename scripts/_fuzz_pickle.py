"""Pickle-level mutations of a checkpoint's data.pkl, opcode by opcode: dropped, duplicated, swapped; globals
renamed; storage dtypes, sizes and keys, tensor shapes and any integer or string changed; a value of the recorded
model yaml replaced by a hostile one; numpy values, tensors, BUILDs and keys that are costly to hash forged in place
of a value; bytes flipped. Each takes a
seeded ``random.Random`` and the parsed pickle and returns new data.pkl bytes (still a pickle program, not
necessarily a valid one).

The hostile values are written with ``tests/_pickle_forge.py``, the assembler the named attack tests use.

Example:
    >>> pkl = ParsedPickle(data_pkl_bytes)                                # doctest: +SKIP
    >>> MUTATIONS["storage_size"](random.Random(0), pkl)                 # doctest: +SKIP
"""

from __future__ import annotations

import math
import pickle
import pickletools
import random
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _pickle_forge import (
    bool_,
    build,
    bytes_,
    dict_,
    global_,
    int_,
    list_,
    none,
    np_array,
    np_dtype,
    np_dtype_state,
    reduce_,
    storage_tensor,
    str_,
    tuple_,
)

__all__ = ["MUTATIONS", "Op", "ParsedPickle"]

_INTS = {"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"}
_STRINGS = {"UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
_MEMO_WRITES = {"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}
# opcodes that push exactly one value and take nothing: a forged value can stand in their place
_ONE_PUSH = _INTS | _STRINGS | {"NONE", "NEWTRUE", "NEWFALSE", "BINFLOAT", "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT"}


@dataclass(frozen=True)
class Op:
    name: str
    arg: object
    start: int
    end: int


class ParsedPickle:
    """A pickle program as opcodes with their byte spans, and the places worth aiming at."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        raw = list(pickletools.genops(data))
        ends = [pos for _, _, pos in raw[1:]] + [raw[-1][2] + 1]
        self.ops = [Op(info.name, arg, pos, end) for (info, arg, pos), end in zip(raw, ends)]
        self.globals = [i for i, op in enumerate(self.ops) if op.name == "GLOBAL"]
        self.ints = [i for i, op in enumerate(self.ops) if op.name in _INTS]
        self.strings = [i for i, op in enumerate(self.ops) if op.name in _STRINGS]
        self.one_push = [i for i, op in enumerate(self.ops) if op.name in _ONE_PUSH]
        self.storage_types: list[int] = []  # the op pushing each persistent id's storage type
        self.storage_keys: list[int] = []
        self.storage_sizes: list[int] = []
        self.tensor_ints: list[int] = []  # offsets, sizes and strides right after each storage
        self.storages: dict[str, tuple[str, int]] = {}  # key -> (storage type name, numel) as the file declares
        self._memo_globals: dict[object, str] = {}
        for j, op in enumerate(self.ops):
            if op.name in _MEMO_WRITES and op.name != "MEMOIZE" and j and self.ops[j - 1].name == "GLOBAL":
                self._memo_globals[op.arg] = str(self.ops[j - 1].arg)
            if op.name == "BINPERSID":
                self._note_storage(j)
        self.keys = sorted(self.storages)
        self.yaml_values = self._yaml_region()

    def _yaml_region(self) -> list[int]:
        """The one-push ops of the architecture yaml a checkpoint records (from its ``yaml`` key to just past its
        Detect row and the keys after it): where a value reaches the model-yaml checks, not the unpickler's."""
        texts = [(i, self.ops[i].arg) for i in self.strings]
        start = next((i for i, text in texts if text == "yaml"), None)
        if start is None:
            return []
        detects = [i for i, text in texts if text == "Detect" and i > start]
        end = (detects[-1] if detects else start) + 24
        return [i for i in self.one_push if start < i <= end]

    def _note_storage(self, j: int) -> None:
        """torch writes MARK 'storage' type key location numel TUPLE BINPERSID (memo writes between, and
        memo reads for repeated parts): find the op that pushes each part."""
        t = j - 1
        while t >= 0 and self.ops[t].name in _MEMO_WRITES:
            t -= 1
        if t < 0 or self.ops[t].name != "TUPLE":
            return
        parts: list[int] = []
        k = t - 1
        while k >= 0 and self.ops[k].name != "MARK" and len(parts) <= 5:
            if self.ops[k].name not in _MEMO_WRITES:
                parts.append(k)
            k -= 1
        parts.reverse()
        if len(parts) != 5:
            return
        _, kind, key, _, numel = parts
        if self.ops[numel].name in _INTS and self.ops[key].name in _STRINGS:
            self.storage_sizes.append(numel)
            self.storage_keys.append(key)
            self.storage_types.append(kind)
            kind_op = self.ops[kind]
            named = kind_op.arg if kind_op.name == "GLOBAL" else self._memo_globals.get(kind_op.arg)
            if isinstance(named, str) and named.startswith("torch ") and isinstance(self.ops[numel].arg, int):
                self.storages[str(self.ops[key].arg)] = (named.split(" ", 1)[1], self.ops[numel].arg)
        self.tensor_ints += [k for k in range(j + 1, min(j + 24, len(self.ops))) if self.ops[k].name in _INTS]

    def replace(self, i: int, new: bytes) -> bytes:
        """The program with op ``i`` replaced by ``new`` (any number of opcodes)."""
        op = self.ops[i]
        return self.data[: op.start] + new + self.data[op.end :]

    def span(self, i: int) -> bytes:
        return self.data[self.ops[i].start : self.ops[i].end]


# --------------------------------------------------------------------------------------------------
# Values worth trying
# --------------------------------------------------------------------------------------------------


def _int(rng: random.Random, old: object = 0) -> int:
    n = old if isinstance(old, int) else 0
    return rng.choice(
        [
            0,
            1,
            -1,
            2,
            3,
            7,
            8,
            255,
            256,
            65535,
            65536,
            2**31 - 1,
            -(2**31),
            2**32,
            2**62,
            2**63 - 1,
            2**64,
            -(2**63),
            10**12,
            10**5000,
            n + 1,
            n - 1,
            n * 2,
            n // 2,
            -n,
            rng.randrange(-(2**40), 2**40),
        ]
    )


def _text(rng: random.Random, old: object = "") -> str:
    s = old if isinstance(old, str) else ""
    junk = "".join(rng.choice("ab_.0/\n ä\x00\ud800") for _ in range(rng.randint(1, 8)))
    at = rng.randrange(len(s) + 1)
    return rng.choice(
        [
            "",
            "0",
            "999999",
            "../0",
            "cuda:0",
            "model",
            "ema",
            "names",
            "__class__",
            "x" * 100_000,
            s + s,
            s[:at] + junk + s[at:],
            s[:at],
            s.upper(),
        ]
    )


# Globals a hostile file would name, and ones the reader serves (in the wrong place they must still fail well).
_GLOBALS = [
    ("os", "system"),
    ("posix", "system"),
    ("builtins", "eval"),
    ("builtins", "exec"),
    ("builtins", "getattr"),
    ("builtins", "__import__"),
    ("subprocess", "Popen"),
    ("functools", "partial"),
    ("pickle", "loads"),
    ("torch", "load"),
    ("numpy", "load"),
    ("torch.serialization", "load"),
    ("torch", "Tensor"),
    ("torch.nn.parameter", "Parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy.dtypes", "Float64DType"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "list"),
    ("builtins", "tuple"),
    ("builtins", "slice"),
    ("builtins", "complex"),
    ("builtins", "bytes"),
    ("builtins", "object"),
    ("_codecs", "encode"),
    ("copyreg", "_reconstructor"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "float16"),
    ("torch", "FloatStorage"),
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"),
    ("ultralytics.nn.modules", "Fake"),
    ("torch.nn.modules.conv", "Conv2d"),
    ("types", "SimpleNamespace"),
    ("argparse", "Namespace"),
    ("pathlib", "PosixPath"),
    ("datetime", "datetime"),
]
_STORAGES = [
    "HalfStorage",
    "FloatStorage",
    "DoubleStorage",
    "BFloat16Storage",
    "LongStorage",
    "IntStorage",
    "ShortStorage",
    "CharStorage",
    "ByteStorage",
    "BoolStorage",
    "ComplexFloatStorage",
    "ComplexDoubleStorage",
    "UntypedStorage",
    "QInt8Storage",
    "TypedStorage",
    "Storage",
    "float16",
]
_NUMPY_CODES = [
    "b1",
    "i1",
    "i2",
    "i4",
    "i8",
    "u1",
    "u2",
    "u4",
    "u8",
    "f2",
    "f4",
    "f8",
    "c8",
    "c16",
    "O8",
    "O",
    "V8",
    "U1",
    "S4",
    "M8",
    "m8",
    "f16",
    "c32",
    "a",
    "?",
    ">f8",
    "<i4",
    "f8,i4",
    "(2)f4",
]
_ITEMSIZE = {
    "b1": 1,
    "i1": 1,
    "u1": 1,
    "i2": 2,
    "u2": 2,
    "f2": 2,
    "i4": 4,
    "u4": 4,
    "f4": 4,
    "i8": 8,
    "u8": 8,
    "f8": 8,
    "c8": 8,
    "c16": 16,
    "O8": 8,
    "O": 8,
    "V8": 8,
}


def _numpy_value(rng: random.Random) -> bytes:
    """A numpy dtype, scalar or array as numpy pickles them: half honest (a plain number type, the state and
    data numpy writes), half with hostile codes, states and data."""
    if rng.random() < 0.5:
        code = rng.choice(_NUMPY_CODES[:14])
        byteorder = "|" if _ITEMSIZE[code] == 1 else rng.choice("<>")
        dtype = np_dtype(code, np_dtype_state(byteorder, 0))
        shape = tuple(rng.randint(0, 4) for _ in range(rng.randint(0, 3)))
        numel = 1
        for s in shape:
            numel *= s
        raw = rng.randbytes(numel * _ITEMSIZE[code])
        module = rng.choice(["numpy.core.multiarray", "numpy._core.multiarray"])
        if rng.random() < 0.3:
            return reduce_(global_(module, "scalar"), dtype, bytes_(raw[: _ITEMSIZE[code]] or bytes(_ITEMSIZE[code])))
        return np_array(dtype, shape, raw, module)
    code = rng.choice(_NUMPY_CODES)
    if rng.random() < 0.7:
        state = np_dtype_state(rng.choice(["<", ">", "|", "=", "!"]), rng.choice([0, 0, 0, 1, 16, 63, -1, 2**40]))
    elif rng.random() < 0.5:
        state = tuple_(*(int_(_int(rng)) for _ in range(rng.randint(0, 10))))
    else:
        state = None
    dtype = np_dtype(code, state)
    itemsize = _ITEMSIZE.get(code, rng.randint(0, 16))
    kind = rng.choice(["dtype", "scalar", "array", "array"])
    if kind == "dtype":
        return dtype
    if kind == "scalar":
        raw = rng.randbytes(itemsize if rng.random() < 0.7 else rng.randint(0, 17))
        return reduce_(
            global_(rng.choice(["numpy.core.multiarray", "numpy._core.multiarray"]), "scalar"), dtype, bytes_(raw)
        )
    shape = tuple(rng.randint(0, 4) for _ in range(rng.randint(0, 3)))
    if rng.random() < 0.1:
        shape = shape + (rng.choice([2**31, 2**62, 10**12]),)
    numel = 1
    for s in shape:
        numel *= s
    size = numel * itemsize if rng.random() < 0.7 and numel * itemsize < 4096 else rng.randint(0, 64)
    return np_array(dtype, shape, rng.randbytes(size), rng.choice(["numpy.core.multiarray", "numpy._core.multiarray"]))


def _tensor_value(rng: random.Random, storages: dict[str, tuple[str, int]]) -> bytes:
    """A tensor over an existing storage as declared, viewed whole or in part, or over a made-up storage of
    any type, size and shape."""
    keys = sorted(storages)
    if keys and rng.random() < 0.5:
        key = rng.choice(keys)
        kind, numel = storages[key]
        shape = rng.choice([(numel,), (1, numel), (numel // 2,), (numel + 1,), (), (0,), (numel, 0), (2, numel)])
        return storage_tensor(key, numel, shape, kind)
    key = rng.choice(keys) if keys and rng.random() < 0.8 else _text(rng, "0")
    numel = rng.choice([0, 1, 4, 16, 432, 10**6, 2**31, 10**12, -1, rng.randint(0, 5000)])
    shape = tuple(rng.choice([0, 1, 2, 3, 16, 64, 10**6]) for _ in range(rng.randint(0, 4)))
    return storage_tensor(key, numel, shape, rng.choice(_STORAGES))


# --------------------------------------------------------------------------------------------------
# The mutations
# --------------------------------------------------------------------------------------------------


def drop_op(rng: random.Random, p: ParsedPickle) -> bytes:
    return p.replace(rng.randrange(len(p.ops)), b"")


def duplicate_op(rng: random.Random, p: ParsedPickle) -> bytes:
    i = rng.randrange(len(p.ops))
    return p.replace(i, p.span(i) * 2)


def swap_ops(rng: random.Random, p: ParsedPickle) -> bytes:
    """Two opcodes trade places: neighbours half the time, any two otherwise."""
    i = rng.randrange(len(p.ops) - 1)
    j = i + 1 if rng.random() < 0.5 else rng.randrange(i + 1, len(p.ops))
    a, b = p.ops[i], p.ops[j]
    d = p.data
    return d[: a.start] + d[b.start : b.end] + d[a.end : b.start] + d[a.start : a.end] + d[b.end :]


def rename_global(rng: random.Random, p: ParsedPickle) -> bytes:
    """A GLOBAL names something else: a dangerous callable, another global of the file, or mangled text."""
    i = rng.choice(p.globals)
    module, name = str(p.ops[i].arg).split(" ", 1)
    roll = rng.random()
    if roll < 0.6:
        module, name = rng.choice(_GLOBALS)
    elif roll < 0.8:
        module, name = str(p.ops[rng.choice(p.globals)].arg).split(" ", 1)
    elif roll < 0.9:
        module = _text(rng, module)
    else:
        name = _text(rng, name)
    return p.replace(i, global_(module, name))


def change_storage_dtype(rng: random.Random, p: ParsedPickle) -> bytes:
    """One storage declared as another type (its declared byte size changes with it)."""
    return p.replace(rng.choice(p.storage_types), global_("torch", rng.choice(_STORAGES)))


def change_storage_size(rng: random.Random, p: ParsedPickle) -> bytes:
    i = rng.choice(p.storage_sizes)
    return p.replace(i, int_(_int(rng, p.ops[i].arg)))


def change_storage_key(rng: random.Random, p: ParsedPickle) -> bytes:
    i = rng.choice(p.storage_keys)
    new = rng.choice(p.keys) if rng.random() < 0.5 else _text(rng, str(p.ops[i].arg))
    return p.replace(i, str_(new))


def change_shape(rng: random.Random, p: ParsedPickle) -> bytes:
    """A tensor's offset, size or stride changed."""
    i = rng.choice(p.tensor_ints)
    return p.replace(i, int_(_int(rng, p.ops[i].arg)))


def change_int(rng: random.Random, p: ParsedPickle) -> bytes:
    i = rng.choice(p.ints)
    return p.replace(i, int_(_int(rng, p.ops[i].arg)))


def change_string(rng: random.Random, p: ParsedPickle) -> bytes:
    i = rng.choice(p.strings)
    return p.replace(i, str_(_text(rng, p.ops[i].arg)))


def _float(x: float) -> bytes:
    return pickle.BINFLOAT + struct.pack(">d", x)


def _yaml_value(rng: random.Random, old: object) -> bytes:
    """A value a hostile model yaml would hold where ``old`` stood: widths, repeats or reg_max in the millions,
    numbers that are not finite, wrong types (text, True, None, a list, a dict), other module names."""
    huge = [10**6, 10**9, 2**31, 2**63, 10**5000, -1, 0, 3, 64, 65, 8193]
    return rng.choice(
        [
            lambda: int_(rng.choice(huge)),
            lambda: int_(_int(rng, old)),
            lambda: _float(rng.choice([math.nan, math.inf, -math.inf, 1e300, 1e6, 0.0, -0.5, 0.5, 2.0])),
            lambda: bool_(rng.random() < 0.5),
            lambda: none(),
            lambda: str_(rng.choice(["nc", "None", "Conv", "C2f", "C3k2", "Detect", "SCDown", "3", "x" * 5000])),
            lambda: str_(_text(rng, old)),
            lambda: list_(*(int_(rng.choice(huge)) for _ in range(rng.randint(0, 5)))),
            lambda: dict_({"a": int_(1)}),
        ]
    )()


def change_yaml_value(rng: random.Random, p: ParsedPickle) -> bytes:
    """One value of the recorded architecture yaml (a width, a repeat count, a module name, a from index, a
    scale's multiple, nc, reg_max, a key) replaced by a hostile one: the model-yaml checks must refuse it in one
    line or build the model it describes (when still consistent with the file's weights)."""
    if not p.yaml_values:
        return change_int(rng, p)
    i = rng.choice(p.yaml_values)
    return p.replace(i, _yaml_value(rng, p.ops[i].arg))


def inject_numpy(rng: random.Random, p: ParsedPickle) -> bytes:
    """A numpy dtype, scalar or array in place of a value (the motivating attack's surface)."""
    return p.replace(rng.choice(p.one_push), _numpy_value(rng))


def inject_tensor(rng: random.Random, p: ParsedPickle) -> bytes:
    return p.replace(rng.choice(p.one_push), _tensor_value(rng, p.storages))


def _costly_key(rng: random.Random) -> bytes:
    """A value whose hash is costly or can be made to collide: where a dict key stood, the reader must refuse it."""
    modulus = (1 << 61) - 1
    chain = none() + none() + pickle.TUPLE2  # (x, x) nested: the hash visits 2**depth elements
    for _ in range(rng.randint(1, 40)):
        chain += pickle.DUP + pickle.TUPLE2
    return rng.choice(
        [
            chain,
            tuple_(*(int_(rng.randrange(100)) for _ in range(rng.randint(0, 4)))),
            int_(modulus * rng.randint(1, 9) + rng.randint(0, 9)),
            int_(1 << rng.randint(61, 100_000)),
            reduce_(global_("builtins", "complex"), int_(rng.randint(-9, 9)), int_(rng.randint(-9, 9))),
            reduce_(global_("torch", "Size"), tuple_(int_(1), int_(2))),
            pickle.MARK + int_(1) + int_(modulus + 1) + pickle.FROZENSET,
        ]
    )


def inject_costly_key(rng: random.Random, p: ParsedPickle) -> bytes:
    """A tuple, big int, complex or torch.Size in place of a value, often a dict key (most strings are keys)."""
    return p.replace(rng.choice(p.strings if rng.random() < 0.7 else p.one_push), _costly_key(rng))


def inject_build(rng: random.Random, p: ParsedPickle) -> bytes:
    """A value followed by BUILD of some state: setting the state of whatever the stack holds there."""
    i = rng.choice(p.one_push)
    state = rng.choice([none(), int_(0), str_("x"), np_dtype_state(), tuple_(none(), none())])
    return p.replace(i, build(p.span(i), state))


def flip_pickle_bytes(rng: random.Random, p: ParsedPickle) -> bytes:
    data = bytearray(p.data)
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
    return bytes(data)


MUTATIONS: dict[str, Callable[[random.Random, ParsedPickle], bytes]] = {
    "op_drop": drop_op,
    "op_duplicate": duplicate_op,
    "op_swap": swap_ops,
    "global_rename": rename_global,
    "storage_dtype": change_storage_dtype,
    "storage_size": change_storage_size,
    "storage_key": change_storage_key,
    "tensor_shape": change_shape,
    "int_change": change_int,
    "string_change": change_string,
    "yaml_value": change_yaml_value,
    "numpy_inject": inject_numpy,
    "tensor_inject": inject_tensor,
    "build_inject": inject_build,
    "hash_key_inject": inject_costly_key,
    "pickle_byte_flip": flip_pickle_bytes,
}
