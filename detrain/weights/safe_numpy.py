"""numpy scalars, dtypes and arrays in a checkpoint, rebuilt without numpy's own unpickling code.

numpy pickles a dtype as ``numpy.dtype(name, align, copy)`` followed by BUILD of a state tuple that
``dtype.__setstate__`` applies verbatim, flags included, and an array as ``_reconstruct(ndarray, (0,), b'b')``
followed by BUILD of ``(version, shape, dtype, is_fortran, raw bytes)``. Letting those BUILDs reach numpy is
how a 3.7 KB file crashed the loader: clearing the flags of an object dtype turns raw bytes from the file
into ``PyObject *`` pointers. Here:

- a dtype is looked up *by name* in a fixed table of plain number types (bool, ints, uints, floats,
  complex); its BUILD state must be exactly what numpy writes for that type, and only its byte order is
  taken from it. Nothing is ever set on a numpy dtype;
- an array is a :class:`PendingArray` record until its BUILD, whose state is checked (a number dtype from
  above, a bounded shape, raw bytes of exactly ``prod(shape) * itemsize``) and turned into a fresh array
  with ``numpy.frombuffer(...).copy()``; ndarray.__setstate__ never runs;
- a scalar is ``numpy.frombuffer(bytes, dtype)[0]`` over exactly ``itemsize`` bytes.

Any other numpy name (object arrays, masked arrays, ``numpy.dtypes.*``, protocol-5 buffers) is refused by
the unpickler's allow-list.

Example:
    >>> rec = numpy_dtype("f8", False, True)  # the PendingDtype of numpy.dtype("f8", False, True)
    >>> rec.build((3, ">", None, None, None, -1, -1, 0))
    dtype('>f8')
"""

from __future__ import annotations

from typing import Any, Literal, cast

import numpy as np

from detrain.weights import limits
from detrain.weights.limits import Refused, shown

__all__ = [
    "NUMERIC_DTYPES",
    "PendingArray",
    "PendingDtype",
    "numpy_dtype",
    "numpy_reconstruct",
    "numpy_scalar",
    "resolve_dtype",
]

# What numpy writes as the first argument of numpy.dtype(...) for each plain number type.
NUMERIC_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in ("b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16")
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class PendingDtype:
    """A ``numpy.dtype(name)`` call waiting for its BUILD; holds the native-order dtype until then."""

    __slots__ = ("dtype", "memo_keys")

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = dtype
        self.memo_keys: list[Any] = []

    def build(self, state: Any) -> np.dtype:
        """The dtype numpy's state describes: checked field by field, only the byte order is used."""
        if not isinstance(state, tuple) or len(state) not in (8, 9):
            raise Refused("a numpy dtype state that is not the 8- or 9-field tuple numpy writes")
        version, byteorder, subarray, names, fields, elsize, alignment, flags = state[:8]
        metadata = state[8] if len(state) == 9 else None
        # Types before values: a numpy array here would turn == into an elementwise (ambiguous) comparison.
        if not (_is_int(version) and (version, len(state)) in ((3, 8), (4, 9)) and metadata is None):
            raise Refused(f"a numpy dtype state of version {shown(version)} (3 or 4 without metadata)")
        if subarray is not None or names is not None or fields is not None:
            raise Refused("a numpy dtype with fields or a subarray (plain number types only)")
        if not (
            _is_int(flags)
            and flags == 0
            and _is_int(elsize)
            and elsize == -1
            and _is_int(alignment)
            and alignment == -1
        ):
            given = ", ".join(shown(v) for v in (flags, elsize, alignment))
            raise Refused(f"a numpy dtype state that sets flags/size/alignment ({given})")
        one_byte = self.dtype.itemsize == 1
        if not isinstance(byteorder, str) or byteorder not in (("|",) if one_byte else ("<", ">", "=")):
            raise Refused(f"numpy dtype byte order {shown(byteorder, 8)} for {self.dtype.str[1:]}")
        if one_byte:
            return self.dtype
        return self.dtype.newbyteorder(cast(Literal["<", ">", "="], byteorder))  # one of these, checked above


