"""How much a checkpoint file may ask the restricted reader for, and how a refusal travels.

Every figure below bounds something a file *declares* (a record size, a storage size, a number of opcodes,
memo entries, classes, nesting levels), so the reader can say no before it allocates or loops on the file's
word. The defaults leave wide room over what real checkpoints need (measured on the YOLOv8n release file:
361 zip records, an 80 KB data.pkl of 35k opcodes, 6.9k memo entries, 23 distinct globals, 22 nesting levels,
6.2 MB of tensors) and keep the worst a hostile file can cost to a few hundred MB of memory and a second or
so of work. They are module attributes, read at each load, so a caller (or a test) may change them.
"""

from __future__ import annotations

from typing import Any

MiB = 1 << 20
GiB = 1 << 30

# The zip archive
MAX_RECORDS = 100_000  # zip records; torch writes one per storage plus a handful
MAX_PICKLE_BYTES = 32 * MiB  # data.pkl; the pickle only describes tensors, their bytes are elsewhere
MAX_RECORD_BYTES = 1 * GiB  # one record (one storage); YOLOv8x's largest is 4.7 MB
MAX_TOTAL_BYTES = 4 * GiB  # all records together, and all storages a pickle declares together
DEFLATE_MAX_RATIO = 1032  # deflate cannot expand more than this; a record claiming more is a lie
# All records together may inflate to this many times the file's size, plus the slack: an honest deflated
# checkpoint inflates about 1.1x (torch stores records uncompressed: 1x), a zip bomb of zeros about 1000x.
MAX_INFLATION = 32
INFLATION_SLACK = 64 * MiB

# The pickle program
MAX_PICKLE_OPS = 2_000_000  # opcodes executed
MAX_MEMO = 200_000  # distinct memo entries
MAX_GLOBALS = 1_000  # distinct globals (classes and functions) named
MAX_NAME_CHARS = 256  # one module or class name
MAX_NESTING = 200  # containers inside containers, on any path
MAX_MADE_BYTES = 256 * MiB  # bytes the reconstructors may copy (bytes records, numpy data, argument tuples)
MAX_TENSOR_DIMS = 32
MAX_ARRAY_DIMS = 32


class Refused(Exception):
    """A request the reader will not serve; the loader turns it into "refusing to load <file>: <reason>"."""


def size_text(nbytes: int) -> str:
    """``1536`` -> ``'1.5 KiB'``: sizes in refusals read at a glance."""
    value = float(nbytes)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} bytes"  # unreachable; keeps type checkers calm


def shown(value: Any, width: int = 40) -> str:
    """A value from a file as a short one-line text for a refusal: numbers and text clipped, else its type.

    Never the value's own ``repr``: a file's value may be a 30 MB string, an int too long for ``str()`` or a
    list nested a million deep.

    Example:
        >>> shown(7), shown("x" * 50, 6), shown(10**5000), shown([[]])
        ('7', "'xxxxxx'...", 'an int of 16610 bits', 'a list')
    """
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        return str(value) if abs(value) < 10**18 else f"an int of {value.bit_length()} bits"
    if isinstance(value, (str, bytes)):
        return repr(value[:width]) + ("..." if len(value) > width else "")
    return f"a {type(value).__name__}"


def max_imgsz() -> int:
    """The largest image size detrain runs a model at: the upper bound of the ``imgsz=`` key, read from its spec
    (:mod:`detrain.config.keys`, the one source), so a size a file records is held to what the command line is.

    >>> max_imgsz()
    8192
    """
    from detrain.config.keys import SPECS  # lazily: the reader itself needs no argument machinery

    high = SPECS["imgsz"].high
    assert high is not None  # the key is bounded; a spec without a bound would be a bug here
    return int(high)


def imgsz_problem(value: Any) -> str | None:
    """Why ``value``, an image size a checkpoint or an export records (one side, or a list of sides), is none that
    detrain runs at, or None when it is one. Bounded as ``imgsz=`` is (1 to :func:`max_imgsz`): a recorded 2**20
    would make an export trace, or a fixed-size graph letterbox every image, at terabytes.

    >>> imgsz_problem(640), imgsz_problem([64, 96]), imgsz_problem(1 << 20), imgsz_problem([0, 32])
    (None, None, 'imgsz=1048576 is outside 1 to 8192, the bound of imgsz=', 'imgsz=[0, 32] is outside 1 to 8192, the \
bound of imgsz=')
    """
    if isinstance(value, (list, tuple)) and not 1 <= len(value) <= 2:
        return f"imgsz is a {type(value).__name__} of {len(value)} values, not one size or two"
    sides = list(value) if isinstance(value, (list, tuple)) else [value]
    high = max_imgsz()
    if all(type(side) is int and 1 <= side <= high for side in sides):
        return None
    text = "[" + ", ".join(shown(side) for side in sides) + "]" if isinstance(value, (list, tuple)) else shown(value)
    return f"imgsz={text} is outside 1 to {high}, the bound of imgsz="
