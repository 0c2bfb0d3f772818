"""How deep a loaded checkpoint's containers nest, measured without recursion.

A pickle builds nesting for a byte per level (``]`` EMPTY_LIST then APPEND), and whatever later walks the
result recursively (a repr, a comparison, ``copy.deepcopy``, a YAML dump) fails or, in C code without a
recursion guard, overflows the stack. Real checkpoints nest about 20 levels (module records inside module
records), so the reader refuses anything past :data:`detrain.weights.limits.MAX_NESTING` once the pickle is
read. Shared objects are measured once; a cycle (a list holding itself) adds no depth.

Example:
    >>> deep = []
    >>> for _ in range(300):
    ...     deep = [deep]
    >>> check_nesting(deep, 200)
    Traceback (most recent call last):
    ...
    detrain.weights.limits.Refused: its data nests deeper than 200 levels
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain
from typing import Any

from detrain.weights.inert import InertObject
from detrain.weights.limits import Refused

__all__ = ["check_nesting"]

_SEQUENCES = (list, tuple, set, frozenset)


def _children(obj: Any) -> Iterator[Any] | None:
    """What a container holds (dict keys and values, a record's arguments and state); None for a leaf."""
    if type(obj) in _SEQUENCES:
        return iter(obj)
    if isinstance(obj, dict):
        return chain.from_iterable(obj.items())
    if isinstance(obj, InertObject):
        return iter((obj.inert_args, obj.inert_kwargs, obj.inert_state))
    return None


def check_nesting(root: Any, limit: int) -> None:
    """Raise :class:`Refused` if any chain of containers inside ``root`` is longer than ``limit``."""
    kids = _children(root)
    if kids is None:
        return
    height: dict[int, int] = {}  # finished containers: the longest chain below and including them
    on_path = {id(root)}
    stack: list[tuple[Any, Iterator[Any], list[int]]] = [(root, kids, [0])]
    while stack:
        obj, it, best = stack[-1]
        for child in it:
            grandkids = _children(child)
            if grandkids is None:
                continue
            known = height.get(id(child))
            if known is not None:
                best[0] = max(best[0], known)
                continue
            if id(child) in on_path:  # a cycle: it repeats, it does not nest deeper
                continue
            if len(stack) >= limit:
                raise Refused(f"its data nests deeper than {limit} levels")
            on_path.add(id(child))
            stack.append((child, grandkids, [0]))
            break
        else:
            stack.pop()
            on_path.discard(id(obj))
            mine = best[0] + 1
            if mine > limit:
                raise Refused(f"its data nests deeper than {limit} levels")
            height[id(obj)] = mine
            if stack:
                parent_best = stack[-1][2]
                parent_best[0] = max(parent_best[0], mine)
