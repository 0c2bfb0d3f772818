"""Read Ultralytics YOLOv8 checkpoints without Ultralytics and map them onto detrain's DetectionModel.

An Ultralytics ``.pt`` pickles its whole training state, including Ultralytics classes
(``ultralytics.nn.tasks.DetectionModel``, ``ultralytics.nn.modules.Conv``) and ``torch.nn`` modules. It is
read by :func:`detrain.weights.safe_pickle.read_torch_zip` with ``ultralytics`` as a data-only namespace:
those classes become inert records (nothing is imported, nothing runs), and any other global in the file
stops the load. This module turns the records into a state dict and metadata, then into our model.

Example:
    >>> info = load_ultralytics_checkpoint("yolov8n.pt")          # doctest: +SKIP
    >>> info["names"][0], info["scale"], info["stride"]            # doctest: +SKIP
    ('person', 'n', [8.0, 16.0, 32.0])
    >>> model = to_detrain_model(info)                             # doctest: +SKIP
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from detrain.errors import CheckpointError
from detrain.weights import safe_pickle
from detrain.weights.safe_pickle import InertObject

if TYPE_CHECKING:  # the model module is only needed by to_detrain_model
    from detrain.nn.model import DetectionModel

__all__ = [
    "InertObject",
    "ULTRALYTICS_MODULES",
    "is_ultralytics_checkpoint",
    "load_ultralytics_checkpoint",
    "read_torch_zip",
    "to_detrain_model",
    "state_dict_of",
]

# Ultralytics' own classes are only data to us: they become inert records.
ULTRALYTICS_MODULES = ("ultralytics",)


def read_torch_zip(path: str | Path) -> Any:
    """Unpickle an Ultralytics (or any torch zip) checkpoint safely, with ``ultralytics.*`` as inert records.

    Example:
        >>> ckpt = read_torch_zip("yolov8n.pt")                    # doctest: +SKIP
        >>> sorted(ckpt)[:3]                                        # doctest: +SKIP
        ['best_fitness', 'date', 'ema']
    """
    return safe_pickle.read_torch_zip(path, inert_modules=ULTRALYTICS_MODULES)


_PEEK_BYTES = 4 << 20


def is_ultralytics_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a torch zip whose pickle names Ultralytics classes; reads bytes, unpickles nothing.

    Example:
        >>> is_ultralytics_checkpoint("yolov8n.pt")                 # doctest: +SKIP
        True
    """
    try:
        with zipfile.ZipFile(path) as zf:
            pkl = [n for n in zf.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            if not pkl:
                return False
            with zf.open(pkl[0]) as f:  # the model's class names come early; no need to read it all
                return b"ultralytics" in f.read(_PEEK_BYTES)
    except (OSError, zipfile.BadZipFile):
        return False


# --------------------------------------------------------------------------------------------------
# From the pickled module tree to a state dict and metadata
# --------------------------------------------------------------------------------------------------


def state_dict_of(module: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The ``nn.Module.state_dict()`` an inert module record would have: same names, same order.

    Walks ``_parameters``, then persistent ``_buffers``, then ``_modules`` recursively, as torch does.

    Example:
        >>> sd = state_dict_of(read_torch_zip("yolov8n.pt")["model"])   # doctest: +SKIP
        >>> next(iter(sd))                                              # doctest: +SKIP
        'model.0.conv.weight'
    """
    out: dict[str, torch.Tensor] = {}
    _walk(module, prefix, out, depth=0)
    return out


def _walk(module: Any, prefix: str, out: dict[str, torch.Tensor], depth: int) -> None:
    if depth > 64:
        raise CheckpointError("module tree nested deeper than 64 levels")
    if not isinstance(module, InertObject):
        raise CheckpointError(f"expected a pickled module at '{prefix or '<root>'}', found {type(module).__name__}")
    attrs = module.attrs()
    non_persistent = attrs.get("_non_persistent_buffers_set") or set()
    for group in ("_parameters", "_buffers"):
        for name, value in (attrs.get(group) or {}).items():
            if value is None or (group == "_buffers" and name in non_persistent):
                continue
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"'{prefix}{name}' is a {type(value).__name__}, not a tensor")
            out[prefix + name] = value
    for name, child in (attrs.get("_modules") or {}).items():
        if child is not None:
            _walk(child, f"{prefix}{name}.", out, depth + 1)


_SCALE_BY_STEM_WIDTH = {16: "n", 32: "s", 48: "m", 64: "l", 80: "x"}


def _plain(value: Any) -> Any:
    """Inert records of plain containers (SimpleNamespace, Namespace) -> their attribute dict."""
    return value.attrs() if isinstance(value, InertObject) else value


def load_ultralytics_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read an Ultralytics YOLOv8 detection checkpoint safely into plain data.

    Returns a dict with ``state_dict`` (name -> tensor, as ``DetectionModel.state_dict()`` names them;
    from the EMA model when the file has one), ``nc``, ``names`` (dict[int, str]), ``stride`` (list),
    ``imgsz`` (from the training arguments, or None), ``scale`` ('n'..'x'), ``yaml`` (the model yaml
    dict), ``epoch``, and ``date`` / ``version`` when present.

    Example:
        >>> info = load_ultralytics_checkpoint("yolov8n.pt")          # doctest: +SKIP
        >>> info["nc"], len(info["names"]), info["scale"]              # doctest: +SKIP
        (80, 80, 'n')
    """
    path = Path(path)
    ckpt = read_torch_zip(path)
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{path} holds a {type(ckpt).__name__}, not an Ultralytics checkpoint dict")
    model = ckpt.get("ema") if ckpt.get("ema") is not None else ckpt.get("model")
    if not isinstance(model, InertObject):
        raise CheckpointError(f"{path} has no 'model' or 'ema' entry: not an Ultralytics checkpoint")
    attrs = model.attrs()
    state_dict = state_dict_of(model)
    if not state_dict:
        raise CheckpointError(f"{path} holds a model without any weights")

    yaml_cfg = attrs.get("yaml") if isinstance(attrs.get("yaml"), dict) else {}
    raw_names = _plain(attrs.get("names"))
    if isinstance(raw_names, (list, tuple)):
        raw_names = dict(enumerate(raw_names))
    names = {int(k): str(v) for k, v in raw_names.items()} if isinstance(raw_names, dict) else {}
    nc = yaml_cfg.get("nc") or attrs.get("nc") or len(names)
    if not names and nc:
        names = {i: f"class{i}" for i in range(int(nc))}
    if len(names) != int(nc):
        raise CheckpointError(f"{path} names {len(names)} classes but its model has nc={nc}")
    stride = attrs.get("stride")
    stride_list = [float(s) for s in stride.tolist()] if isinstance(stride, torch.Tensor) else list(stride or [])

    train_args = _plain(ckpt.get("train_args"))
    imgsz = train_args.get("imgsz") if isinstance(train_args, dict) else None

    scale = yaml_cfg.get("scale")
    if scale not in _SCALE_BY_STEM_WIDTH.values():
        stem = state_dict.get("model.0.conv.weight")
        scale = _SCALE_BY_STEM_WIDTH.get(int(stem.shape[0])) if stem is not None and stem.ndim == 4 else None
    if scale is None:
        raise CheckpointError(f"cannot tell the YOLOv8 scale (n/s/m/l/x) of {path}: unknown stem width")

    info: dict[str, Any] = {
        "state_dict": state_dict,
        "nc": int(nc),
        "names": names,
        "stride": stride_list,
        "imgsz": imgsz,
        "scale": scale,
        "yaml": yaml_cfg,
        "epoch": ckpt.get("epoch"),
    }
    for key in ("date", "version"):
        if key in ckpt:
            info[key] = ckpt[key]
    return info


# --------------------------------------------------------------------------------------------------
# Onto our own model
# --------------------------------------------------------------------------------------------------


def to_detrain_model(info: dict[str, Any]) -> DetectionModel:
    """Build a detrain ``DetectionModel`` from :func:`load_ultralytics_checkpoint` output, in float32.

    Every key of our model must be in the checkpoint with the same shape (and no extra ones), else a
    CheckpointError lists the first differences.

    Example:
        >>> model = to_detrain_model(load_ultralytics_checkpoint("yolov8n.pt"))   # doctest: +SKIP
        >>> model.eval()(torch.zeros(1, 3, 640, 640)).shape                      # doctest: +SKIP
        torch.Size([1, 84, 8400])
    """
    from detrain.nn.model import DetectionModel

    model = DetectionModel(scale=info["scale"], nc=info["nc"], names=info["names"])
    ours = model.state_dict()
    theirs: dict[str, torch.Tensor] = info["state_dict"]
    problems: list[str] = []
    for key, ref in ours.items():
        if key not in theirs:
            problems.append(f"missing {key} (expected shape {tuple(ref.shape)})")
        elif tuple(theirs[key].shape) != tuple(ref.shape):
            problems.append(f"{key} has shape {tuple(theirs[key].shape)}, expected {tuple(ref.shape)}")
    problems += [f"unexpected {key}" for key in theirs if key not in ours]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(
            f"checkpoint does not fit YOLOv8{info['scale']} with nc={info['nc']}: {'; '.join(problems[:3])}{more}"
        )
    converted = {
        k: (v.to(torch.float32) if v.is_floating_point() else v.to(ours[k].dtype)).contiguous()
        for k, v in theirs.items()
    }
    model.load_state_dict(converted, strict=True)
    model.float()
    return model
