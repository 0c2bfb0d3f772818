"""README, the docs pages, ``detrain --help`` and cfg/default.yaml say the same thing: every key a command line
in README or docs/*.md uses exists for its command, docs/usage.md's keys table shows the true defaults, every key
has its one-line comment, and every docs page README links to exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from detrain.cli import _keys_help
from detrain.config.cfg import COMMAND_KEYS, WORDS, comments, defaults, make_cfg
from detrain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
USAGE = ROOT / "docs" / "usage.md"


def _readme_commands_of(text: str) -> list[tuple[str, list[str]]]:
    """(command, [key=value, ...]) of every `detrain <command> ...` line in the code blocks of ``text`` (continued
    lines joined; the second of two side-by-side commands on one line dropped)."""
    fenced = re.findall(r"```(\w*)\n(.*?)```", text, re.S)  # every block, whatever its language (python too)
    blocks = [body for language, body in fenced if language in ("", "bash", "sh")]
    out = []
    for block in blocks:
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" # ")[0].split("  #")[0]
            m = re.search(r"\bdetrain (train|val|predict|export|info)\b(.*)", line)
            if m:
                words = shlex.split(m.group(2).split("detrain ")[0])
                out.append((m.group(1), [w for w in words if "=" in w and not w.startswith("-")]))
    return out


# README and the docs pages; architecture.md's code block is a diagram (`detrain train k=v`), not a command
COMMANDS = _readme_commands_of("\n".join(p.read_text() for p in PAGES if p.name != "architecture.md"))


def test_readme_shows_commands() -> None:
    assert {c for c, _ in COMMANDS} == {"train", "val", "predict", "export", "info"}
    readme = _readme_commands_of(README.read_text())
    assert {c for c, _ in readme} == {"train", "val", "predict", "export", "info"}  # README alone shows each


def test_every_docs_page_readme_links_to_exists_and_every_page_is_linked() -> None:
    text = README.read_text()
    linked = set(re.findall(r"\]\((docs/[^)#]+)", text))
    assert linked and all((ROOT / link).is_file() for link in linked), sorted(linked)
    assert {f"docs/{p.name}" for p in PAGES[1:]} <= linked  # no page a newcomer cannot reach


@pytest.mark.parametrize(("command", "args"), COMMANDS, ids=[f"{c} {' '.join(a)}" for c, a in COMMANDS])
def test_every_readme_command_line_uses_keys_of_its_command(command: str, args: list[str]) -> None:
    for arg in args:
        key, value = arg.split("=", 1)
        if key in WORDS:  # cfg=, task=, mode=: read by make_cfg, held by no key
            continue
        assert key in COMMAND_KEYS[command], f"README: detrain {command} {arg}: no key {key!r} for {command}"
        if "..." in value or "<" in value or value.startswith(("/", "path")):
            continue  # a placeholder
        try:
            make_cfg({key: value}, command)
        except ConfigError as e:
            pytest.fail(f"README: detrain {command} {arg}: {e}")


def test_readme_keys_table_shows_the_defaults() -> None:
    table = re.search(r"^\| key \| default \| meaning \|\n\|[-|]+\|\n((?:\|.*\n)+)", USAGE.read_text(), re.M)
    assert table, "docs/usage.md has no | key | default | meaning | table"
    rows = re.findall(r"^\| (`[^|]*`) \| ([^|]*) \|", table.group(1), re.M)
    assert rows
    truth = defaults()
    for keys, shown in rows:
        names = re.findall(r"`([a-z_0-9]+)`", keys)
        assert all(k in truth for k in names), f"README keys table: {names}"
        values = [v.strip().strip("`'") for v in shown.split(",")] if shown.strip() else []
        if len(values) == len(names):
            for k, v in zip(names, values):
                want = truth[k]
                assert v == (
                    "null"
                    if want is None
                    else str(want).lower()
                    if isinstance(want, bool)
                    else ("''" if want == "" else str(want))
                ) or v == str(want), f"README says {k}={v}, default {want}"


def test_every_key_has_its_comment_and_is_in_some_help() -> None:
    notes = comments()
    helped = set().union(*(COMMAND_KEYS[c] for c in COMMAND_KEYS))
    for key in defaults():
        assert notes.get(key, "").strip(), f"cfg/default.yaml: {key} has no comment"
        assert key in helped, f"{key} is in no command's --help"
    for command in COMMAND_KEYS:
        text = _keys_help(command)
        assert all(f"{k}=" in text for k in COMMAND_KEYS[command])


def test_ci_runs_the_readmes_test_command() -> None:
    """The README's quick start gives the test command; .ci/run runs that very line (after its lint checks)."""
    setup = re.search(r"Run the test suite:\s*```bash\n(.*?)\n```", README.read_text(), re.S)
    assert setup is not None, "README's quick start has no test command"
    test_command = setup.group(1).split("&&")[-1].strip()
    assert test_command.startswith("python -m pytest")
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci_lines[-1].strip() == test_command, (ci_lines[-1], test_command)
