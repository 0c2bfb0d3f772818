"""detrain: train YOLO-style object detectors across many GPUs and many machines."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Model", "__version__"]


def __getattr__(name: str):  # lazy, so `import detrain` stays cheap for the CLI and workers
    if name == "Model":
        from detrain.api import Model

        return Model
    raise AttributeError(name)
