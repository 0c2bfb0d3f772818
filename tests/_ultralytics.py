"""Ultralytics for the parity tests: never a dependency, imported only while a test that needs it runs. Also
the two short ways tests read an Ultralytics file the way detrain does (detrain itself only needs the pieces)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from detrain.nn.model import DetectionModel


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


def load_ultralytics_checkpoint(path: str | Path) -> dict[str, Any]:
    """What detrain makes of an Ultralytics file: the restricted read, then the plain-data summary."""
    from detrain.weights.ultralytics import read_torch_zip, ultralytics_info

    path = Path(path)
    return ultralytics_info(read_torch_zip(path), path)


def to_detrain_model(info: dict[str, Any]) -> DetectionModel:
    """The model :func:`load_ultralytics_checkpoint`'s summary builds, as ``load_checkpoint`` users get it."""
    from detrain.weights.checkpoint import from_ultralytics, model_from_checkpoint

    return model_from_checkpoint(from_ultralytics(info))
