"""Inert records: what the restricted unpickler (:mod:`detrain.weights.safe_pickle`) makes of a class from a
namespace that only holds data for us (``torch.nn.modules.*``, ``types.SimpleNamespace``, ``pathlib`` paths,
or a caller's ``inert_modules`` such as ``ultralytics``). A record keeps the constructor arguments and the
``__setstate__`` state it was given and never imports or calls anything."""

from __future__ import annotations

from typing import Any

__all__ = ["InertObject", "inert_class", "is_inert_namespace"]


class InertObject:
    """Stands in for an object of a class we will not import: keeps its arguments and state, runs nothing.

    Each pickled class name gets its own subclass (see :func:`inert_class`), so ``type(obj).__name__``
    still reads ``Conv`` or ``DetectionModel``; the full name is in ``obj.inert_name``.

    Example:
        >>> cls = inert_class("ultralytics.nn.modules", "Conv")
        >>> obj = cls.__new__(cls); obj.__setstate__({"c": 1})
        >>> obj.inert_name, obj.inert_state
        ('ultralytics.nn.modules.Conv', {'c': 1})
    """

    inert_module: str = ""
    inert_qualname: str = ""
    inert_args: tuple[Any, ...]  # set in __new__, past any __setattr__ a subclass could have
    inert_kwargs: dict[str, Any]
    inert_state: Any

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
# Classes are kept for reuse across loads up to this many names; past it (files naming thousands of made-up
# classes) each load makes its own, freed with it, so a long-lived process does not grow with every file.
_MAX_CACHED_CLASSES = 4096


def inert_class(module: str, qualname: str) -> type[InertObject]:
    """The record class for ``module.qualname`` (one per name, so ``type(obj).__name__`` reads as the original)."""
    key = (module, qualname)
    cls = _INERT_CLASSES.get(key)
    if cls is None:
        name = qualname.rsplit(".", 1)[-1] or "Inert"
        cls = type(name, (InertObject,), {"inert_module": module, "inert_qualname": qualname})
        if len(_INERT_CLASSES) < _MAX_CACHED_CLASSES:
            _INERT_CLASSES[key] = cls
    return cls


# Namespaces whose classes we only ever need as data. Nothing is imported from them: every name in them
# becomes an InertObject record, so even a function among them can only be "called" into a record.
# Callers add their own whole modules (with everything under them) through ``inert_modules``.
_INERT_MODULES = ("torch.nn.modules",)
_INERT_NAMES = {
    "types": {"SimpleNamespace"},
    "argparse": {"Namespace"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "datetime": {"datetime", "date", "time", "timedelta", "timezone"},
}


def _in_modules(module: str, modules: tuple[str, ...]) -> bool:
    return any(module == m or module.startswith(m + ".") for m in modules)


def is_inert_namespace(module: str, name: str, extra_modules: tuple[str, ...] = ()) -> bool:
    """Whether ``module.name`` becomes a record: a built-in data-only namespace or one of ``extra_modules``.

    Example:
        >>> is_inert_namespace("torch.nn.modules.conv", "Conv2d"), is_inert_namespace("os", "system")
        (True, False)
    """
    if _in_modules(module, _INERT_MODULES) or _in_modules(module, extra_modules):
        return True
    return name in _INERT_NAMES.get(module, ())
