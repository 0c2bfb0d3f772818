"""How one argument's value is read and checked: a command-line string or a Python value becomes the key's
type (``"3"`` -> 3, ``"true"`` -> True, ``"0,2"`` -> [0, 2]), and the checks that only some keys need.

``detrain.config.keys`` names, beside each key, which of these it uses; ``detrain.config.cfg`` applies them. Every
failure is a ``ConfigError`` that names the key, the value and what would be valid.

>>> coerce("epochs", "3", int), coerce("amp", "off", bool), freeze("freeze", "0,2,1")
(3, False, [0, 1, 2])
"""

from __future__ import annotations

import functools
import math
import os
import re
import types
import unicodedata
from typing import Any, Union, get_args, get_origin

from detrain.distributed.launch.checks import parse_nnodes
from detrain.errors import ConfigError, DistributedError
from detrain.log import console
from detrain.system.net import is_sha256
from detrain.system.text import excerpt

# Integers above this (or below its negative) are typos: they overflow numpy's seeds, timers and tensor sizes.
INT_LIMIT = 2**31 - 1
# What names weights rather than an architecture yaml (as detrain.engine.build.is_weights reads model=).
WEIGHTS_SUFFIXES = (".pt", ".pth")
#: the suffixes of the files ``detrain export`` writes, which val and predict serve (:mod:`detrain.engine.backends`)
EXPORTED_SUFFIXES = (".onnx", ".torchscript", "_openvino_model", ".xml")  # the last two: an OpenVINO folder, its graph
# Bytes in one folder name on common filesystems (NAME_MAX).
NAME_MAX = 255
TRUE = {"true", "yes", "1", "on"}
FALSE = {"false", "no", "0", "off", ""}
NONE = {"null", "none", "~"}
# The longest text an error line quotes whole; longer values are excerpted.
QUOTE_CHARS = 200
# The largest stride of every detrain model (P3-P5 heads: 8, 16, 32): image sizes are multiples of it.
STRIDE = 32
# batch=-1: AutoBatch fills this fraction of each GPU's memory (as Ultralytics).
AUTO_BATCH_FRACTION = 0.6
# the narrow types first, so that 'true' is a bool and not the string 'true'
_NARROW_FIRST = {bool: 0, int: 1, float: 2, list: 3, str: 4}


def fail(key: str, value: Any, valid: str) -> ConfigError:
    """The one error line of a bad value: ``invalid value for 'imgsz': 0; expected a value from 1 to 8192``."""
    return ConfigError(f"invalid value for '{key}': {quoted(value)}; expected {valid}")


def quoted(value: Any) -> str:
    """``value`` as an error line shows it: its ``repr`` when that is short (what the user typed, recognisably),
    else a short escaped excerpt (a cfg= file's value may be a 10 MB string or a list of a million items)."""
    short = isinstance(value, (bool, float, type(None))) or (isinstance(value, int) and value.bit_length() < 256)
    if short or (isinstance(value, str) and len(value) <= QUOTE_CHARS):
        return repr(value)
    return excerpt(value, QUOTE_CHARS)


def note(text: str) -> None:
    """One line on the console about a value taken other than as given (a rounded imgsz, a cfg= file's key left
    out): printed where the arguments are read, once per reading."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def check_text(key: str, value: str) -> None:
    """No control characters (newline, NUL, escape), invisible formatting (bidi overrides, zero width) or
    undecodable bytes: they forge log lines, hide a folder's real name or break the path functions."""
    bad = next((c for c in value if unicodedata.category(c) in ("Cc", "Cf", "Cs")), None)
    if bad is not None:
        raise fail(key, value, f"text without control or invisible characters (found U+{ord(bad):04X})")


