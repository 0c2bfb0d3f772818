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
import types
import unicodedata
from typing import Any, Union, get_args, get_origin

from detrain.distributed.launch_checks import parse_nnodes
from detrain.errors import ConfigError, DistributedError
from detrain.system.net import is_sha256

# Integers above this (or below its negative) are typos: they overflow numpy's seeds, timers and tensor sizes.
INT_LIMIT = 2**31 - 1
# What names weights rather than an architecture yaml (as detrain.engine.build.is_weights reads model=).
WEIGHTS_SUFFIXES = (".pt", ".pth")
# Bytes in one folder name on common filesystems (NAME_MAX).
NAME_MAX = 255
TRUE = {"true", "yes", "1", "on"}
FALSE = {"false", "no", "0", "off", ""}
NONE = {"null", "none", "~"}
# the narrow types first, so that 'true' is a bool and not the string 'true'
_NARROW_FIRST = {bool: 0, int: 1, float: 2, list: 3, str: 4}


def fail(key: str, value: Any, valid: str) -> ConfigError:
    """The one error line of a bad value: ``invalid value for 'imgsz': 33; expected a multiple of 32 ...``."""
    return ConfigError(f"invalid value for '{key}': {value!r}; expected {valid}")


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


def freeze(key: str, value: Any) -> int | list[int] | None:
    """``freeze``: null / '' (nothing frozen), a count N (the first N layers: ``freeze=10``), or layer indices as a
    list or a string (``freeze=0,1,2``, ``freeze=[0, 1]``) -> N, or the sorted unique indices.

    >>> freeze("freeze", "10"), freeze("freeze", "0,2,1"), freeze("freeze", "[5]"), freeze("freeze", [3, 3])
    (10, [0, 1, 2], [5], [3])
    """
    valid = "a number of first layers (freeze=10) or layer indices (freeze=0,1,2 or [0, 1]), each at least 0"
    if isinstance(value, str):
        check_text(key, value)
    found = _id_list(key, value, valid)
    if found is None:
        return None
    ids, listed = found
    if any(i < 0 for i in ids):
        raise fail(key, value, valid)
    if any(i > INT_LIMIT for i in ids):
        raise fail(key, value, f"layer numbers of at most {INT_LIMIT}")
    return (sorted(set(ids)) or None) if listed else ids[0]


def cache_mode(key: str, value: Any) -> bool | str:
    """``cache``: false or a word (its choices are checked next); ``cache=true`` means the RAM cache, as users
    know it."""
    value = coerce(key, value, bool | str)
    return "ram" if value is True else value


def auto_or_count(key: str, value: Any) -> int | str:
    """``nbs``: the word auto (any case) or an integer (its bounds are checked next); any other word is refused."""
    value = coerce(key, value, int | str)
    if isinstance(value, str):
        if value.strip().lower() != "auto":
            raise fail(key, value, "auto or an integer of at least 1")
        return "auto"
    return value


def multiple_of_32(key: str, value: int) -> int:
    if value % 32:
        raise fail(key, value, "a multiple of 32 (the largest stride)")
    return value


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
