"""Serving exported files: ``model=best.onnx``, ``best.torchscript`` or ``best_openvino_model`` for ``detrain val``
and ``predict``.

:func:`load_exported` reads a file ``detrain export`` wrote into an :class:`ExportedModel`, a module that looks to
the validator and the predictor like an eval-mode ``DetectionModel``: ``forward`` gives the head's inference output
in the layout the ``.pt`` model gives it (boxes and scores (B, 4 + nc, N) for NMS, or an end-to-end head's
(B, max_det, 6) top-k detections), and :meth:`ExportedModel.postprocess` runs the same postprocess the model's own
head runs (:func:`detrain.nn.head.nms` or :func:`detrain.nn.topk_decode.filter_detections`), so the detections,
and the mAP, are the model's. What the graph alone does not say (class names, stride, input size, batch, the kind
of output) is read from the metadata the export wrote: ONNX ``metadata_props``, TorchScript's extra file
``detrain.json``.

A graph ending in boxes and scores for NMS, exported with a free batch (ONNX ``dynamic=true``, the default; every
TorchScript one), takes any image size, so val and predict run it as they run the ``.pt``: at ``imgsz``, in the
same rectangular batches, giving the same detections. Any other graph (an end-to-end top-k one, a fixed-batch
ONNX) has one input size, :attr:`ExportedModel.fixed_imgsz`, which val and predict use whatever ``imgsz=`` says,
every image letterboxed to it. A file exported with a fixed batch of 1 takes a batch one image at a time.

* ``.torchscript``: ``torch.jit.load`` onto the device (torch alone).
* ``.onnx``: an onnxruntime ``InferenceSession`` on the CPU (``pip install "detrain[export]"``), with this process's
  torch thread count.
* ``<stem>_openvino_model/`` (or its ``.xml``): OpenVINO's CPU plugin at float32 precision, with this process's
  torch thread count (:mod:`detrain.engine.openvino_ir`; ``pip install "detrain[openvino]"``).

An exported file is a program. A TorchScript archive holds TorchScript code, which reaches torch's file operators
(``torch.from_file`` maps any file read-write) and runs at load (``__setstate__``): its code is read first by
:mod:`detrain.engine.script_check` and the archive refused unless it only does what a detrain export does, tensor
math in ``forward`` (``trust_export=true``, on the command line or in the API only, skips the check). An ONNX file
runs its operators in onnxruntime, which has no file or process operators. :func:`export_summary` reads what a file
records without loading it (``Model(...)`` of an export loads nothing until it serves).
"""

from __future__ import annotations

import ast
import json
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from detrain.engine.export import TORCHSCRIPT_META
from detrain.engine.openvino_ir import FOLDER_SUFFIX, is_openvino, read_openvino
from detrain.engine.script_check import check_torchscript
from detrain.errors import ConfigError, DetrainError
from detrain.nn.head import InferenceOptions, nms
from detrain.nn.topk_decode import filter_detections
from detrain.system.text import name_problem, shown
from detrain.weights.limits import imgsz_problem, max_imgsz

__all__ = ["ExportInfo", "ExportSummary", "ExportedModel", "export_summary", "load_exported"]

INSTALL_ONNXRUNTIME = 'pip install "detrain[export]"'
META_MAX_CHARS = 1_000_000  # a metadata value longer than this is no export of detrain's


@dataclass(frozen=True)
class ExportInfo:
    """What an exported file records about its model (see :func:`detrain.engine.export._metadata`)."""

    names: dict[int, str]
    stride: int
    imgsz: tuple[int, int]
    dynamic: bool  # the batch is free; else the graph takes ``batch`` images
    free_size: bool  # the image size is free (multiples of ``stride``); else ``imgsz`` only
    batch: int
    end2end: bool  # the graph gives final top-k detections (B, max_det, 6); else boxes and scores for NMS
    max_det: int
    family: str


