"""Every ``>>>`` example in detrain's docstrings runs, one test per module: an example is a claim about the code,
and one that never runs drifts from it unnoticed.

Each module's examples run in an empty temporary folder (they may write small files there), with ``HOME`` in it
and no ``DETRAIN_*`` variable set, so they see the documented defaults and leave nothing behind. Examples must be
quick and offline: no training, no process, no network. What cannot be shown that way is a plain usage line in
the docstring (without ``>>>``), never a skipped example.
"""

from __future__ import annotations

import doctest
import importlib
import io
import os
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import detrain

MODULES = ["detrain", *sorted(m.name for m in pkgutil.walk_packages(detrain.__path__, "detrain."))]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
PROMPT = re.compile(r"^\s*>>>", re.M)


# numpy's own defaults: the examples show arrays as numpy prints them, whatever another library imported in this
# process set (Ultralytics, imported by the parity tests, sets a global float format)
NUMPY_DEFAULT_PRINT = {
    "edgeitems": 3,
    "threshold": 1000,
    "floatmode": "maxprec",
    "precision": 8,
    "suppress": False,
    "linewidth": 75,
    "nanstr": "nan",
    "infstr": "inf",
    "sign": "-",
    "formatter": None,
    "legacy": False,
}


@pytest.fixture
def quiet_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty working folder, HOME inside it, the environment without detrain's own variables, and numpy printing
    as it does by default."""
    for key in [k for k in os.environ if k.startswith("DETRAIN_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    with np.printoptions(**NUMPY_DEFAULT_PRINT):
        yield tmp_path


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str, quiet_folder: Path) -> None:
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, name)
    source = Path(module.__file__ or "").read_text(encoding="utf-8")
    # every example is found (none hides in a comment or a string doctest does not read) and none is skipped
    assert sum(len(t.examples) for t in tests) == len(PROMPT.findall(source)), f"{name}: an example doctest misses"
    assert "doctest: +SKIP" not in source, f"{name}: a skipped example; make it run, or make it a usage line"
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report = io.StringIO()
    for test in tests:
        runner.run(test, out=report.write)
    assert runner.failures == 0, report.getvalue()
