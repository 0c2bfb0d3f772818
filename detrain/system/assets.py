"""Where the shipped yamls live: ``cfg/`` and ``datasets/`` at the top of a source checkout, or inside the
installed package (``detrain/cfg``, ``detrain/datasets``) after a non-editable ``pip install .``.

>>> (asset_dir("cfg") / "default.yaml").is_file()
True
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # detrain/


def asset_dir(kind: str) -> Path:
    """``asset_dir("cfg/models")`` -> the folder holding yolov8.yaml; ``"datasets"`` -> the dataset yamls."""
    installed = _PACKAGE / kind
    return installed if installed.is_dir() else _PACKAGE.parent / kind
