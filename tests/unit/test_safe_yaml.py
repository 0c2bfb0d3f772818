"""The one yaml loader (issue 25, items 2 and 7): fuzzed alias graphs, deep nesting and huge scalars load within
their bounds or are one YamlRefused line, quickly; excerpts stay short whatever they quote."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml

from detrain.system.safe_yaml import ALIAS_ALLOWANCE, MAX_DEPTH, YamlRefused, load_yaml, read_yaml
from detrain.system.text import excerpt, listed


def _expanded(value: object) -> int:
    """Nodes plus scalar characters of ``value`` with shared parts counted each time they appear (memoised)."""
    memo: dict[int, int] = {}

    def size(v: object) -> int:
        if isinstance(v, (list, dict)):
            if id(v) not in memo:
                items = [x for kv in v.items() for x in kv] if isinstance(v, dict) else v
                memo[id(v)] = 1 + sum(size(x) for x in items)
            return memo[id(v)]
        return 1 + len(str(v))

    return size(value)


def _random_alias_yaml(rng: np.random.Generator) -> str:
    """Anchored lists and maps, each referring to random earlier ones, some scalars long: most expand far."""
    lines = []
    for i in range(int(rng.integers(1, 14))):
        parts = []
        for _ in range(int(rng.integers(1, 12))):
            if i and rng.random() < 0.7:
                parts.append(f"*a{int(rng.integers(0, i))}")
            else:
                parts.append("x" * int(rng.integers(1, 500)))
        if rng.random() < 0.5:
            lines.append(f"a{i}: &a{i} [{', '.join(parts)}]")
        else:
            lines.append(f"a{i}: &a{i} {{{', '.join(f'k{j}: {p}' for j, p in enumerate(parts))}}}")
    return "\n".join(lines) + "\n"


def test_random_alias_graphs_load_within_budget_or_are_refused() -> None:
    rng = np.random.default_rng(0)
    refused = 0
    for _ in range(150):
        text = _random_alias_yaml(rng)
        message = ""
        try:
            doc = load_yaml(text)
        except YamlRefused as e:
            refused, message = refused + 1, str(e)
        else:
            # what loads is bounded as promised (small slack: the loader counts yaml nodes, this counts values)
            assert _expanded(doc) <= 2 * (2 * len(text) + ALIAS_ALLOWANCE)
        assert "\n" not in message and len(message) < 200
    assert 10 < refused < 150  # both outcomes happen


@pytest.mark.parametrize(
    "deep",
    [
        "[" * 10_000 + "]" * 10_000,
        "{a: " * 3000 + "1" + "}" * 3000,
        "".join(f"{'  ' * i}- \n" for i in range(2000)),
        "".join(f"{'  ' * i}k:\n" for i in range(2000)),
    ],
    ids=["flow-lists", "flow-maps", "block-lists", "block-maps"],
)
def test_deep_nesting_is_refused_not_a_recursion_error(deep: str) -> None:
    with pytest.raises(YamlRefused, match=f"nested deeper than {MAX_DEPTH} levels"):
        load_yaml(deep)


def test_nesting_through_aliases_is_refused_too() -> None:
    chain = "a0: &a0 [1]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 200))
    with pytest.raises(YamlRefused, match="its aliases nest it deeper"):
        load_yaml(chain)


def test_recursive_alias_is_refused() -> None:
    with pytest.raises(YamlRefused, match="recursive"):
        load_yaml("a: &a [1, *a]")
    with pytest.raises(YamlRefused, match="recursive"):
        load_yaml("a: &a {b: *a}")


def test_ordinary_yaml_loads_as_safe_load_does() -> None:
    for path in [*Path("cfg/models").glob("*.yaml"), *Path("datasets").glob("*.yaml"), Path("cfg/default.yaml")]:
        text = path.read_text()
        assert load_yaml(text) == yaml.safe_load(text), path
    merged = "base: &b {lr: 0.01, epochs: 3}\nrun: {<<: *b, epochs: 5}\n"
    assert load_yaml(merged) == yaml.safe_load(merged)


def test_huge_scalar_file_over_the_cap_and_fifo_are_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("a: " + "x" * 1000)
    assert read_yaml(big, limit=2000) == {"a": "x" * 1000}
    with pytest.raises(YamlRefused, match="too large: 1003 bytes"):
        read_yaml(big, limit=1000)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(YamlRefused, match="a FIFO, not a regular file"):
        read_yaml(fifo)
    with pytest.raises(YamlRefused, match="a value cannot be read"):
        load_yaml("a: " + "9" * 10_000)
    with pytest.raises(YamlRefused, match="could not determine a constructor"):
        load_yaml("a: !!python/object/apply:os.system [ls]")


@pytest.mark.parametrize(
    "make",
    [
        lambda: "x\n" * 1_000_000,
        lambda: list(range(1_000_000)),
        lambda: {str(i) * 50: [i] * 100 for i in range(1000)},
        lambda: 10**10_000,
        lambda: b"\x00" * 10_000,
        lambda: [[[[[[[[[[[[1]]]]]]]]]]]] * 1000,
        object,
    ],
    ids=["text", "list", "dict", "int", "bytes", "nested", "object"],
)
def test_excerpts_are_short_and_one_line(make: Callable[[], object]) -> None:
    value = make()
    for limit in (10, 60, 200):
        for text in (excerpt(value, limit), listed(value, limit)):
            assert "\n" not in text and len(text) <= limit + 30, text
