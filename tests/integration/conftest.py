"""tests/integration: tests that start processes (launchers, workers, the real ``detrain`` command) or train a
model; each is marked ``integration`` so ``pytest -m "not integration"`` leaves them out."""

from __future__ import annotations

import compileall
import sys
from pathlib import Path

import pytest

import detrain


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration/" in item.nodeid:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session", autouse=True)
def _bytecode_once() -> None:
    """Compile detrain and the test helpers once, before the first process starts. Where the environment sets
    PYTHONDONTWRITEBYTECODE (CI's machines do) no process writes the bytecode it compiles, so every launcher and
    worker these tests start would compile the same modules again (about 0.3 s of CPU each, hundreds of
    processes); compileall writes the files explicitly, and the processes only read them."""
    if not sys.dont_write_bytecode:
        return  # the first process to import a module leaves its bytecode for the others
    for folder in (Path(detrain.__file__).parent, Path(__file__).parents[1]):
        compileall.compile_dir(folder, quiet=1)
