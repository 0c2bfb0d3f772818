"""Export a DetectionModel to ONNX: one fused eval graph, ``images`` (B, 3, H, W) -> ``output0`` (B, 4 + nc, N).

The output is what the model gives in eval mode (xywh boxes in input pixels, sigmoid class scores), with
no NMS inside, the layout YOLOv8 exports use, so existing ONNX post-processing keeps working.

We use torch's TorchScript-based exporter (``dynamo=False``): it needs no extra package, while the
newer torch.export-based one needs ``onnxscript``. When the ``onnx`` package is installed, the class
names, strides and image size are written into the file's metadata too.
"""

from __future__ import annotations

import copy
import os
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from detrain.errors import ConfigError

if TYPE_CHECKING:
    from detrain.nn.model import DetectionModel

__all__ = ["export_onnx"]


def _image_size(imgsz: int | tuple[int, int] | list[int], stride: int) -> tuple[int, int]:
    hw = (imgsz, imgsz) if isinstance(imgsz, int) else tuple(imgsz)
    if len(hw) != 2 or any(not isinstance(v, int) or v <= 0 or v % stride for v in hw):
        raise ConfigError(f"imgsz must be a positive multiple of {stride} (or two of them), got {imgsz!r}")
    return hw[0], hw[1]


def export_onnx(
    model: DetectionModel,
    out_path: str | os.PathLike[str],
    imgsz: int | tuple[int, int] = 640,
    opset: int = 17,
    dynamic_batch: bool = True,
) -> Path:
    """Write ``model`` as an ONNX file and return its path; the model passed in is left untouched.

    The graph is a fused (BatchNorm folded into convolutions) float32 copy in eval mode, input ``images``
    (B, 3, H, W) float in [0, 1], output ``output0`` (B, 4 + nc, N). With ``dynamic_batch`` the batch size
    is free; the image size is fixed at ``imgsz``. The file appears atomically: a failed export leaves no
    file behind.

    Example:
        >>> from detrain.nn.model import DetectionModel
        >>> export_onnx(DetectionModel(scale="n", nc=3), "model.onnx", imgsz=320)   # doctest: +SKIP
        PosixPath('model.onnx')
    """
    out = Path(out_path)
    stride = int(max(model.stride.tolist())) if len(model.stride) else 32
    h, w = _image_size(imgsz, stride)

    # A copy, so the caller's model keeps its BatchNorms, device, dtype and training mode.
    graph_model = copy.deepcopy(model).to("cpu", torch.float32).eval()
    graph_model.fuse()
    for p in graph_model.parameters():
        p.requires_grad_(False)
    example = torch.zeros(1, 3, h, w)
    with torch.no_grad():
        graph_model(example)  # builds the anchor cache for this size before tracing

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        with warnings.catch_warnings():
            # The TorchScript exporter announces its deprecation; tracing notes constant anchors. Both expected.
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            torch.onnx.export(
                graph_model,
                (example,),
                str(tmp),
                input_names=["images"],
                output_names=["output0"],
                opset_version=opset,
                dynamic_axes={"images": {0: "batch"}, "output0": {0: "batch"}} if dynamic_batch else None,
                do_constant_folding=True,
                dynamo=False,
            )
        _add_metadata(tmp, model, (h, w), stride)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _add_metadata(path: Path, model: DetectionModel, imgsz: tuple[int, int], stride: int) -> None:
    """Record names, stride and imgsz in the file (readers such as onnxruntime expose them); needs ``onnx``."""
    try:
        import onnx
    except ImportError:  # the export itself does not need it
        return
    proto = onnx.load(str(path))
    meta = {
        "producer": "detrain",
        "task": "detect",
        "stride": str(stride),
        "imgsz": str(list(imgsz)),
        "names": str(dict(getattr(model, "names", {}) or {})),
    }
    for key, value in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(proto, str(path))
