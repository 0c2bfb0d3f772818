"""Export a DetectionModel for inference without detrain: ONNX (``.onnx``) or TorchScript (``.torchscript``).

Both hold one fused eval graph, input ``images`` (B, 3, H, W) float in [0, 1] -> output (B, 4 + nc, N):
what the model gives in eval mode (xywh boxes in input pixels, sigmoid class scores), with no NMS inside,
the layout YOLOv8 exports use, so existing post-processing keeps working. Such a graph computes its anchors from
the input's shape, so it takes any batch and any image size that is a multiple of the stride (ONNX: with
``dynamic``, as Ultralytics' dynamic exports do; without it, batch 1 at ``imgsz`` only, the anchors constants of
the graph). An end-to-end (YOLO26) graph's top-k is sized when traced: it takes ``imgsz`` only, any batch.
``imgsz`` (by default the size the model was trained at) is the size traced, recorded as the one to serve at.

ONNX uses torch's TorchScript-based exporter (``dynamo=False``), which needs the ``onnx`` package
(``pip install "detrain[export]"``), while the newer torch.export-based one needs ``onnxscript`` too. The class
names, strides, image size, batch and the kind of output are written into the file's ``metadata_props``
(appended to the file as protobuf records, not by a load-and-save of the whole model through ``onnx``;
onnxruntime's ``get_modelmeta().custom_metadata_map`` reads them), each value as Python writes it (``str``:
``"{0: 'person'}"``, ``"[640, 640]"``, ``"True"``), as Ultralytics' exports hold theirs.

TorchScript is a trace of the same fused model, loaded by ``torch.jit.load`` with torch alone (no detrain,
no Python source of the model). The same metadata travels in the archive as the extra file
``detrain.json`` (``torch.jit.load(path, _extra_files={"detrain.json": ""})`` reads it).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from detrain.errors import ConfigError, DetrainError
from detrain.system.tempfiles import open_folder, temp_beside
from detrain.weights.limits import imgsz_problem

if TYPE_CHECKING:
    from detrain.nn.model import DetectionModel

__all__ = [
    "OUTPUTS",
    "SUFFIXES",
    "TORCHSCRIPT_META",
    "export_model",
    "export_onnx",
    "export_torchscript",
    "training_imgsz",
]

#: export format -> file suffix (the ``format=`` values ``detrain export`` takes)
SUFFIXES = {"onnx": ".onnx", "torchscript": ".torchscript"}
#: the extra file of a TorchScript archive that holds its metadata (JSON)
TORCHSCRIPT_META = "detrain.json"
#: the image size of a model that records none (built from a yaml)
DEFAULT_IMGSZ = 640
#: what an exported graph gives, by its head's output kind (``head.output``: :data:`detrain.nn.head.OUTPUT_KINDS`),
#: as the file's metadata says it; the served files (:mod:`detrain.engine.backends`) run one of these two
OUTPUTS = {
    "boxes": "boxes (B, 4 + nc, N): xywh and class scores per anchor, for NMS",
    "detections": "detections (B, max_det, 6): x1 y1 x2 y2 score class, best first, no NMS needed",
}


def _image_size(imgsz: int | tuple[int, int] | list[int], stride: int) -> tuple[int, int]:
    """(h, w) to trace at: multiples of ``stride``, within the bound of ``imgsz=`` (a size the model records came
    from its file; tracing at 2**20 would ask for terabytes)."""
    hw = (imgsz, imgsz) if isinstance(imgsz, int) else tuple(imgsz)
    if len(hw) != 2 or any(not isinstance(v, int) or v <= 0 or v % stride for v in hw):
        raise ConfigError(f"imgsz must be a positive multiple of {stride} (or two of them), got {imgsz!r}")
    problem = imgsz_problem(list(hw))
    if problem is not None:
        raise ConfigError(f"cannot export: {problem}")
    return hw[0], hw[1]


def _graph_model(
    model: DetectionModel,
    imgsz: int | tuple[int, int] | list[int] | None,
    nms: bool = False,
    free_size: bool = True,
    half: bool = False,
) -> tuple[DetectionModel, torch.Tensor, tuple[int, int], int]:
    """(fused float32 (``half``: float16) eval copy on the CPU, an example input of that type, (h, w), largest
    stride) for tracing; ``nms``: an end-to-end head's graph ends in its one-to-many boxes and scores (for NMS)
    instead of its top-k detections.

    With ``free_size`` (and a graph that ends in boxes and scores for NMS) the trace computes the anchors from the
    input's shape, so the graph takes any multiple of the stride: the warm-up runs at another size, and the head's
    anchor cache (keyed by shape) misses while tracing. Otherwise the warm-up fills it for this size and the anchors
    are constants of the graph. A top-k graph keeps its size: its ``k`` is fixed when traced.

    A copy, so the caller's model keeps its BatchNorms, device, dtype, training mode and inference options.
    """
    stride = int(max(model.stride.tolist())) if len(model.stride) else 32
    h, w = _image_size(training_imgsz(model) if imgsz is None else imgsz, stride)
    dtype = torch.float16 if half else torch.float32
    graph_model = copy.deepcopy(model).to("cpu", dtype).eval()
    graph_model.set_inference(nms=nms)
    graph_model.fuse()
    for p in graph_model.parameters():
        p.requires_grad_(False)
    example = torch.zeros(1, 3, h, w, dtype=dtype)
    other = free_size and _output(graph_model) == "boxes"
    with torch.no_grad():
        graph_model(torch.zeros(1, 3, h + stride, w + stride, dtype=dtype) if other else example)  # anchor cache
    return graph_model, example, (h, w), stride


def _free_size(graph_model: DetectionModel, asked: bool) -> bool:
    """Whether the traced graph takes any input size (a multiple of the stride): only one ending in NMS's input."""
    return asked and _output(graph_model) == "boxes"


