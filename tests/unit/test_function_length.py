"""No function in ``detrain/`` runs longer than 60 lines unless it says why.

A long function is usually several steps that want names (the trainer's set-up, the launcher); a few are better
long (a parser's state machine, a table of cases). The length is ``end_lineno - lineno`` of the ``def`` as Python's
``ast`` gives it (docstring and comments included). The convention for one that stays long: a comment line
starting ``# long:`` with the reason, on the line directly above the function's first line (its first decorator,
or its ``def``)::

    # long: the yaml's module table, one branch per layer kind
    def build_layers(...):
"""

from __future__ import annotations

import ast
from pathlib import Path

import detrain

MAX_LINES = 60
MARK = "# long:"


def too_long(source: str, max_lines: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """(name, line, length) of every function of ``source`` longer than ``max_lines`` without a ``# long:`` line."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = (node.end_lineno or node.lineno) - node.lineno
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        above = lines[first - 2].strip() if first >= 2 else ""
        if length > max_lines and not above.startswith(MARK):
            found.append((node.name, node.lineno, length))
    return found


def test_every_long_function_in_detrain_says_why() -> None:
    root = Path(detrain.__file__).parent
    found = [
        f"{path.relative_to(root.parent)}:{line} {name} ({length} lines)"
        for path in sorted(root.rglob("*.py"))
        for name, line, length in too_long(path.read_text(encoding="utf-8"))
    ]
    assert not found, (
        f"functions longer than {MAX_LINES} lines: split them into named steps, or put a '{MARK} reason' line "
        f"directly above the one that is better long:\n" + "\n".join(found)
    )


def _module(lines: int, *above: str) -> str:
    """A module whose function ``f`` (at line 3 + len(above)) is ``lines`` long, with ``above`` before its def."""
    body = [f"    x{i} = {i}" for i in range(lines)]
    return "\n".join(["import functools", "", *above, "def f():", *body]) + "\n"


def test_the_rule_counts_lines_and_reads_the_reason() -> None:
    assert too_long(_module(60)) == []
    assert too_long(_module(61)) == [("f", 3, 61)]
    assert too_long(_module(61, "# long: a table")) == []
    assert too_long(_module(61, "# a table")) == [("f", 4, 61)]  # a comment, but no reason given
    assert too_long(_module(61, "# long: a table", "")) == [("f", 5, 61)]  # the line directly above, not any
    # a decorated function: the reason goes above its first decorator
    assert too_long(_module(61, "# long: a table", "@functools.cache")) == []
    assert too_long(_module(61, "@functools.cache", "# long: a table")) == [("f", 5, 61)]  # not between them