class PendingArray:
    """A ``numpy.core.multiarray._reconstruct`` result waiting for the BUILD that gives it its data."""

    __slots__ = ("memo_keys",)

    def __init__(self) -> None:
        self.memo_keys: list[Any] = []

    def build(self, state: Any, spend: Any) -> np.ndarray:
        """The array numpy's ``(version, shape, dtype, is_fortran, raw)`` state describes, as a fresh copy."""
        if isinstance(state, tuple) and len(state) == 5 and _is_int(state[0]) and state[0] == 1:
            state = state[1:]
        if not isinstance(state, tuple) or len(state) != 4:
            raise Refused("a numpy array state that is not (1, shape, dtype, is_fortran, bytes)")
        shape, dtype, fortran, raw = state
        dt = resolve_dtype(dtype)
        if not isinstance(shape, tuple) or len(shape) > limits.MAX_ARRAY_DIMS:
            raise Refused(f"a numpy array shape that is not a tuple of at most {limits.MAX_ARRAY_DIMS} sizes")
        numel = 1
        for s in shape:
            if not _is_int(s) or s < 0 or s > limits.MAX_MADE_BYTES:
                raise Refused(f"a numpy array size {shown(s)}")
            numel *= s
            if numel > limits.MAX_MADE_BYTES:
                raise Refused("a numpy array larger than the reader's copy allowance")
        if not isinstance(fortran, bool) or not isinstance(raw, bytes):
            raise Refused("a numpy array whose data is not raw bytes (object arrays are not read)")
        if len(raw) != numel * dt.itemsize:
            raise Refused(f"a numpy array of shape {shape} {dt.str} with {len(raw)} bytes of data")
        spend(len(raw), "numpy array data")
        flat = np.frombuffer(raw, dtype=dt)
        return flat.reshape(shape, order="F" if fortran else "C").copy(order="K")


def resolve_dtype(value: Any) -> np.dtype:
    """A dtype argument (a finished dtype or a PendingDtype) as a plain-number np.dtype, else a refusal."""
    if isinstance(value, PendingDtype):
        value = value.dtype
    if not isinstance(value, np.dtype) or value.newbyteorder("=") not in NUMERIC_DTYPES.values():
        what = repr(value.str) if isinstance(value, np.dtype) else shown(value)
        raise Refused(f"a numpy value whose dtype is {what}, not a plain number type")
    return value


def numpy_dtype(spec: Any, align: Any = False, copy: Any = True) -> PendingDtype:
    """``numpy.dtype(spec, align, copy)`` for a plain number type named in NUMERIC_DTYPES."""
    if not isinstance(spec, str) or spec not in NUMERIC_DTYPES:
        raise Refused(f"numpy dtype {shown(spec, 32)} is not a plain number type (one of {', '.join(NUMERIC_DTYPES)})")
    if not (type(align) in (bool, int) and align in (0, 1) and type(copy) in (bool, int) and copy in (0, 1)):
        # numpy writes bools (0/1 in old files)
        raise Refused("numpy dtype flags that are not booleans")
    return PendingDtype(NUMERIC_DTYPES[spec])


def numpy_scalar(dtype: Any, data: Any = None) -> Any:
    """``numpy.core.multiarray.scalar(dtype, bytes)``: one number from exactly ``itemsize`` bytes."""
    dt = resolve_dtype(dtype)
    if not isinstance(data, bytes) or len(data) != dt.itemsize:
        raise Refused(f"a numpy {dt.str} scalar that is not {dt.itemsize} raw bytes")
    return np.frombuffer(data, dtype=dt, count=1)[0]


NDARRAY = object()  # stands for numpy.ndarray: only ever the first argument of _reconstruct, never called


def numpy_reconstruct(subtype: Any, shape: Any, typecode: Any) -> PendingArray:
    """``_reconstruct(ndarray, (0,), b'b')``, the empty array numpy's BUILD then fills."""
    if subtype is not NDARRAY:
        raise Refused("a numpy array of a class other than numpy.ndarray")
    if not (
        type(shape) is tuple
        and len(shape) == 1
        and _is_int(shape[0])
        and shape[0] == 0
        and type(typecode) in (bytes, str)
        and typecode in (b"b", "b")
    ):
        raise Refused("a numpy _reconstruct call with arguments numpy never writes")
    return PendingArray()
