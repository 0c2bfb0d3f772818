"""The one yaml loader of detrain: PyYAML's safe loader with bounds on what a file can make its reader build.

``yaml.safe_load`` runs nothing, but it trusts a file's size and shape: a ~500-byte yaml of nested aliases (nine
lists of nine references to the one before) loads in a millisecond as a shared graph, and the first ``repr``,
``str`` or walk over it expands 9^9 items: 6 GB and a MemoryError traceback. Nesting 10,000 levels deep exhausts
Python's recursion, and a 5,000-digit integer makes ``int()`` raise. So this loader:

* reads at most :data:`MAX_YAML_BYTES` (16 MiB) of a regular file (no FIFO, no device: ``read_input_text``);
* refuses nesting deeper than :data:`MAX_DEPTH` (64) levels;
* lets aliases expand the document to at most twice its own text plus :data:`ALIAS_ALLOWANCE` (100,000) nodes and
  characters, counted over the expanded tree before anything is built; a recursive alias is refused;
* turns every PyYAML error (and ``int()``'s refusal of a huge number) into one :class:`YamlRefused` line.

>>> load_yaml("a: &x [1, 2]\\nb: *x")
{'a': [1, 2], 'b': [1, 2]}
>>> bomb = "a0: &a0 [x, x, x, x, x, x, x, x, x]\\n" + "".join(
...     f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\\n" for i in range(1, 9))
>>> load_yaml(bomb)
Traceback (most recent call last):
...
detrain.system.safe_yaml.YamlRefused: its aliases expand it past 100936 nodes and characters (twice its own ...)
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from detrain.system.input_file import read_input_text, reason_of
from detrain.system.text import excerpt

MAX_YAML_BYTES = 16 << 20
MAX_DEPTH = 64
ALIAS_ALLOWANCE = 100_000


class YamlRefused(ValueError):
    """A yaml that is not loaded: unreadable, malformed, too deep or expanding too far; the reason is one short
    line without the file's name (the caller names the file)."""


def read_yaml(path: str | os.PathLike, limit: int = MAX_YAML_BYTES) -> Any:
    """The document of the yaml file ``path`` (a regular file of at most ``limit`` bytes), loaded by
    :func:`load_yaml`; :class:`YamlRefused` for anything else, ``FileNotFoundError`` when it is missing."""
    try:
        text = read_input_text(path, limit)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise YamlRefused(f"cannot read it ({reason_of(e)})") from None
    return load_yaml(text)


def load_yaml(text: str) -> Any:
    """The one document of ``text`` as ``yaml.safe_load`` gives it, within the bounds of the module docstring."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    except YamlRefused:
        raise
    except yaml.YAMLError as e:
        raise YamlRefused(f"not valid YAML ({_yaml_reason(e)})") from None
    except RecursionError:
        raise YamlRefused(f"nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, OverflowError) as e:  # int() of a number with thousands of digits
        raise YamlRefused(f"a value cannot be read ({excerpt(str(e), 100, quote=False)})") from None
    finally:
        loader.dispose()


def _yaml_reason(error: yaml.YAMLError) -> str:
    """A PyYAML error in one short line: what is wrong and where (its message spans lines with a quoted snippet)."""
    if isinstance(error, yaml.MarkedYAMLError):
        mark = error.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        return excerpt(" ".join(str(error.problem or error.context or "").split()), 100, quote=False) + where
    return excerpt(" ".join(str(error).split()), 100, quote=False)


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts nesting while composing and measures the expanded document before constructing."""

    def __init__(self, text: str):
        super().__init__(text)
        self._depth = 0
        self._budget = 2 * len(text) + ALIAS_ALLOWANCE

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise YamlRefused(f"nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> yaml.Node | None:
        node = super().compose_document()
        if node is not None:
            _check_expansion(node, self._budget)
        return node


def _check_expansion(root: yaml.Node, budget: int) -> None:
    """Refuse a node graph whose tree, aliases expanded, exceeds ``budget`` nodes plus scalar characters, is deeper
    than :data:`MAX_DEPTH`, or refers to itself. Each distinct node is measured once (memoised, iteratively), so
    the check costs the size of the graph, not of its expansion."""
    sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded size, expanded depth)
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            kids = [sizes[id(c)] for c in _children(node)]
            size = 1 + sum(s for s, _ in kids) + (len(node.value) if isinstance(node, yaml.ScalarNode) else 0)
            depth = 1 + max((d for _, d in kids), default=0)
            if size > budget:
                raise YamlRefused(
                    f"its aliases expand it past {budget} nodes and characters (twice its own size plus "
                    f"{ALIAS_ALLOWANCE})"
                )
            if depth > MAX_DEPTH:
                raise YamlRefused(f"its aliases nest it deeper than {MAX_DEPTH} levels")
            sizes[key] = (size, depth)
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise YamlRefused("an alias refers to the collection that contains it (a recursive yaml)")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []
