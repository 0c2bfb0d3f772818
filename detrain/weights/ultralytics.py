"""Read Ultralytics detection checkpoints (YOLOv8, YOLO11, YOLO26) without Ultralytics, as plain data for our model.

An Ultralytics ``.pt`` pickles its whole training state, including Ultralytics classes
(``ultralytics.nn.tasks.DetectionModel``, ``ultralytics.nn.modules.Conv``, ``...block.C3k2``) and ``torch.nn``
modules. It is read by :func:`detrain.weights.safe_pickle.read_torch_zip` with the whole ``ultralytics``
namespace as data only: every class in it, whatever block a later release adds, becomes an inert record
(nothing is imported, nothing runs), and any other global in the file stops the load. This module turns the
records into a state dict and metadata, including the architecture yaml the model was built from, which
:func:`detrain.weights.checkpoint.model_from_checkpoint` builds (never an assumed YOLOv8).

Example, with YOLOv8n's release file: ``info = ultralytics_info(read_torch_zip("yolov8n.pt"), Path("yolov8n.pt"))``
gives ``info["names"][0], info["scale"], info["stride"] == ('person', 'n', [8.0, 16.0, 32.0])``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from detrain.errors import CheckpointError
from detrain.system.text import name_problem
from detrain.weights import limits, safe_pickle
from detrain.weights.safe_pickle import InertObject

__all__ = [
    "ULTRALYTICS_MODULES",
    "InertObject",
    "is_ultralytics_record",
    "read_torch_zip",
    "state_dict_of",
    "ultralytics_info",
]

# Ultralytics' own classes are only data to us: they become inert records.
ULTRALYTICS_MODULES = ("ultralytics",)


def read_torch_zip(path: str | Path, data: bytes | None = None) -> Any:
    """Unpickle an Ultralytics (or any torch zip) checkpoint safely, with ``ultralytics.*`` as inert records.

    Example (``torch.nn`` modules come back as inert records too; YOLOv8n's file has the keys
    ``['best_fitness', 'date', 'ema', ...]``):
        >>> torch.save({"epoch": 3, "model": torch.nn.Linear(2, 1)}, "ckpt.pt")
        >>> ckpt = read_torch_zip("ckpt.pt"); ckpt["epoch"], ckpt["model"]
        (3, <inert torch.nn.modules.linear.Linear>)
    """
    return safe_pickle.read_torch_zip(path, inert_modules=ULTRALYTICS_MODULES, data=data)


def is_ultralytics_record(ckpt: Any) -> bool:
    """Whether what :func:`read_torch_zip` returned is shaped like an Ultralytics checkpoint (a model record)."""
    return isinstance(ckpt, dict) and any(isinstance(ckpt.get(k), InertObject) for k in ("model", "ema"))


# --------------------------------------------------------------------------------------------------
# From the pickled module tree to a state dict and metadata
# --------------------------------------------------------------------------------------------------

# A module tree whose records share children is walked once per place they appear, as torch's own
# state_dict() does; a file could share its way to 2**64 places in 64 levels, or list one record with
# 100,000 weights under 100,000 names, so places and the entries read at them are counted.
_MAX_MODULE_VISITS = 100_000  # YOLOv8n: 225 module records
_MAX_ENTRIES = 1_000_000  # parameters, buffers and children read over the walk; YOLOv8n: about 1,000
_MAX_DEPTH = 64
_MAX_CLASSES = 100_000
_MAX_NAME_CHARS = 1_000
_MAX_STRIDES = 16


def state_dict_of(module: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The ``nn.Module.state_dict()`` an inert module record would have: same names, same order.

    Walks ``_parameters``, then persistent ``_buffers``, then ``_modules`` recursively, as torch does.
    Raises CheckpointError for anything that is not a module tree of named tensors.

    Example:
        >>> torch.save(torch.nn.Sequential(torch.nn.Conv2d(3, 2, 1), torch.nn.BatchNorm2d(2)), "m.pt")
        >>> list(state_dict_of(read_torch_zip("m.pt")))
        ['0.weight', '0.bias', '1.weight', '1.bias', '1.running_mean', '1.running_var', '1.num_batches_tracked']
    """
    out: dict[str, torch.Tensor] = {}
    _walk(module, prefix, out, depth=0, visits=[0, 0])
    return out


def _named_entries(attrs: dict[Any, Any], group: str, where: str, visits: list[int]) -> dict[str, Any]:
    """``attrs[group]`` as a dict with text keys (None or absent: empty), counted against _MAX_ENTRIES."""
    entries = attrs.get(group)
    if entries is None:
        return {}
    if not isinstance(entries, dict):
        raise CheckpointError(f"{group} of '{where}' is a {type(entries).__name__}, not a dict")
    visits[1] += len(entries)  # a record shared by many places is read once per place
    if visits[1] > _MAX_ENTRIES:
        raise CheckpointError(f"module tree has more than {_MAX_ENTRIES} named entries (shared records?)")
    for name in entries:
        if not isinstance(name, str) or len(name) > _MAX_NAME_CHARS:
            raise CheckpointError(f"{group} of '{where}' has an entry named by a {type(name).__name__}")
    return entries


