"""``cfg/default.yaml``, written from ``detrain.config.keys``: every key, flat, with its default and its help as
the line's comment, under a heading per section.

The shipped file is this text (``python -m detrain.config`` writes it, ``--check`` compares; a unit test fails
when they differ), so it cannot drift from the keys the code checks.

>>> scalar(None), scalar(True), scalar("1"), scalar(""), scalar("n.yaml"), scalar(0.0005)
('null', 'true', '"1"', '""', 'n.yaml', '0.0005')
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from detrain.config.keys import SECTIONS, SPECS, TITLES
from detrain.system.assets import asset_dir
from detrain.system.safe_yaml import load_yaml

HEADER = """\
# detrain: every argument, its default and what it does. `detrain train key=value ...`,
# `Model(...).train(key=value)` and the other commands all take these keys, flat (epochs=3); each heading names
# the section code reads them from (cfg.train.epochs).
# Written by `python -m detrain.config` from detrain/config/keys.py: change the keys there, not here.
"""


def scalar(value: Any) -> str:
    """``value`` as a yaml scalar that ``yaml.safe_load`` reads back as the same value of the same type."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (int, float)):
        text = repr(value)
    else:
        text = str(value)
        plain = text == text.strip() and "#" not in text and ": " not in text
        if not plain or _loaded(text) != value:
            text = json.dumps(text)  # a JSON string is a double-quoted yaml scalar
    if _loaded(text) != value or type(_loaded(text)) is not type(value):
        raise ValueError(f"default {value!r} has no yaml form that reads back as itself")
    return text


def _loaded(text: str) -> Any:
    return load_yaml(f"k: {text}")["k"]


def default_yaml() -> str:
    """The text of ``cfg/default.yaml``."""
    parts = [HEADER]
    for section, cls in SECTIONS.items():
        parts.append(f"\n# --- {section}: {TITLES[section]} ---\n")
        for f in dataclasses.fields(cls):
            parts.append(f"{f.name}: {scalar(f.default)}  # {SPECS[f.name].help}\n")
    return "".join(parts)


def shipped_path() -> Path:
    """Where the shipped ``default.yaml`` lives (``cfg/`` in a checkout, ``detrain/cfg`` when installed)."""
    return asset_dir("cfg") / "default.yaml"


def write(path: Path) -> None:
    """Write the text to ``path`` whole: a temporary file beside it, then renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(default_yaml())
        os.chmod(tmp, 0o644)  # readable as the file it replaces (mkstemp makes it private)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv: list[str]) -> int:
    """``python -m detrain.config``: write cfg/default.yaml; ``--check``: exit 1 when the shipped one differs."""
    path = shipped_path()
    if argv == ["--check"]:
        same = path.is_file() and path.read_text(encoding="utf-8") == default_yaml()
        print(
            f"{path} is up to date"
            if same
            else f"{path} differs from detrain/config/keys.py; run python -m detrain.config",
            file=sys.stdout if same else sys.stderr,
        )
        return 0 if same else 1
    if argv:
        print("usage: python -m detrain.config [--check]", file=sys.stderr)
        return 2
    write(path)
    print(f"wrote {path}")
    return 0
