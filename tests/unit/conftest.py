"""tests/unit: fast tests that run in this process (no subprocess, no worker process, no training); each is
marked ``unit`` so ``pytest -m unit`` picks them wherever they are collected from."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/unit/" in item.nodeid:
            item.add_marker(pytest.mark.unit)