def _walk(module: Any, prefix: str, out: dict[str, torch.Tensor], depth: int, visits: list[int]) -> None:
    """``visits``: [module places walked, named entries read], both capped."""
    if depth > _MAX_DEPTH:
        raise CheckpointError(f"module tree nested deeper than {_MAX_DEPTH} levels")
    visits[0] += 1
    if visits[0] > _MAX_MODULE_VISITS:
        raise CheckpointError(f"module tree has more than {_MAX_MODULE_VISITS} module places (shared records?)")
    where = prefix or "<root>"
    if not isinstance(module, InertObject):
        raise CheckpointError(f"expected a pickled module at '{where}', found {type(module).__name__}")
    attrs = module.attrs()
    non_persistent = attrs.get("_non_persistent_buffers_set")
    if non_persistent is None:
        non_persistent = set()
    if not isinstance(non_persistent, (set, frozenset)):
        raise CheckpointError(f"_non_persistent_buffers_set of '{where}' is a {type(non_persistent).__name__}")
    for group in ("_parameters", "_buffers"):
        for name, value in _named_entries(attrs, group, where, visits).items():
            if value is None or (group == "_buffers" and name in non_persistent):
                continue
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"'{prefix}{name}' is a {type(value).__name__}, not a tensor")
            out[prefix + name] = value
    for name, child in _named_entries(attrs, "_modules", where, visits).items():
        if child is not None:
            _walk(child, f"{prefix}{name}.", out, depth + 1, visits)


# YOLOv8's stem widths, for the older files whose yaml names no scale (single-scale depth/width multiples)
_SCALE_BY_STEM_WIDTH = {16: "n", 32: "s", 48: "m", 64: "l", 80: "x"}
_SCALES = tuple(_SCALE_BY_STEM_WIDTH.values())
# The architecture yaml a file records: plain data, small (YOLO11's is about 300 values)
_MAX_YAML_VALUES = 10_000
_MAX_YAML_DEPTH = 8
_PLAIN = (str, int, float, bool, type(None))


def _plain(value: Any) -> Any:
    """Inert records of plain containers (SimpleNamespace, Namespace) -> their attribute dict."""
    return value.attrs() if isinstance(value, InertObject) else value


def _small_int(value: Any, low: int, high: int) -> int | None:
    """``value`` if it is a true int (or a one-element integer tensor) within [low, high], else None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
        return value
    return None


def _whole(value: Any) -> int | None:
    """``value`` if it is a true int (or a one-element integer tensor), of any size, else None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _class_names(raw: Any, path: Path) -> dict[int, str]:
    """Ultralytics ``names``: a dict {index: name} (or a list of names) -> dict[int, str]; else refused."""
    raw = _plain(raw)
    if raw is None:
        return {}
    if isinstance(raw, (list, tuple)):
        raw = dict(enumerate(raw))
    if not isinstance(raw, dict) or len(raw) > _MAX_CLASSES:
        raise CheckpointError(f"{path}: its class names are a {type(raw).__name__}, not a dict of index -> name")
    names: dict[int, str] = {}
    for k, v in raw.items():
        digits = isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 6
        index = int(k) if digits else _small_int(k, 0, _MAX_CLASSES)
        if index is None or not isinstance(v, str) or len(v) > _MAX_NAME_CHARS:
            raise CheckpointError(
                f"{path}: its class names hold a {type(k).__name__} -> {type(v).__name__} entry, not an index -> name"
            )
        names[index] = v
    problem = name_problem(names)
    if problem is not None:
        raise CheckpointError(f"{path}: its {problem}")
    return names


def _strides(raw: Any, path: Path) -> list[float]:
    if raw is None:
        return []
    if isinstance(raw, torch.Tensor) and raw.ndim == 1 and raw.numel() <= _MAX_STRIDES:
        return [float(s) for s in raw.tolist()]
    if isinstance(raw, (list, tuple)) and len(raw) <= _MAX_STRIDES and all(type(s) in (int, float) for s in raw):
        return [float(s) for s in raw]
    raise CheckpointError(f"{path}: its model stride is a {type(raw).__name__}, not a short list of numbers")


def _image_size(train_args: Any, path: Path) -> int | None:
    """The training image size: an int, or the larger side of an [h, w] pair; None when absent or not whole
    numbers. A size outside the bound of ``imgsz=`` (:func:`detrain.weights.limits.imgsz_problem`) is refused in
    one line: an export traces, and the model's cost is counted, at this size."""
    value = train_args.get("imgsz") if isinstance(train_args, dict) else None
    sides = list(value) if isinstance(value, (list, tuple)) and 1 <= len(value) <= 2 else [value]
    whole = [_whole(side) for side in sides]
    if None in whole:
        return None
    problem = limits.imgsz_problem(whole)
    if problem is not None:
        raise CheckpointError(f"{path}: its training arguments record {problem}; detrain runs models within it")
    return max(side for side in whole if side is not None)


