"""OpenVINO IR: ``detrain export format=openvino`` writes it, ``detrain val`` and ``predict`` serve it.

An export is a folder named as Ultralytics names its own, ``<stem>_openvino_model/``, holding ``<stem>.xml`` (the
graph) and ``<stem>.bin`` (the weights): the ONNX graph :func:`detrain.engine.export.export_onnx` traces (same
input, output and free sizes), read by OpenVINO's runtime and saved as IR, float32 weights, or float16 ones with
``half=true`` (OpenVINO computes in float32 on a CPU either way). The metadata an ONNX export records (names,
stride, sizes, kind of output) travels in the IR's ``rt_info`` under ``model_info``.

Only OpenVINO's runtime is used (``Core.read_model``, ``save_model``, ``compile_model``), never its model
converter (``openvino.convert_model``, the ``ovc`` tool), which starts OpenVINO's usage telemetry, sent to the
internet unless a user opted out: detrain never reaches the network. ``pip install "detrain[openvino]"`` installs
OpenVINO and ``onnx`` (the ONNX exporter needs it).

Served on OpenVINO's CPU plugin with this process's torch thread count and float32 inference precision (on a
CPU with bfloat16 units the plugin would otherwise round activations to bfloat16), so the detections are the
``.pt`` model's to float tolerance. An IR file is a graph of OpenVINO operators, which read no files and start no
processes; the folder's two files must be regular files (no symbolic links) and the graph at most
:data:`MAX_XML_BYTES`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from detrain.engine.export import export_onnx
from detrain.errors import ConfigError, DetrainError
from detrain.system.text import shown

if TYPE_CHECKING:
    import torch

    from detrain.nn.model import DetectionModel

__all__ = ["FOLDER_SUFFIX", "export_openvino", "ir_path", "is_openvino", "openvino_folder", "read_openvino"]

#: the end of an OpenVINO export's folder name (``best_openvino_model``), as Ultralytics names it
FOLDER_SUFFIX = "_openvino_model"
#: the ``rt_info`` section that holds the metadata
META_SECTION = "model_info"
#: a graph file larger than this is no export of a detection model (yolov8x's is under 2 MB)
MAX_XML_BYTES = 64 << 20
INSTALL_OPENVINO = 'pip install "detrain[openvino]"'


def is_openvino(name: str) -> bool:
    """Whether ``name`` names an OpenVINO export: its folder (``..._openvino_model``) or its ``.xml`` graph.

    >>> is_openvino("best_openvino_model/"), is_openvino("best_openvino_model/best.xml"), is_openvino("best.onnx")
    (True, True, False)
    """
    return str(name).strip().rstrip("/").endswith((FOLDER_SUFFIX, ".xml"))


def openvino_folder(weights: str | os.PathLike[str]) -> Path:
    """The folder an export of ``weights`` goes to: beside it, named after its stem.

    >>> openvino_folder("runs/train/exp/weights/best.pt").as_posix()
    'runs/train/exp/weights/best_openvino_model'
    """
    path = Path(weights)
    return path.with_name(path.stem + FOLDER_SUFFIX)


def export_openvino(
    model: DetectionModel,
    out_dir: str | os.PathLike[str],
    imgsz: int | tuple[int, int] | None = None,
    dynamic_batch: bool = True,
    nms: bool = False,
    half: bool = False,
) -> Path:
    """Write ``model`` as OpenVINO IR into the folder ``out_dir`` (``<stem>_openvino_model``: ``<stem>.xml`` and
    ``<stem>.bin``) and return the folder. The graph is :func:`detrain.engine.export.export_onnx`'s for the same
    arguments; ``half`` stores the weights as float16. The folder appears whole: it is written beside under a
    temporary name and renamed, and a failed export leaves the folder that was there (if any) as it was."""
    ov = _openvino()
    out = Path(out_dir)
    stem = out.name[: -len(FOLDER_SUFFIX)] if out.name.endswith(FOLDER_SUFFIX) else out.name
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent))
    except OSError as e:
        raise DetrainError(f"cannot write the export {out}: {e.strerror or e}") from None
    try:
        onnx = export_onnx(model, work / "graph.onnx", imgsz=imgsz, dynamic_batch=dynamic_batch, nms=nms)
        graph = ov.Core().read_model(str(onnx))
        for key, value in _framework_meta(graph).items():
            graph.set_rt_info(value, [META_SECTION, key])
        folder = work / "ir"
        folder.mkdir()
        ov.save_model(graph, str(folder / f"{stem}.xml"), compress_to_fp16=half)
        _replace_folder(folder, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _framework_meta(graph: Any) -> dict[str, str]:
    """The ONNX file's ``metadata_props``, which OpenVINO's ONNX reader keeps in ``rt_info['framework']``."""
    info = graph.get_rt_info()
    if "framework" not in info:
        return {}
    return {str(k): v.astype(str) for k, v in info["framework"].items()}


def _replace_folder(new: Path, out: Path) -> None:
    """Put the folder ``new`` at ``out``: a folder already there is moved aside first and removed once ``new`` is
    in place (a link at ``out`` is replaced, not followed)."""
    old = None
    if out.is_symlink() or out.is_file():
        out.unlink()
    elif out.exists():
        old = out.with_name(f".{out.name}.{os.getpid()}.old")
        os.replace(out, old)
    try:
        os.replace(new, out)
    except OSError:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def ir_path(name: str) -> Path:
    """The graph file (``.xml``) of an OpenVINO export named by its folder or by the file itself, checked: a
    missing folder or file, a folder with no graph or with several, a link or an oversized graph is one line.

    >>> ir_path("missing_openvino_model")
    Traceback (most recent call last):
    ...
    detrain.errors.ConfigError: exported model not found: missing_openvino_model
    """
    path = Path(name.rstrip("/")).expanduser()
    if path.is_dir() and not path.is_symlink():
        graphs = sorted(path.glob("*.xml"))
        if len(graphs) != 1:
            found = "no .xml graph" if not graphs else f"{len(graphs)} .xml graphs"
            raise ConfigError(
                f"{shown(name)}: an OpenVINO export folder holds one .xml graph and its .bin; found {found}"
            )
        path = graphs[0]
    elif not path.exists() and not path.is_symlink():
        raise ConfigError(f"exported model not found: {shown(name)}")
    for part in (path, path.with_suffix(".bin")):
        if part.is_symlink() or not part.is_file():
            problem = "a symbolic link" if part.is_symlink() else "missing or not a file"
            raise ConfigError(f"{shown(name)}: the OpenVINO file {shown(str(part))} is {problem}")
    if path.stat().st_size > MAX_XML_BYTES:
        raise ConfigError(
            f"{shown(name)}: {shown(str(path))} is larger than {MAX_XML_BYTES >> 20} MiB: no export of detrain's"
        )
    return path


def read_openvino(name: str, threads: int) -> tuple[dict[str, str] | None, Callable[[torch.Tensor], torch.Tensor]]:
    """(the metadata the IR records, or None without detrain's; a function from an input batch to the graph's
    first output) for the export ``name``, compiled for OpenVINO's CPU plugin at float32 precision."""
    import numpy as np
    import torch

    ov = _openvino()
    xml = ir_path(name)
    core = ov.Core()
    try:
        graph = core.read_model(str(xml))
        compiled = core.compile_model(
            graph, "CPU", {"INFERENCE_NUM_THREADS": max(1, threads), "INFERENCE_PRECISION_HINT": "f32"}
        )
    except Exception as e:  # noqa: BLE001 - whatever OpenVINO raises on a broken or foreign graph is one line
        raise DetrainError(f"{shown(name)}: not a readable OpenVINO model ({type(e).__name__})") from None
    info = graph.get_rt_info()
    meta = None
    if META_SECTION in info:
        meta = {str(k): v.astype(str) for k, v in info[META_SECTION].items()}
        meta = meta if meta.get("producer") == "detrain" else None
    request = compiled.create_infer_request()

    def run(x: torch.Tensor) -> torch.Tensor:
        array = np.ascontiguousarray(x.detach().to("cpu", torch.float32).numpy())
        out = request.infer({0: array})
        return torch.from_numpy(np.array(out[compiled.output(0)])).to(x.device)

    return meta, run


def _openvino() -> Any:
    """openvino, or the one line that says how to install it."""
    try:
        import openvino
    except ImportError:
        raise ConfigError(f"an OpenVINO export needs openvino: {INSTALL_OPENVINO}") from None
    return openvino