def coerce(key: str, value: Any, typ: Any) -> Any:
    """Turn a CLI string or Python value into ``typ`` (bool, int, float, list, str or a Union of them)."""
    if isinstance(value, str):
        check_text(key, value)
    if get_origin(typ) in (Union, types.UnionType):  # Union[int, str] or int | str
        options = get_args(typ)
        if type(None) in options and (value is None or (isinstance(value, str) and value.strip().lower() in NONE)):
            return None
        for option in sorted(options, key=lambda t: _NARROW_FIRST.get(t, 5)):
            if option is type(None):
                continue
            try:
                return coerce(key, value, option)
            except ConfigError:
                pass
        names = " or ".join(getattr(o, "__name__", str(o)) for o in options).replace("NoneType", "null")
        raise fail(key, value, names)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in TRUE | FALSE:
            return value.strip().lower() in TRUE
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise fail(key, value, "true or false")
    if typ is int:
        return _integer(key, value)
    if typ is float:
        if isinstance(value, bool):
            raise fail(key, value, "a number")
        try:
            number = float(value)
        except OverflowError:  # an integer beyond any float (10**400)
            raise fail(key, value, "a finite number") from None
        except (TypeError, ValueError):
            raise fail(key, value, "a number") from None
        if not math.isfinite(number):  # nan, inf, 1e400
            raise fail(key, value, "a finite number")
        return number
    if typ is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        raise fail(key, value, "a list")
    if typ is str:
        # bytes would print as "b'...'" and a container as its repr: neither names what the user meant
        if isinstance(value, (list, tuple, dict, set, frozenset, bytes, bytearray)):
            raise fail(key, value, "a string")
        text = "" if value is None else os.fspath(value) if isinstance(value, os.PathLike) else str(value)
        if not isinstance(text, str):  # a PathLike of bytes
            raise fail(key, value, "a string")
        if not isinstance(value, str):  # a str was checked above
            check_text(key, text)
        return text
    raise fail(key, value, str(typ))