def _plain_yaml(value: Any, path: Path, count: list[int], depth: int = 0) -> Any:
    """``value`` as plain yaml data (dicts with text keys, lists, text, numbers, None), capped; else refused.

    The yaml goes into the detrain checkpoint, which ``torch.load(weights_only=True)`` must read back, and into
    the model builder, so nothing else (a record, a tensor, a set) may come through.
    """
    count[0] += 1
    if count[0] > _MAX_YAML_VALUES or depth > _MAX_YAML_DEPTH:
        raise CheckpointError(f"{path}: its architecture (yaml) is larger or deeper than a model yaml is")
    if isinstance(value, _PLAIN):
        if isinstance(value, str) and len(value) > _MAX_NAME_CHARS:
            raise CheckpointError(f"{path}: its architecture (yaml) holds a text of {len(value)} characters")
        return value
    if isinstance(value, (list, tuple)):
        return [_plain_yaml(v, path, count, depth + 1) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain_yaml(v, path, count, depth + 1) for k, v in value.items()}
    raise CheckpointError(f"{path}: its architecture (yaml) holds a {type(value).__name__}, not plain yaml data")


def _scale(yaml_cfg: dict[str, Any], state_dict: dict[str, torch.Tensor], path: Path) -> str:
    """The scale the model was built at: the yaml's ``scale`` (one of its ``scales``); for a yaml with scales that
    names none, the first one (what Ultralytics builds then); for the older single-scale yaml, the label
    YOLOv8's stem width gives."""
    scales = yaml_cfg.get("scales")
    scale = yaml_cfg.get("scale")
    if isinstance(scales, dict) and scales:
        if isinstance(scale, str) and scale in scales:
            return scale
        first = next(iter(scales))
        if isinstance(first, str) and first in _SCALES:
            return first
    elif isinstance(scale, str) and scale in _SCALES:
        return scale
    stem = state_dict.get("model.0.conv.weight")
    guessed = _SCALE_BY_STEM_WIDTH.get(int(stem.shape[0])) if stem is not None and stem.ndim == 4 else None
    if guessed is None:
        raise CheckpointError(f"cannot tell the scale (n/s/m/l/x) of {path}: its yaml names none, unknown stem width")
    return guessed


def ultralytics_info(ckpt: Any, path: Path) -> dict[str, Any]:
    """What :func:`read_torch_zip` returned for an Ultralytics detection checkpoint ``path``, as plain data.

    Returns a dict with ``state_dict`` (name -> tensor, as ``DetectionModel.state_dict()`` names them;
    from the EMA model when the file has one), ``nc``, ``names`` (dict[int, str]), ``stride`` (list),
    ``imgsz`` (from the training arguments, or None), ``scale`` ('n'..'x'), ``yaml`` (the architecture the
    model was built from, as plain data), ``epoch``, and ``date`` / ``version`` when present.

    Every field is type-checked before use: the records came from a file, and a number that turns out to
    be an array or a name that turns out to be a nested list must end in a CheckpointError, not deep
    inside a comparison or a repr. Whether detrain can build that architecture is decided when the model
    is built (:func:`detrain.weights.checkpoint.model_from_checkpoint`).
    """
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{path} holds a {type(ckpt).__name__}, not an Ultralytics checkpoint dict")
    model = ckpt.get("ema") if ckpt.get("ema") is not None else ckpt.get("model")
    if not isinstance(model, InertObject):
        raise CheckpointError(f"{path} has no 'model' or 'ema' entry: not an Ultralytics checkpoint")
    attrs = model.attrs()
    try:
        state_dict = state_dict_of(model)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if not state_dict:
        raise CheckpointError(f"{path} holds a model without any weights")

    raw_yaml = attrs.get("yaml")
    yaml_cfg: dict[str, Any] = _plain_yaml(raw_yaml, path, [0]) if isinstance(raw_yaml, dict) else {}
    yaml_cfg.pop("yaml_file", None)  # a path on the machine that built it: nothing the architecture needs
    names = _class_names(attrs.get("names"), path)
    nc = _small_int(yaml_cfg.get("nc"), 1, _MAX_CLASSES) or _small_int(attrs.get("nc"), 1, _MAX_CLASSES) or len(names)
    if not names and nc:
        names = {i: f"class{i}" for i in range(nc)}
    if len(names) != nc:
        raise CheckpointError(f"{path} names {len(names)} classes but its model has nc={nc}")
    if set(names) != set(range(nc)):
        raise CheckpointError(f"{path} numbers its {nc} class names other than 0..{nc - 1}")
    stride_list = _strides(attrs.get("stride"), path)
    imgsz = _image_size(_plain(ckpt.get("train_args")), path)

    info: dict[str, Any] = {
        "state_dict": state_dict,
        "nc": nc,
        "names": names,
        "stride": stride_list,
        "imgsz": imgsz,
        "scale": _scale(yaml_cfg, state_dict, path),
        "yaml": yaml_cfg,
        "epoch": ckpt.get("epoch"),
    }
    for key in ("date", "version"):
        if key in ckpt:
            info[key] = ckpt[key]
    return info
