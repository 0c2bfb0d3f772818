"""Ultralytics for the parity tests: never a dependency, imported only while a test that needs it runs."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def offline_ultralytics(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Within the block Ultralytics is importable offline (``YOLO_OFFLINE=1``) with its settings file in a
    temporary folder, unless the caller set either variable; the test skips when Ultralytics is not
    importable."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in (("YOLO_OFFLINE", "1"), ("YOLO_CONFIG_DIR", None)):
            if key not in os.environ:
                mp.setenv(key, value or str(tmp_path_factory.mktemp("yolo_config")))
        pytest.importorskip("ultralytics")
        yield
