"""``pretrained=``: the weights a training run starts from.

* ``true`` (the default): a ``model=`` .pt starts from its own weights; a ``model=`` yaml from a fresh init.
* ``false``: a ``model=`` .pt gives only its architecture (and its classes, fitted to the dataset's) and trains
  from a fresh init, as a yaml would.
* a weights file (``pretrained=yolov8n.pt``, a path, or a release name that is downloaded): every tensor of the
  ``model=`` yaml's model with the same state-dict key and shape in that file starts from the file's value; the
  others (a class head for another number of classes, a layer of another width) keep their init. The line
  ``transferred K/N items`` says how many of the model's N tensors came from the file, as Ultralytics prints it,
  and names the layers left out. Weights of another family (YOLOv8 weights for a YOLO11 model, or the other way)
  are an error: the two share key names and some shapes, but not what the layers behind them do.

The file is read by :func:`detrain.weights.checkpoint.load_checkpoint`, the restricted reader every checkpoint goes
through: nothing in it runs. A detrain checkpoint gives its EMA weights when it has them (those are the ones
validated and kept as best.pt), a YOLOv8 file its model. A resumed run starts from its own ``last.pt`` and reads
no ``pretrained`` file.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from detrain.config.cfg import Cfg
from detrain.errors import CheckpointError

if TYPE_CHECKING:
    from detrain.nn.model import DetectionModel


def starts_from_weights(cfg: Cfg) -> bool:
    """Whether training starts from trained weights (fine-tuning) rather than from a fresh init.

    >>> from detrain.config.cfg import make_cfg
    >>> [starts_from_weights(make_cfg(a)) for a in ({"model": "n.yaml"}, {"model": "n.pt"},
    ...   {"model": "n.pt", "pretrained": False}, {"model": "n.yaml", "pretrained": "yolov8n.pt"})]
    [False, True, False, True]
    """
    from detrain.engine.build import is_weights

    return isinstance(cfg.inputs.pretrained, str) or (
        is_weights(cfg.inputs.model) and cfg.inputs.pretrained is not False
    )


def check_pretrained(pretrained: bool | str) -> None:
    """Raise the error training would meet for a ``pretrained=`` file that is missing or a folder, without reading
    or downloading anything (a release name such as ``yolov8n.pt`` is downloaded when training starts)."""
    if not isinstance(pretrained, str):
        return
    from detrain.weights.hub import canonical_name

    path = Path(pretrained).expanduser()
    if path.is_dir():
        raise CheckpointError(f"pretrained weights '{pretrained}' is a folder, not a .pt file")
    if not path.is_file() and canonical_name(pretrained) is None:
        raise CheckpointError(f"pretrained weights file not found: {pretrained}")


def transfer(model: nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """Copy into ``model`` every tensor of ``state`` whose key and shape the model has (floats cast to the model's
    dtype); returns the keys copied. The model's other tensors keep their values."""
    own = model.state_dict()
    matched = {
        k: v
        for k, v in state.items()
        if k in own
        and isinstance(v, torch.Tensor)
        and tuple(v.shape) == tuple(own[k].shape)
        and v.is_floating_point() == own[k].is_floating_point()
    }
    with torch.no_grad():
        for key, value in matched.items():
            own[key].copy_(value.to(dtype=own[key].dtype))
    return sorted(matched)


class Transferred(NamedTuple):
    """What :func:`load_pretrained` copied: the model's keys that came from the file, and those left out."""

    copied: list[str]
    left_out: list[str]

    def line(self, weights: str) -> str:
        """``transferred K/N items from pretrained weights W`` and, when some were left out, their layers.

        >>> Transferred(["a.weight"], ["m.22.cv3.0.2.weight", "m.22.cv3.0.2.bias"]).line("w.pt")
        'transferred 1/3 items from pretrained weights w.pt; left out (kept their init): m.22.cv3.0.2'
        """
        total = len(self.copied) + len(self.left_out)
        text = f"transferred {len(self.copied)}/{total} items from pretrained weights {weights}"
        if not self.left_out:
            return text
        layers = list(dict.fromkeys(key.rsplit(".", 1)[0] for key in self.left_out))  # weight, bias ... -> layer
        more = f" and {len(layers) - _LAYERS_NAMED} more layers" if len(layers) > _LAYERS_NAMED else ""
        return f"{text}; left out (kept their init): {', '.join(layers[:_LAYERS_NAMED])}{more}"


_LAYERS_NAMED = 8  # layers a transfer line names before it only counts the rest


def start_weights(model: DetectionModel, cfg: Cfg, verbose: bool = True) -> DetectionModel:
    """The model training starts from, given ``cfg.inputs.pretrained`` (see the module's docstring): ``model`` as built
    by :func:`detrain.engine.build.build_model`, a fresh one of its architecture, or it with a file's tensors."""
    from detrain.engine.build import is_weights
    from detrain.log import console

    if cfg.inputs.pretrained is False and is_weights(cfg.inputs.model):
        from detrain.nn.model import DetectionModel

        fresh = DetectionModel(cfg=model.yaml, scale=model.scale, nc=model.nc, names=model.names)
        if verbose:
            console.print(f"pretrained=false: training the architecture of {cfg.inputs.model} from a fresh init")
        return fresh
    if isinstance(cfg.inputs.pretrained, str):
        done = load_pretrained(model, cfg.inputs.pretrained)
        if verbose:
            console.print(done.line(cfg.inputs.pretrained), soft_wrap=True)
    return model


def load_pretrained(model: DetectionModel, weights: str) -> Transferred:
    """Start ``model`` from the matching tensors of ``weights`` (a path or a release name); a CheckpointError when
    the file holds a model of another family."""
    from detrain.weights.checkpoint import load_checkpoint
    from detrain.weights.hub import resolve_weights

    check_pretrained(weights)
    ckpt = load_checkpoint(resolve_weights(weights))
    _check_family(model, ckpt, weights)
    copied = transfer(model, _weights_of(ckpt))
    kept = set(copied)
    return Transferred(copied, [key for key in model.state_dict() if key not in kept])


_EXAMPLE_WEIGHTS = {
    "yolov8": "yolov8n.pt",
    "yolo11": "yolo11n.pt",
    "yolo26": "yolo26n.pt",
}  # the families detrain builds


def _family_of(ckpt: dict[str, Any]) -> str | None:
    """The family of the model a (vetted) checkpoint describes; None when its architecture cannot be read."""
    from detrain.errors import ConfigError
    from detrain.nn.model import family, load_model_yaml

    recorded = ckpt["model"].get("yaml")
    if recorded is None:
        return "yolov8"  # detrain checkpoints without one hold the packaged YOLOv8 architecture
    try:
        return family(load_model_yaml(recorded)[0])
    except (ConfigError, OSError):
        return None


def _check_family(model: DetectionModel, ckpt: dict[str, Any], weights: str) -> None:
    theirs, ours = _family_of(ckpt), model.family
    if theirs is None or theirs == ours:
        return
    other = f", or train their architecture (model={theirs}n.yaml)" if theirs in _EXAMPLE_WEIGHTS else ""
    raise CheckpointError(
        f"pretrained weights {weights} hold a {theirs} model, but the model to train is {ours}: the layers of two "
        f"families do not correspond, even where names and shapes agree; start from {ours} weights such as "
        f"{_EXAMPLE_WEIGHTS.get(ours, 'yolov8n.pt')}{other}"
    )


def _weights_of(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A checkpoint's EMA state dict when it has one, else its model's (both checked by load_checkpoint)."""
    ema = ckpt.get("ema")
    return ema["state_dict"] if ema else ckpt["model"]["state_dict"]
