"""The Python API: the same engine as the CLI, returning plain Python data.

>>> from detrain import Model
>>> model = Model("n.yaml")                                   # a fresh YOLOv8n-layout model
>>> metrics = model.train(data="shapes.yaml", epochs=3, imgsz=160, device="cpu")  # doctest: +SKIP
>>> metrics["map50"]                                          # doctest: +SKIP
>>> Model("runs/train/exp/weights/best.pt").predict("images/")  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from detrain.config import make_cfg
from detrain.engine.build import build_model, increment_run_dir, is_weights


class Model:
    """A detector from an architecture yaml (``n.yaml`` … ``x.yaml``) or weights (detrain or YOLOv8 ``.pt``).

    ``Model("missing.pt")`` raises :class:`detrain.errors.CheckpointError` naming the file.
    ``weights_sha256`` is the sha256 the weights must have (as the ``weights_sha256`` key): needed to
    download a bare name detrain holds no hash for, and checked against any weights file when given.
    """

    def __init__(self, model: str | Path = "n.yaml", weights_sha256: str = "") -> None:
        self.source = str(model)
        self.net, self.ckpt = build_model(self.source, verbose=False, weights_sha256=weights_sha256)

    @property
    def names(self) -> dict[int, str]:
        return dict(self.net.names)

    def train(self, **kwargs: Any) -> dict[str, Any]:
        """Train with the CLI's keys; ``device=[0, 1]`` or ``"cpu,cpu"`` trains on several workers.

        Returns the final validation metrics; afterwards this Model holds the best weights.
        """
        cfg = make_cfg({"model": self.source, **kwargs})
        from detrain.runner import run_task

        result = run_task("train", cfg)
        best = Path(result["save_dir"]) / "weights" / "best.pt"
        if best.is_file():
            self.source = str(best)
            self.net, self.ckpt = build_model(self.source, verbose=False)
        return result

    def val(self, **kwargs: Any) -> dict[str, Any]:
        """Validate (COCO-exact metrics) with the CLI's keys; returns the metrics dict."""
        cfg = make_cfg({"model": self.source, **kwargs})
        from detrain.runner import run_task

        return run_task("val", cfg)

    def predict(self, source: str | Path, **kwargs: Any) -> list[dict[str, Any]]:
        """Detections per image: ``[{"file", "boxes" (xyxy pixels), "scores", "classes", "names"}, ...]``."""
        from detrain.engine.predictor import predict

        cfg = make_cfg({"model": self.source, "source": str(source), **kwargs})
        return predict(cfg, model=self.net if is_weights(self.source) else None)

    def export(self, **kwargs: Any) -> Path:
        """Export to ONNX (``format=onnx``, ``opset``, ``dynamic``, ``imgsz``); returns the file's path."""
        from detrain.export import export_onnx

        cfg = make_cfg({"model": self.source, **kwargs})
        out = Path(self.source).with_suffix(".onnx") if is_weights(self.source) else \
            increment_run_dir(cfg.project, cfg.name, "export", cfg.exist_ok) / "model.onnx"
        return export_onnx(self.net, out, imgsz=cfg.imgsz, opset=cfg.opset, dynamic_batch=cfg.dynamic)

    def __repr__(self) -> str:
        return f"Model({self.source!r}: scale {self.net.scale}, {self.net.nc} classes)"
