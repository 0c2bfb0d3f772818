"""docs/architecture.md stays the map of the package: every module is named in its Layout block with one line, every
name there is a module, every package folder says in its ``__init__`` docstring what it holds, and every head detrain
registers is a row of its head table (and every row a registered head)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from detrain.nn import yaml_plan  # noqa: F401 (imports the built-in heads, which register themselves)
from detrain.nn.head import registered_heads

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "detrain"
DOC = ROOT / "docs" / "architecture.md"


def layout_entries(text: str) -> dict[str, str]:
    """The Layout section's code block -> {path inside detrain/: its one line}. Folders end with ``/``; a line's
    indentation (two spaces a level) places it under the folder above it."""
    section = text.split("\n## Layout", 1)[1]
    block = section.split("```", 2)[1]
    entries: dict[str, str] = {}
    folders: list[str] = []
    for line in block.splitlines():
        match = re.match(r"^( *)(\S+)(?: +(.*))?$", line)
        if not match or match.group(2) == "detrain/":
            continue
        depth = len(match.group(1)) // 2 - 1
        name = match.group(2)
        del folders[depth:]
        path = "".join(folders) + name
        if name.endswith("/"):
            folders.append(name)
        entries[path] = (match.group(3) or "").strip()
    return entries


def modules() -> set[str]:
    return {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}


def test_every_module_is_named_once_with_a_line_and_every_name_is_a_module() -> None:
    entries = layout_entries(DOC.read_text())
    named = {path for path in entries if path.endswith(".py")}
    package_inits = {m for m in modules() if m.endswith("__init__.py") and m != "__init__.py"}
    assert sorted(modules() - package_inits - named) == [], "modules missing from docs/architecture.md's Layout"
    assert sorted(named - modules()) == [], "names in docs/architecture.md's Layout that are no module"
    assert [p for p in named if not entries[p]] == [], "a module named without its one line"
    folders = {str(p.parent.relative_to(PACKAGE)) + "/" for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE}
    assert sorted(folders - set(entries)) == [], "package folders missing from the Layout"


def test_layout_parser_places_names_under_their_folders() -> None:
    text = "x\n## Layout\n```\ndetrain/\n  a.py   one\n  b/     folder\n    c.py two\n  d.py   three\n```\n"
    assert layout_entries(text) == {"a.py": "one", "b/": "folder", "b/c.py": "two", "d.py": "three"}


@pytest.mark.parametrize("init", sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("__init__.py")))
def test_every_package_folder_says_what_it_holds(init: str) -> None:
    doc = ast.get_docstring(ast.parse((PACKAGE / init).read_text()))
    assert doc and len(doc.split()) >= 8, f"detrain/{init} needs a docstring saying what the folder holds"


def test_the_package_top_level_stays_at_most_14_entries() -> None:
    # issue 39 item 4: a new top-level module or folder has to displace one, or go into a package that fits it
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name not in ("__init__.py", "__pycache__"))
    assert len(entries) <= 14, entries


def head_table(text: str) -> dict[str, str]:
    """The rows of the "registered heads" table under "## Model and head contract": {name: the row}."""
    section = text.split("\n## Model and head contract", 1)[1].split("\n## ", 1)[0]
    table = section.split("The registered heads:", 1)[1]
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", table, re.M)}


def test_every_head_detrain_registers_is_a_row_of_the_head_table() -> None:
    # heads of detrain's own modules; a test's or a user's own head (tests/_toy_head.py) is theirs to document
    own = {name for name, cls in registered_heads().items() if cls.__module__.startswith("detrain.")}
    rows = head_table(DOC.read_text())
    assert own >= {"Detect", "DetectE2E"}
    assert sorted(own - set(rows)) == [], "registered heads missing from docs/architecture.md's head table"
    assert sorted(set(rows) - own) == [], "rows of docs/architecture.md's head table that are no registered head"
    for name, row in rows.items():  # the row names the module that defines the head
        module = registered_heads()[name].__module__.removeprefix("detrain.").replace(".", "/") + ".py"
        assert module in row, f"{name}'s row should name {module}"


def test_the_head_table_parser_reads_the_rows() -> None:
    text = "x\n## Model and head contract\nx\nThe registered heads:\n\n| a | b |\n|---|---|\n| `Foo` | x |\n\n## Next\n"
    assert head_table(text) == {"Foo": "| `Foo` | x |"}
