"""tests/integration: tests that start processes (launchers, workers, the real ``detrain`` command) or train a
model; each is marked ``integration`` so ``pytest -m "not integration"`` leaves them out."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration/" in item.nodeid:
            item.add_marker(pytest.mark.integration)
