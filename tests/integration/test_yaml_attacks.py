"""Named attacks on yaml reading (issue 25, item 2): a ~500-byte yaml of nested aliases in a dataset yaml's
``train:``, ``names:`` and ``path:`` and in a model yaml's ``scales:`` took 6 GB and ended in a MemoryError
traceback (values were expanded and whole reprs put into messages). Each is now one line, in a child interpreter
capped at 1 GiB of address space and 60 s, so a regression fails the test instead of the machine.
Huge and hostile values are quoted as short escaped excerpts only.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIMIT_S = 60
MEMORY = 1 << 30


def _limits(memory: bool) -> None:
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    resource.setrlimit(resource.RLIMIT_CPU, (LIMIT_S, LIMIT_S + 1))


def alias_bomb(key: str, levels: int = 8, fan: int = 9) -> str:
    """A yaml of ``levels`` lists, each of ``fan`` references to the one before, the last one under ``key``:
    about 500 bytes that expand to fan ** (levels + 1) strings."""
    lines = [f"a0: &a0 [{', '.join(['lol'] * fan)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * fan)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\n{key}: *a{levels}\n"


_DATASET = """
from detrain.data.dataset_yaml import load_dataset_yaml
from detrain.errors import DatasetError
try:
    load_dataset_yaml("data.yaml", download=False)
    print("LOADED")
except DatasetError as e:
    print("REFUSED", e)
"""

# torch maps gigabytes of libraries: the child imports it first, then caps what it may add (_CAP)
_CAP = """
import resource, torch
vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) << 10
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))
"""

_MODEL = (
    _CAP
    + """
from detrain.nn.model import DetectionModel
from detrain.errors import ConfigError
try:
    DetectionModel("bomb.yaml", nc=1)
    print("LOADED")
except ConfigError as e:
    print("REFUSED", e)
"""
)


def _refusal(code: str, cwd: Path) -> str:
    """The one line the child prints for its refusal; it must end within the limits, exit 0 and print one line."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    try:
        run = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=LIMIT_S,
            preexec_fn=lambda: _limits(memory=_CAP not in code),
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child ran for {LIMIT_S} s")
    assert run.returncode == 0, f"child ended with {run.returncode}:\n{run.stdout[-1500:]}\n{run.stderr[-1500:]}"
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("REFUSED "), run.stdout[-1500:]
    assert len(lines[0]) < 400, lines[0]
    return lines[0]


@pytest.mark.parametrize("key", ["train", "names", "path"])
def test_dataset_yaml_alias_bomb_is_one_line(tmp_path: Path, key: str) -> None:
    text = alias_bomb(key)
    assert len(text) < 600
    rest = {"train": "images", "val": "images", "names": "[a]", "path": "."}
    text += "".join(f"{k}: {v}\n" for k, v in rest.items() if k != key)
    (tmp_path / "data.yaml").write_text(text)
    line = _refusal(_DATASET, tmp_path)
    assert "data.yaml: its aliases expand it past" in line


def test_model_yaml_alias_bomb_in_scales_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "bomb.yaml").write_text(alias_bomb("scales") + "backbone: []\nhead: []\n")
    line = _refusal(_MODEL, tmp_path)
    assert "bomb.yaml: its aliases expand it past" in line


def test_a_checkpoint_style_dict_with_shared_lists_is_quoted_not_expanded(tmp_path: Path) -> None:
    """A model dict that never went through the yaml loader (a checkpoint records one) may share lists the same
    way: its error message quotes an excerpt, it never renders the expansion."""
    code = _CAP + textwrap.dedent("""
    from detrain.nn.model import DetectionModel
    from detrain.errors import ConfigError
    a = ["lol"] * 9
    for _ in range(8):
        a = [a] * 9
    try:
        DetectionModel({"scales": a, "backbone": [], "head": []}, nc=1)
    except ConfigError as e:
        print("REFUSED", e)
    """)
    line = _refusal(code, tmp_path)
    assert "'scales' must map scale names" in line


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("train: [{big}, 5]\nval: images\nnames: [a]\n", "train: must be a folder of images"),
        ("train: images\nval: images\nnames:\n  ? {big}\n  : a\n", "names: keys must be integer class ids"),
        ("train: images\nval: images\nnames: [[{big}]]\n", "names: each class name must be text"),
        ("train: images\nval: images\nnames: [a]\nnc: {big}\n", "nc: "),
        ("path: [{big}]\ntrain: images\nval: images\nnames: [a]\n", "path: must be a folder"),
        ("synthetic: {big}\n", "synthetic: "),
        ("synthetic: shapes\nn_train: {big}\n", "n_train="),
        ("train: images\nval: images\nnames: [a]\nx: {deep}\n", "nested deeper than 64 levels"),
        ("train: images\nval: images\nnames: [a]\nx: {digits}\n", "a value cannot be read"),
        ("train: [images\n", "not valid YAML"),
    ],
)
def test_huge_or_hostile_values_are_quoted_as_short_excerpts(tmp_path: Path, body: str, said: str) -> None:
    big = '"' + "x\\n" * 300_000 + '"'  # 900 KB of text with newlines that would forge message lines
    text = body.format(big=big, deep="[" * 5000 + "]" * 5000, digits="9" * 50_000)
    (tmp_path / "data.yaml").write_text(text)
    (tmp_path / "images").mkdir()
    line = _refusal(_DATASET, tmp_path)
    assert said in line