class ExportedModel(nn.Module):
    """An exported graph with the inference surface of an eval ``DetectionModel`` (see the module docstring).

    ``run`` maps a float32 (B, 3, H, W) batch at :attr:`imgsz` to the graph's output; ``info`` is the file's
    metadata; ``module``: the loaded TorchScript module (registered, so ``.to(device)`` moves it), or None."""

    def __init__(
        self, path: str, fmt: str, info: ExportInfo, run: Callable[[Tensor], Tensor], module: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.path, self.format, self.info, self._run = path, fmt, info, run
        self.graph = module
        self.names = dict(info.names)
        self.nc = len(info.names)
        self.imgsz = info.imgsz
        self.fixed_imgsz = None if info.free_size else info.imgsz  # what val and predict must run at, if anything
        self.end2end = info.end2end
        self.register_buffer("stride", torch.tensor([float(info.stride)]), persistent=False)
        self.eval()

    def forward(self, x: Tensor) -> Tensor:
        """The graph's output for ``x`` (float (B, 3, H, W): at :attr:`fixed_imgsz` when the graph has one, else any
        multiple of the stride), on ``x``'s device, in float32; a fixed-batch graph runs the batch in pieces of its
        own batch size."""
        stride = self.info.stride
        if self.fixed_imgsz is not None and tuple(x.shape[2:]) != self.fixed_imgsz:
            raise ConfigError(
                f"{shown(self.path)} was exported at imgsz={_size(self.imgsz)}: it takes (B, 3, {self.imgsz[0]}, "
                f"{self.imgsz[1]}) images, not {tuple(x.shape)}"
            )
        if any(v % stride for v in x.shape[2:]):
            raise ConfigError(f"{shown(self.path)} takes images whose sides are multiples of {stride}, not {x.shape}")
        x = x.float()
        if self.info.dynamic or len(x) == self.info.batch:
            return self._checked_run(x)
        return torch.cat([self._checked_run(part) for part in x.split(self.info.batch)])

    def _checked_run(self, x: Tensor) -> Tensor:
        """The graph's output for ``x``, checked: a graph that fails at run time (onnxruntime's or TorchScript's
        error) or gives other than a float tensor of the layout its metadata promises is one line naming the
        file, not a traceback from deep in the postprocess."""
        try:
            out = self._run(x)
        except Exception as e:  # noqa: BLE001 - whatever the graph's runtime raises is the file's fault, one line
            raise DetrainError(
                f"{shown(self.path)}: the exported graph failed on a {_shape(x.shape)} batch ({_reason(e)}); export "
                "the model again with 'detrain export'"
            ) from None
        problem = _output_problem(out, len(x), self.nc, self.end2end)
        if problem is not None:
            raise DetrainError(
                f"{shown(self.path)}: the exported graph gave {problem} for a {_shape(x.shape)} batch, where "
                f"{_expected(len(x), self.nc, self.end2end)} was expected; export the model again with "
                "'detrain export'"
            )
        return out.float()

    def set_inference(self, max_det: int = 300, agnostic: bool = False, nms: bool = False) -> ExportedModel:
        """What a model's ``set_inference`` shapes is fixed in an end-to-end graph: its class-wise top-k of
        ``max_det`` rows (fewer are kept by :meth:`postprocess`). Asking it for NMS or class-agnostic top-k is one
        line; a graph whose output goes through NMS takes every option."""
        if self.end2end and (nms or agnostic):
            key = "nms=true" if nms else "agnostic_nms=true"
            raise ConfigError(
                f"{shown(self.path)} holds an end-to-end graph (its top-{self.info.max_det} detections, class-wise): "
                f"{key} needs a model exported with nms=true, or the .pt"
            )
        return self

    def postprocess(self, preds: Tensor, options: InferenceOptions) -> list[Tensor]:
        """The graph's output -> per image (n, 6) detections by the postprocess the exported head runs."""
        if self.end2end:
            return filter_detections(preds, options.conf, options.max_det, options.classes)
        return nms(preds, options)

    def fuse(self) -> ExportedModel:
        """Nothing to fold: the export already folded every BatchNorm."""
        return self


@dataclass(frozen=True)
class ExportSummary:
    """What an exported file records, read without running it: ``Model(...)``'s view of an export until it
    serves."""

    path: str
    format: str
    info: ExportInfo

    @property
    def names(self) -> dict[int, str]:
        return dict(self.info.names)

    @property
    def nc(self) -> int:
        return len(self.info.names)


def export_summary(path: str | Path) -> ExportSummary:
    """The names, stride and sizes an exported file records. A TorchScript archive's ``detrain.json`` is read
    from the zip (nothing is loaded or run); an ONNX file's metadata from an onnxruntime session (operators only)."""
    name = str(path)
    if not name.endswith(".torchscript"):
        model = load_exported(name)
        return ExportSummary(name, model.format, model.info)
    file = Path(name).expanduser()
    if not file.is_file():
        raise ConfigError(f"exported model file not found: {shown(name)}")
    try:
        with zipfile.ZipFile(file) as archive:
            record = next((i for i in archive.infolist() if i.filename.endswith(f"/extra/{TORCHSCRIPT_META}")), None)
            raw = archive.read(record) if record is not None and record.file_size <= META_MAX_CHARS else b"null"
        meta = json.loads(raw)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise DetrainError(f"{shown(name)}: not a readable TorchScript archive ({type(e).__name__})") from None
    return ExportSummary(name, "torchscript", export_info(meta, name))


def load_exported(path: str | Path, device: torch.device | str = "cpu", trust: bool = False) -> ExportedModel:
    """The exported file ``path`` (``.onnx``, ``.torchscript``) ready to run on ``device`` (ONNX: on the CPU, its
    outputs moved to the input's device). A file that is missing, unreadable or lacks detrain's metadata is one
    line naming it.

    >>> load_exported("missing.torchscript")
    Traceback (most recent call last):
    ...
    detrain.errors.ConfigError: exported model file not found: missing.torchscript
    """
    name = str(path)
    if is_openvino(name):
        return _load_openvino(name)
    file = Path(name).expanduser()
    if not file.is_file():
        raise ConfigError(f"exported model file not found: {shown(name)}")
    if name.endswith(".onnx"):
        return _load_onnx(name, file)
    if name.endswith(".torchscript"):
        if not trust:
            check_torchscript(file)  # before torch.jit.load runs any of its code
        return _load_torchscript(name, file, torch.device(device))
    raise ConfigError(
        f"{shown(name)}: not an exported model (.onnx, .torchscript or an OpenVINO {FOLDER_SUFFIX} folder)"
    )


def _load_torchscript(name: str, file: Path, device: torch.device) -> ExportedModel:
    extra = {TORCHSCRIPT_META: ""}
    try:
        module = torch.jit.load(str(file), map_location=device, _extra_files=extra)
    except Exception as e:  # noqa: BLE001 - whatever torch's reader raises on a broken archive is one line
        raise DetrainError(f"{shown(name)}: not a readable TorchScript archive ({type(e).__name__})") from None
    try:
        meta = json.loads(extra[TORCHSCRIPT_META] or "null")
    except ValueError:
        meta = None
    info = export_info(meta, name)
    module.eval()

    def run(x: Tensor) -> Tensor:
        with torch.no_grad():
            return _first(module(x))

    return ExportedModel(name, "torchscript", info, run, module)


def _load_onnx(name: str, file: Path) -> ExportedModel:
    ort = _onnxruntime()
    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, torch.get_num_threads())
    options.log_severity_level = 3  # errors only: onnxruntime's warnings are not the user's to act on
    try:
        session = ort.InferenceSession(str(file), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - whatever onnxruntime raises on a broken file is one line
        raise DetrainError(f"{shown(name)}: not a readable ONNX model ({type(e).__name__})") from None
    raw = session.get_modelmeta().custom_metadata_map
    info = export_info({k: _literal(v) for k, v in raw.items()} if raw.get("producer") == "detrain" else None, name)
    graph_input = session.get_inputs()[0]
    dtype = torch.float16 if graph_input.type == "tensor(float16)" else torch.float32  # a half=true export's

    def run(x: Tensor) -> Tensor:
        array = np.ascontiguousarray(x.detach().to("cpu", dtype).numpy())
        return torch.from_numpy(session.run(None, {graph_input.name: array})[0]).to(x.device, torch.float32)

    return ExportedModel(name, "onnx", info, run)


def _load_openvino(name: str) -> ExportedModel:
    meta, run = read_openvino(name, torch.get_num_threads())
    literal = {k: _literal(v) for k, v in meta.items()} if meta is not None else None
    return ExportedModel(name, "openvino", export_info(literal, name), run)


def _onnxruntime() -> Any:
    """onnxruntime, or the one line that says how to install it."""
    try:
        import onnxruntime
    except ImportError:
        raise ConfigError(f"an .onnx model needs onnxruntime: {INSTALL_ONNXRUNTIME}") from None
    return onnxruntime


def _first(out: Any) -> Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _literal(text: str) -> Any:
    """An ONNX metadata value (``str`` of a Python value) back to the value; text that is no literal stays text."""
    if len(text) > META_MAX_CHARS:
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


def export_info(meta: Any, name: str) -> ExportInfo:
    """The :class:`ExportInfo` of a file's metadata (a dict), checked: a file without detrain's metadata, or with
    values of the wrong kind, is one line naming it.

    >>> export_info({"names": {0: "a"}, "stride": 32, "imgsz": [64, 96], "dynamic": False}, "m.onnx").imgsz
    (64, 96)
    >>> export_info({"names": {0: "a"}}, "m.onnx")
    Traceback (most recent call last):
    ...
    detrain.errors.ConfigError: m.onnx records no valid 'stride', 'imgsz' in its metadata: export it again with \
'detrain export'
    """
    meta = meta if isinstance(meta, dict) else {}
    names, stride, imgsz = meta.get("names"), meta.get("stride"), meta.get("imgsz")
    bad = [
        key
        for key, ok in (
            ("names", isinstance(names, dict) and bool(names) and all(isinstance(k, (int, str)) for k in names)),
            ("stride", isinstance(stride, int) and stride > 0),
            ("imgsz", isinstance(imgsz, (list, tuple)) and len(imgsz) == 2 and all(_positive(v) for v in imgsz)),
        )
        if not ok
    ]
    if bad:
        raise ConfigError(
            f"{shown(name)} records no valid {', '.join(repr(k) for k in bad)} in its metadata: export it again "
            "with 'detrain export'"
        )
    assert isinstance(names, dict) and isinstance(stride, int) and isinstance(imgsz, (list, tuple))
    problem = imgsz_problem(list(imgsz))  # a fixed-size graph letterboxes every image to it: bounded as imgsz= is
    if problem is None and stride > max_imgsz():
        problem = f"stride={stride}, more than {max_imgsz()}, the bound of imgsz="
    if problem is not None:
        raise ConfigError(f"{shown(name)}: its metadata records {problem}; export it again with 'detrain export'")
    try:
        classes = {int(k): str(v) for k, v in names.items()}
    except ValueError:
        raise ConfigError(f"{shown(name)}: its metadata's class names are not indexed 0 to n-1") from None
    if sorted(classes) != list(range(len(classes))):
        raise ConfigError(f"{shown(name)}: its metadata's class names are not indexed 0 to n-1")
    problem = name_problem(classes)
    if problem is not None:
        raise ConfigError(f"{shown(name)}: its metadata's {problem}")
    end2end = meta.get("end2end")
    if not isinstance(end2end, bool):  # a file of an earlier release says it in words only
        end2end = str(meta.get("output", "")).startswith("detections")
    batch = meta.get("batch", 1)
    max_det = meta.get("max_det", 300)
    return ExportInfo(
        names=classes,
        stride=stride,
        imgsz=(int(imgsz[0]), int(imgsz[1])),
        dynamic=meta.get("dynamic", True) is not False,
        free_size=meta.get("free_size") is True,
        batch=batch if _positive(batch) else 1,
        end2end=end2end,
        max_det=max_det if _positive(max_det) else 300,
        family=str(meta.get("family", "")),
    )


def _output_problem(out: Any, batch: int, nc: int, end2end: bool) -> str | None:
    """What is wrong with a graph's output for a batch of ``batch`` images, or None: it must be a floating tensor,
    (batch, 4 + nc, anchors) for NMS or (batch, rows, 6) detections for an end-to-end graph."""
    if not isinstance(out, Tensor):
        return f"a {type(out).__name__}"
    if not out.is_floating_point():
        return f"a {_shape(out.shape)} tensor of {str(out.dtype).removeprefix('torch.')}"
    shape = tuple(out.shape)
    fits = len(shape) == 3 and shape[0] == batch and (shape[2] == 6 if end2end else shape[1] == 4 + nc)
    return None if fits else f"a {_shape(out.shape)} tensor"


def _expected(batch: int, nc: int, end2end: bool) -> str:
    """The output layout the metadata promises, in words, for an error line."""
    return f"({batch}, max_det, 6) detections" if end2end else f"({batch}, {4 + nc}, anchors) boxes and scores"


def _shape(shape: Any) -> str:
    """``(1, 3, 64, 64)``: a tensor's shape as a plain tuple of ints."""
    return str(tuple(int(v) for v in shape))


def _reason(error: BaseException) -> str:
    """An exception as a short one-line reason: its type and its message's first line, clipped."""
    lines = str(error).strip().splitlines()
    first = shown(lines[0].strip())[:160] if lines else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 1 << 20


def _size(hw: tuple[int, int]) -> str:
    """``320`` for a square size, ``320,480`` otherwise."""
    return str(hw[0]) if hw[0] == hw[1] else f"{hw[0]},{hw[1]}"