def _integer(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise fail(key, value, "an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:  # exact, however long: float() would round 9007199254740993 to ...992
            return int(value.strip())
        except ValueError:
            pass  # 1e3 and 16.0 are whole numbers too, as Ultralytics reads them
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise fail(key, value, "an integer") from None
    if not math.isfinite(number) or not number.is_integer():
        raise fail(key, value, "an integer")
    return int(number)


def _id_list(key: str, value: Any, valid: str) -> tuple[list[int], bool] | None:
    """null / '' / '[]' -> None; else (the integers, whether they were given as a list)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in NONE | {"", "[]"}):
        return None
    if isinstance(value, str):
        text = value.strip()
        listed = "," in text or text.startswith(("[", "("))
        parts: list[Any] = [p.strip() for p in text.strip("[]()").split(",")] if listed else [text]
    elif isinstance(value, (list, tuple)):
        listed, parts = True, list(value)
    else:
        listed, parts = False, [value]
    try:
        return [coerce(key, part, int) for part in parts], listed
    except ConfigError:
        raise fail(key, value, valid) from None


def class_ids(key: str, value: Any) -> list[int] | None:
    """``classes``: null / '' (every class), an id, or ids as a list or a string (``0,2``, ``[0, 2]``) -> sorted
    unique ids.

    >>> class_ids("classes", "2,0,2"), class_ids("classes", 1), class_ids("classes", "")
    ([0, 2], [1], None)
    """
    found = _id_list(key, value, "class ids, e.g. classes=0 or classes=0,2")
    if found is None:
        return None
    ids = found[0]
    if any(i < 0 for i in ids):
        raise fail(key, value, "class ids of at least 0")
    return sorted(set(ids)) or None


def freeze(key: str, value: Any) -> int | list[int | str] | None:
    """``freeze``: null / '' (nothing frozen), a count N (the first N layers: ``freeze=10``), or a list of layer
    indices and, as Ultralytics' list takes them, names below a layer (``22.cv3``: the parameters whose names start
    ``model.22.cv3.``; a leading ``model.`` is taken too), as a list or a string (``freeze=0,1,2``,
    ``freeze=[0, 22.cv3]``) -> N, or the sorted unique indices, then the names.

    >>> freeze("freeze", "10"), freeze("freeze", "0,2,1"), freeze("freeze", "[5]"), freeze("freeze", [3, 3])
    (10, [0, 1, 2], [5], [3])
    >>> freeze("freeze", "[0, 22.cv3, model.22.cv2]"), freeze("freeze", "22.dfl")
    ([0, '22.cv2', '22.cv3'], ['22.dfl'])
    """
    valid = (
        "a number of first layers (freeze=10), or layer indices and names below a layer (freeze=0,1,2 or "
        "[0, 9.cv1]), each index at least 0"
    )
    if isinstance(value, str):
        check_text(key, value)
    named = _layer_names(value)
    if named is not None:
        ids = [i for i in named if isinstance(i, int)]
        if any(i > INT_LIMIT for i in ids):
            raise fail(key, value, f"layer numbers of at most {INT_LIMIT}")
        names = [n for n in named if isinstance(n, str)]
        for name in names:
            if not re.fullmatch(FREEZE_NAME, name):
                raise fail(key, value, valid + f" ({name!r} is no layer's name)")
        return [*sorted(set(ids)), *sorted(set(names))] or None
    found = _id_list(key, value, valid)
    if found is None:
        return None
    ids, listed = found
    if any(i < 0 for i in ids):
        raise fail(key, value, valid)
    if any(i > INT_LIMIT for i in ids):
        raise fail(key, value, f"layer numbers of at most {INT_LIMIT}")
    return (sorted(set(ids)) or None) if listed else ids[0]


# A name below a layer in a ``freeze`` list: the layer's index, then attribute names (``22.cv3``, ``9.cv1.conv``).
FREEZE_NAME = r"\d+(\.[A-Za-z_][A-Za-z0-9_]*)+"


def _is_name(part: Any) -> bool:
    """Whether a ``freeze`` entry names something below a layer (``22.cv3``), not a number (``10``, ``10.0``)."""
    return isinstance(part, str) and re.search(r"\.[A-Za-z_]", part) is not None


def _layer_names(value: Any) -> list[int | str] | None:
    """The entries of a ``freeze`` list that holds at least one name (``22.cv3``; ``model.22.cv3`` without its
    ``model.``), indices as integers; None when it holds none (then it is read as indices or a count)."""
    if isinstance(value, str):
        text = value.strip()
        parts: list[Any] = [p.strip().strip("'\"") for p in text.strip("[]()").split(",")]
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        return None
    if not any(_is_name(p) for p in parts):
        return None
    out: list[int | str] = []
    for part in parts:
        if _is_name(part):
            name = part.strip()
            out.append(name[len("model.") :] if name.startswith("model.") else name)
        else:
            number = coerce("freeze", part, int)
            if number < 0:
                raise fail("freeze", value, "layer indices of at least 0")
            out.append(number)
    return out


def cache_mode(key: str, value: Any) -> bool | str:
    """``cache``: false or a word (its choices are checked next); ``cache=true`` means the RAM cache, as users
    know it."""
    value = coerce(key, value, bool | str)
    return "ram" if value is True else value


def compile_mode(key: str, value: Any) -> bool | str:
    """``compile``: false, or how torch.compile builds the training forward: true is inductor's default mode; a
    mode by name (its choices are checked next); aot_eager traces without generating code (a cheap check that the
    model compiles).

    >>> compile_mode("compile", "true"), compile_mode("compile", "False"), compile_mode("compile", "max-autotune")
    ('default', False, 'max-autotune')
    """
    value = coerce(key, value, bool | str)
    if isinstance(value, str):
        return value.strip().lower()
    return "default" if value is True else value


def auto_or_count(key: str, value: Any) -> int | str:
    """``nbs``, ``workers``: the word auto (any case) or an integer (its bounds are checked next); any other word is
    refused."""
    value = coerce(key, value, int | str)
    if isinstance(value, str):
        if value.strip().lower() != "auto":
            raise fail(key, value, "auto or an integer of at least 1" if key == "nbs" else "auto or an integer")
        return "auto"
    return value


def flag_or_half(key: str, value: Any) -> bool:
    """``multi_scale``: true or false, or Ultralytics 8.4's fraction of imgsz where it means the same: 0 (off) or
    0.5 (+-50%, detrain's range); another fraction is refused with what detrain varies by.

    >>> flag_or_half("multi_scale", "0.5"), flag_or_half("multi_scale", 0.0), flag_or_half("multi_scale", "true")
    (True, False, True)
    """
    if isinstance(value, bool) or (isinstance(value, str) and value.strip().lower() in ("true", "false")):
        return bool(coerce(key, value, bool))
    number = coerce(key, value, float)
    if number in (0.0, 0.5):
        return number == 0.5
    raise fail(key, value, "true or 0.5 (imgsz varied by +-50% per batch), or false or 0 (off)")


class ImageSize(int):
    """An ``imgsz`` given as a rectangle, ``[h, w]`` (``imgsz=480,640``): the int of its long side, which is what
    training and every reader of one size take, and its ``hw``, which val, predict and export take. Written back
    (args.yaml, ``Cfg.to_dict``) as the list ``[h, w]``.

    >>> size = ImageSize(480, 640)
    >>> size, int(size), size.hw, image_hw(size), image_hw(320)
    ([480, 640], 640, (480, 640), (480, 640), (320, 320))
    """

    hw: tuple[int, int]

    def __new__(cls, h: int, w: int) -> ImageSize:
        size = super().__new__(cls, max(h, w))
        size.hw = (int(h), int(w))
        return size

    def __getnewargs__(self) -> tuple[int, int]:  # type: ignore[override]
        return self.hw

    def __repr__(self) -> str:
        return f"[{self.hw[0]}, {self.hw[1]}]"

    __str__ = __repr__


def image_hw(imgsz: int) -> tuple[int, int]:
    """(h, w) of an ``imgsz``: a rectangle's own, else the square of its one size."""
    return imgsz.hw if isinstance(imgsz, ImageSize) else (int(imgsz), int(imgsz))


def image_size(key: str, value: Any) -> int:
    """``imgsz``: one size (``640``; checked by :func:`stride_multiple`), or Ultralytics' rectangle ``[h, w]``
    (``480,640``, ``[480, 640]``, a list or tuple) whose sides must each be a multiple of the largest stride, from 1
    to 8192 -> an :class:`ImageSize` (``[640, 640]`` is 640).

    >>> image_size("imgsz", "480,640"), image_size("imgsz", [640, 640]), image_size("imgsz", "[320]")
    ([480, 640], 640, 320)
    >>> image_size("imgsz", "480,650")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    detrain.errors.ConfigError: invalid value for 'imgsz': '480,650'; expected one size, or [h, w] with h and w ...
    """
    valid = f"one size, or [h, w] with h and w multiples of {STRIDE} (the largest stride) from {STRIDE} to 8192, e.g. "
    valid += "imgsz=480,640"
    given = value
    if isinstance(value, str):
        check_text(key, value)
        text = value.strip()
        if "," in text or text.startswith(("[", "(")):
            inner = text.strip("[]()").strip()
            value = [p.strip() for p in inner.split(",")] if inner else []
    if isinstance(value, (list, tuple)):
        try:
            sides = [coerce(key, side, int) for side in value]
        except ConfigError:
            raise fail(key, given, valid) from None
        if len(sides) == 1:
            return sides[0]
        if len(sides) != 2 or any(side < STRIDE or side > 8192 or side % STRIDE for side in sides):
            raise fail(key, given, valid)
        return sides[0] if sides[0] == sides[1] else ImageSize(sides[0], sides[1])
    return coerce(key, value, int)


def stride_multiple(key: str, value: int) -> int:
    """``imgsz``: a size that is no multiple of the largest stride is rounded up to the next one (at least one
    stride), with one line naming both, as Ultralytics' check_imgsz does; a rectangle was checked whole where it
    was read (:func:`image_size`).

    >>> stride_multiple("imgsz", 640), stride_multiple("imgsz", 100), stride_multiple("imgsz", 16)
    warning: imgsz=100 is not a multiple of the largest stride 32; using imgsz=128
    warning: imgsz=16 is not a multiple of the largest stride 32; using imgsz=32
    (640, 128, 32)
    """
    if isinstance(value, ImageSize):
        return value
    rounded = max(-(-value // STRIDE) * STRIDE, STRIDE)
    if rounded != value:
        note(f"warning: {key}={value} is not a multiple of the largest stride {STRIDE}; using {key}={rounded}")
    return rounded


def idle_device(key: str, value: Any) -> Any:
    """``device``: Ultralytics' ``-1`` (the idlest GPU; ``-1,-1`` two of them) resolved here, once, to the GPU
    indices picked (one line says which), or to '' (the CPU) where there is no GPU; any other value as given
    (:func:`detrain.distributed.launch.devices.parse_device` checks it where the workers start)."""
    from detrain.distributed.launch.devices import resolve_idle

    resolved, line = resolve_idle(value)
    if line:
        note(f"note: {line}")
    return resolved


def amp_mode(key: str, value: Any) -> bool | str:
    """``amp``: true or false, or the dtype to train in: bf16 or fp16 (fp32 is false), any case.

    >>> amp_mode("amp", "true"), amp_mode("amp", "BF16"), amp_mode("amp", "fp16"), amp_mode("amp", "fp32")
    (True, 'bf16', 'fp16', False)
    """
    if isinstance(value, str) and value.strip().lower() in ("bf16", "fp16", "fp32"):
        word = value.strip().lower()
        return False if word == "fp32" else word
    try:
        return coerce(key, value, bool)
    except ConfigError:
        raise fail(key, value, "true, false, bf16, fp16 or fp32") from None


def batch_size(key: str, value: Any) -> int | float:
    """``batch``: a number of images (at least 1), or AutoBatch on CUDA: -1 (a batch filling
    :data:`AUTO_BATCH_FRACTION` of the GPU's memory) or the fraction itself, between 0 and 1.

    >>> batch_size("batch", "16"), batch_size("batch", "16.0"), batch_size("batch", -1), batch_size("batch", "0.7")
    (16, 16, -1, 0.7)
    """
    valid = "a number of images of at least 1, or AutoBatch: -1 (60% of the GPU's memory) or a fraction from 0 to 1"
    try:
        number = coerce(key, value, int | float)
    except ConfigError:
        raise fail(key, value, valid) from None
    if isinstance(number, float) and 0 < number < 1:
        return number
    if isinstance(number, int) and (number >= 1 or number == -1):
        return number
    raise fail(key, number, valid)


def is_auto_batch(batch: float) -> bool:
    """Whether ``batch`` asks AutoBatch for a size (-1 or a fraction) rather than giving one.

    >>> is_auto_batch(16), is_auto_batch(-1), is_auto_batch(0.5)
    (False, True, True)
    """
    return batch == -1 or 0 < batch < 1


def auto_batch_fraction(batch: float) -> float:
    """The fraction of GPU memory an AutoBatch ``batch`` fills: its own, or :data:`AUTO_BATCH_FRACTION` for -1."""
    return AUTO_BATCH_FRACTION if batch == -1 else float(batch)


def sha256_or_empty(key: str, value: str) -> str:
    value = value.strip().lower()
    if value and not is_sha256(value):
        raise fail(key, value, "'' or a sha256: the 64 hex digits sha256sum prints")
    return value


def flag_or_weights(key: str, value: bool | str) -> bool | str:
    """``pretrained``: true, false, or a weights file (a yaml here is a slip for model=)."""
    if isinstance(value, str) and not value.strip().endswith(WEIGHTS_SUFFIXES):
        raise fail(key, value, "true, false or a weights file (.pt) whose matching layers start the model")
    return value


def zero_only(key: str, value: float) -> float:
    """``copy_paste``: Ultralytics' copy-paste cuts objects out along their polygons; detrain's labels are boxes."""
    if value:
        raise fail(
            key,
            value,
            "0: copy-paste needs instance polygons (segment labels) and detrain's labels are "
            "boxes; use cutmix= or mixup= instead",
        )
    return value


def same_failures(key: str, value: int) -> int:
    """``restart_same_failures``: a repeat needs two failures to compare (1 would stop after any failure)."""
    if value == 1:
        raise fail(key, value, "0 (never stop early) or 2 and more: a failure repeats only from its second time")
    return value


@functools.lru_cache(maxsize=32)
def node_range(nnodes: str) -> tuple[int, int]:
    """``nnodes`` as (MIN, MAX) nodes: parsed once per value, however many checks and readers ask."""
    return parse_nnodes(nnodes)


def node_count(key: str, value: str) -> str:
    """``nnodes``: a count or MIN:MAX, as torchrun reads it."""
    try:
        node_range(value)
    except DistributedError:
        raise fail(key, value, "a node count like 2 or a range MIN:MAX like 1:4") from None
    return value


def folder(key: str, value: str) -> str:
    """``name`` is one folder inside ``project`` (no separators, no '.' or '..': the run stays where resume=true
    and the increment look for it); every folder of either fits a filesystem's name limit."""
    if not value:
        return value
    parts = value.replace("\\", "/").split("/")
    if key == "name" and (len(parts) > 1 or value.strip() in (".", "..")):
        raise fail(key, value, "one folder name without '/', '\\', '.' or '..'; put parent folders in project=")
    if any(len(part.encode()) > NAME_MAX for part in parts):
        raise fail(key, value, f"folder names of at most {NAME_MAX} bytes")
    return value