def _output(graph_model: DetectionModel) -> str:
    """The kind of output the model's head gives now (:attr:`detrain.nn.head.Head.output`), one that is served."""
    kind = graph_model.head.output
    if kind not in OUTPUTS:
        raise ConfigError(
            f"cannot export: the model's head gives {kind!r} output; an exported graph gives one of "
            f"{', '.join(OUTPUTS)} (detrain.nn.head.OUTPUT_KINDS)"
        )
    return kind


@contextlib.contextmanager
def _atomic_file(out: Path) -> Iterator[Path]:
    """A temporary path beside ``out`` to write; renamed onto ``out`` on success, removed on any failure.

    A folder that cannot be made or written to, or is a symbolic link, is a one-line :class:`DetrainError` naming
    ``out``; a link at ``out``'s own name is replaced, not followed.
    """
    try:
        os.close(open_folder(out.parent))  # made if missing; a folder that is a symbolic link is refused
        fd, tmp_name = temp_beside(out, ".part")
    except OSError as e:
        raise DetrainError(f"cannot write the export {out}: {e.strerror or e}") from None
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _metadata(
    graph_model: DetectionModel, imgsz: tuple[int, int], stride: int, dynamic: bool, free_size: bool
) -> dict[str, object]:
    """What an exported file records about the model besides its graph, enough to serve it
    (:mod:`detrain.engine.backends`): classes, stride, the size it was exported at, whether the batch is free
    (else 1) and the image size (any multiple of ``stride``; else ``imgsz`` only), and what the graph gives
    (``end2end``: final top-k detections, ``max_det`` rows; else boxes and scores for NMS)."""
    from detrain import __version__

    head, kind = graph_model.head, _output(graph_model)
    meta: dict[str, object] = {
        "producer": "detrain",
        "version": __version__,
        "task": "detect",
        "family": graph_model.family,
        "stride": stride,
        "imgsz": list(imgsz),
        "batch": 1,
        "dynamic": dynamic,
        "free_size": free_size,
        "half": next(graph_model.parameters()).dtype == torch.float16,
        "end2end": kind == "detections",
        "output": OUTPUTS[kind],
        "names": {int(k): str(v) for k, v in dict(getattr(graph_model, "names", {}) or {}).items()},
    }
    if kind == "detections":
        meta["max_det"] = int(getattr(head, "max_det", 300))
    return meta


def training_imgsz(model: DetectionModel) -> int:
    """The image size ``model`` was trained at, as its checkpoint records it (640 for a model built from a yaml):
    what an export uses unless told otherwise.

    >>> from detrain.nn.model import DetectionModel
    >>> m = DetectionModel(nc=1); training_imgsz(m), (setattr(m, "imgsz", 320), training_imgsz(m))[1]
    (640, 320)
    """
    size = getattr(model, "imgsz", None)
    return size if isinstance(size, int) and size > 0 else DEFAULT_IMGSZ


def export_model(
    model: DetectionModel,
    out_path: str | os.PathLike[str],
    format: str = "onnx",
    imgsz: int | tuple[int, int] | None = None,
    opset: int = 17,
    dynamic_batch: bool = True,
    nms: bool = False,
    half: bool = False,
) -> Path:
    """Write ``model`` in ``format`` (``onnx`` or ``torchscript``) and return the file's path.

    ``imgsz`` None: the size the model was trained at (:func:`training_imgsz`). ``opset``, ``dynamic_batch`` and
    ``half`` (a float16 graph) apply to ONNX; a TorchScript file takes any batch size. An end-to-end (YOLO26)
    model's graph gives its (B, 300, 6) detections, or with ``nms`` its one-to-many boxes and scores for NMS.

    >>> from detrain.nn.model import DetectionModel
    >>> export_model(DetectionModel(nc=1), "m.tflite", format="tflite")
    Traceback (most recent call last):
    ...
    detrain.errors.ConfigError: invalid value for 'format': 'tflite'; expected one of onnx, torchscript
    """
    if format not in SUFFIXES:
        raise ConfigError(f"invalid value for 'format': {format!r}; expected one of {', '.join(SUFFIXES)}")
    if format == "torchscript":
        return export_torchscript(model, out_path, imgsz=imgsz, nms=nms)
    return export_onnx(model, out_path, imgsz=imgsz, opset=opset, dynamic_batch=dynamic_batch, nms=nms, half=half)


