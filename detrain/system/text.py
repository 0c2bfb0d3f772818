"""Quoting what a file or a user supplied inside a one-line message, without trusting its size or its characters.

A hostile yaml value may be a 10 MB string, a list of a million items or an alias graph that expands to gigabytes:
``repr`` of it would build a message as large, and a newline in it would forge a second message line. So a quote
is an *excerpt*: at most ``limit`` characters, control characters escaped, built by a walk that stops as soon as
the budget is spent (it never renders a whole container first).

>>> excerpt("a\\nb")
"'a\\\\nb'"
>>> excerpt("x" * 1000, 10)
"'xxxxxxxxxx...' (1000 characters)"
>>> excerpt(list(range(1000)), 20)
'[0, 1, 2, 3, 4, 5, 6, ...] (1000 items)'
>>> shown("name\\nwith a newline")
'name?with a newline'
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
EXCERPT_CHARS = 60


# what a class name must not hold: C0 and C1 controls (an escape sequence rewrites the terminal), DEL, and the
# bidirectional overrides and isolates (they reorder what a line shows)
_NOT_IN_NAMES = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def name_problem(names: dict[int, str]) -> str | None:
    """Why these class names must not be printed or drawn: the first that holds a control character (an ANSI escape
    sequence, a newline, a bidirectional override), with its index and an escaped excerpt; None when all are plain.

    >>> print(name_problem({0: "cat", 1: "\\x1b[2Jdog"}))
    class name 1 ('\\x1b[2Jdog') holds a control character
    """
    for index, name in names.items():
        if _NOT_IN_NAMES.search(name):
            return f"class name {index} ({excerpt(name, 40)}) holds a control character"
    return None


def shown(text: str) -> str:
    """``text`` safe to print on one line: control characters (a newline in a file name) become ``?``."""
    return _CONTROL.sub("?", text)


def path_excerpt(path: object, limit: int = 80) -> str:
    """A file path for a message, control characters escaped, cut at its *start* when longer than ``limit`` so
    the file's own name (the part a reader acts on) stays whole.

    >>> path_excerpt("/tmp/" + "d" * 100 + "/args.yaml", 20)
    '...ddddddd/args.yaml'
    """
    text = str(path).encode("unicode_escape").decode("ascii")
    return text if len(text) <= limit else "..." + text[-(limit - 3) :] if limit > 3 else text[-limit:]


def excerpt(value: object, limit: int = EXCERPT_CHARS, quote: bool = True, _depth: int = 0) -> str:
    """A short, escaped rendering of ``value`` for a message: a string quoted (``quote``) and cut at ``limit``
    characters with its length said, a container's first items within the budget with its size said, anything
    else its ``repr`` cut alike. Never longer than ``limit`` + 30 characters, whatever ``value`` is."""
    if isinstance(value, str):
        body = value[:limit].encode("unicode_escape").decode("ascii")[:limit]
        more = f"...' ({len(value)} characters)" if len(value) > limit else "'"
        return f"'{body}{more}" if quote else body + (more[:3] if len(value) > limit else "")
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return _container(value, limit, _depth)
    if isinstance(value, (bytes, bytearray)):
        return repr(bytes(value[:limit]))[: limit + 3] + ("..." if len(value) > limit else "")
    try:
        text = repr(value) if isinstance(value, (bool, float, type(None))) else _plain(value)
    except (ValueError, OverflowError):  # an int too long to print in decimal
        text = f"<{type(value).__name__}>"
    return shown(text[:limit]) + ("..." if len(text) > limit else "")


def listed(values: object, limit: int = EXCERPT_CHARS) -> str:
    """The items of a file-supplied collection named in a message ("n, s, m"), each escaped, stopping at about
    ``limit`` characters ("n, s, ... (5000 in all)").

    >>> listed({"n": 1, "s": 2}), listed(range(10**6), 12)
    ('n, s', '0, 1, 2, 3, ... (1000000 in all)')
    """
    items = values if isinstance(values, (list, tuple, dict, set, frozenset, range)) else [values]
    parts: list[str] = []
    used = 0
    for item in items:
        if used >= limit:
            return ", ".join(parts) + f", ... ({len(items)} in all)"
        text = excerpt(item, max(8, limit - used), quote=False, _depth=1)
        parts.append(text)
        used += len(text) + 2
    return ", ".join(parts)


def _plain(value: object) -> str:
    """``repr`` of a scalar, or a placeholder for an object of any other kind (its repr could be anything)."""
    if isinstance(value, int):
        return repr(value) if value.bit_length() < 256 else f"<int of {value.bit_length()} bits>"
    return repr(value) if type(value).__module__ in ("builtins", "datetime") else f"<{type(value).__name__}>"


def _container(value: list | tuple | dict | set | frozenset, limit: int, depth: int) -> str:
    """The first items of a container within ``limit`` characters, each an excerpt of its own, then the count;
    below three levels of nesting only the count."""
    opening = {list: "[]", tuple: "()", dict: "{}"}.get(type(value), "{}")
    if depth >= 3:
        return f"{opening[0]}...{opening[1]}"
    items = value.items() if isinstance(value, dict) else value
    parts: list[str] = []
    used = 0
    cut = False
    for item in items:
        if used >= limit:
            cut = True
            break
        room = max(8, limit - used)
        if isinstance(item, tuple) and isinstance(value, dict):
            text = f"{excerpt(item[0], room // 2, _depth=depth + 1)}: {excerpt(item[1], room // 2, _depth=depth + 1)}"
        else:
            text = excerpt(item, room, _depth=depth + 1)
        parts.append(text)
        used += len(text) + 2
    body = opening[0] + ", ".join(parts) + (", ..." if cut else "") + opening[1]
    if len(body) > limit + 8:  # the items' own minimum room overran a small budget
        body, cut = body[:limit] + "...", True
    return body + (f" ({len(value)} items)" if cut else "")