def export_onnx(
    model: DetectionModel,
    out_path: str | os.PathLike[str],
    imgsz: int | tuple[int, int] | None = None,
    opset: int = 17,
    dynamic_batch: bool = True,
    nms: bool = False,
    half: bool = False,
) -> Path:
    """Write ``model`` as an ONNX file and return its path; the model passed in is left untouched.

    The graph is a fused (BatchNorm folded into convolutions) float32 copy in eval mode (``half``: float16, input
    and output too; onnxruntime runs it on a CPU, and the metadata's ``half`` says so), input ``images``
    (B, 3, H, W) float in [0, 1], output ``output0`` (B, 4 + nc, N), or an end-to-end model's (B, 300, 6)
    detections (see :func:`export_model`; the metadata's ``output`` says which). With ``dynamic_batch`` the batch size
    is free, and so are height and width (multiples of the stride) except for an end-to-end graph; without it the
    input is (1, 3, ``imgsz``). The file appears atomically: a failed export leaves no file behind.

    Example (seconds of tracing, so not run as a test): ``export_onnx(DetectionModel(scale="n", nc=3),
    "model.onnx", imgsz=320)`` returns ``PosixPath('model.onnx')``.
    """
    out = Path(out_path)
    graph_model, example, (h, w), stride = _graph_model(model, imgsz, nms, free_size=dynamic_batch, half=half)
    free = _free_size(graph_model, dynamic_batch)
    axes = {"images": {0: "batch", 2: "height", 3: "width"}, "output0": {0: "batch", 2: "anchors"}}
    if not free:
        axes = {"images": {0: "batch"}, "output0": {0: "batch"}}
    with _atomic_file(out) as tmp:
        with _quiet_tracing():
            torch.onnx.export(
                graph_model,
                (example,),
                str(tmp),
                input_names=["images"],
                output_names=["output0"],
                opset_version=opset,
                dynamic_axes=axes if dynamic_batch else None,
                do_constant_folding=True,
                dynamo=False,
            )
        _add_metadata(tmp, _metadata(graph_model, (h, w), stride, dynamic_batch, free))
    return out


def export_torchscript(
    model: DetectionModel,
    out_path: str | os.PathLike[str],
    imgsz: int | tuple[int, int] | None = None,
    nms: bool = False,
) -> Path:
    """Write ``model`` as a TorchScript archive and return its path; the model passed in is left untouched.

    The archive is a trace of the fused float32 eval model on the CPU: ``torch.jit.load(path)`` gives a
    module mapping (B, 3, H, W) float in [0, 1] (any multiple of the stride; an end-to-end model: the exported
    ``imgsz``) to (B, 4 + nc, N) (an end-to-end model: (B, 300, 6) detections, see :func:`export_model`), for any B,
    without detrain installed. Names, stride and imgsz are in the extra file ``detrain.json``. The file
    appears atomically: a failed export leaves no file behind.

    Example (seconds of tracing, so not run as a test): ``export_torchscript(DetectionModel(scale="n", nc=3),
    "model.torchscript", imgsz=320)`` returns ``PosixPath('model.torchscript')``.
    """
    out = Path(out_path)
    graph_model, example, (h, w), stride = _graph_model(model, imgsz, nms)
    meta = json.dumps(_metadata(graph_model, (h, w), stride, True, _free_size(graph_model, True)))
    with _atomic_file(out) as tmp, _quiet_tracing():
        traced = torch.jit.trace(graph_model, (example,), check_trace=False)
        torch.jit.save(traced, str(tmp), _extra_files={TORCHSCRIPT_META: meta})
    return out


@contextlib.contextmanager
def _quiet_tracing() -> Iterator[None]:
    """Tracing's expected warnings, hidden: torch.jit (and the TorchScript ONNX exporter) announce their
    deprecation, and the tracer notes the constant anchors of the exported image size."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        yield


def _add_metadata(path: Path, meta: dict[str, object]) -> None:
    """Append ``meta`` to the ONNX file as ``metadata_props`` records, each value as ``str`` gives it.

    A protobuf message followed by more fields is read as one message with those fields added (a repeated field's
    records are appended), so the records are written as bytes after the model's own, with no ``onnx`` package:
    field 14 of ``ModelProto`` (``metadata_props``), each a ``StringStringEntryProto`` (key 1, value 2).
    """
    records = b"".join(
        _field(14, _field(1, key.encode()) + _field(2, str(value).encode())) for key, value in meta.items()
    )
    with open(path, "ab") as f:
        f.write(records)


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (wire type 2): tag, length, bytes.

    >>> _field(1, b"ab")
    b'\\n\\x02ab'
    """
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    """``value`` as a protobuf varint: 7 bits a byte, low bits first, the high bit set on all but the last.

    >>> _varint(1), _varint(300)
    (b'\\x01', b'\\xac\\x02')
    """
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)
