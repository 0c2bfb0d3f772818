"""``freeze=``: layers whose weights training leaves as they are (fine-tuning a backbone that already knows).

``freeze=N`` fixes the first N layers of the model yaml (``model.0`` to ``model.N-1``), ``freeze=0,1,2`` the layers
listed, as in Ultralytics; a list may also name parts of a layer as Ultralytics' list takes them (``22.cv3``: every
parameter whose name starts ``model.22.cv3.``, the head's class branch), and a name that matches no parameter is
one line. A frozen layer's parameters get ``requires_grad=False`` before the optimizer and DDP
are built, so:

* the optimizer's parameter groups leave them out (no update, no weight decay, no optimizer state);
* DDP registers only parameters that need a gradient: frozen ones are in no gradient bucket and no all-reduce,
  every rank freezes the same layers (the same arguments), so every rank's reducer holds the same parameters
  and ``find_unused_parameters`` stays off (every trainable parameter is used in every forward);
* DDP's start-up broadcast still covers them, so every rank starts (and stays) with rank 0's values;
* backward stops at the first trainable layer: frozen layers in front cost no gradient computation.

BatchNorm in a frozen layer keeps training mode, as in Ultralytics: its weight and bias stay fixed but its
running mean and variance follow the new images (what normalisation needs when they differ from the data the
weights were trained on), so a frozen run is comparable with one trained by Ultralytics with the same key.
The EMA model copies frozen parameters instead of averaging them, so they stay bit-identical there too.

>>> from detrain.nn.model import DetectionModel
>>> model = DetectionModel(nc=2)
>>> freeze_layers(model, 2)
[0, 1]
>>> model.model[1].conv.weight.requires_grad, model.model[2].cv1.conv.weight.requires_grad
(False, True)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from detrain.errors import ConfigError

if TYPE_CHECKING:
    from detrain.nn.model import DetectionModel


Freeze = int | list[int | str] | None


def _layer_of(name: str) -> int:
    """The layer a freeze name is below: ``'22.cv3'`` -> 22."""
    return int(name.split(".", 1)[0])


def frozen_indices(freeze: Freeze, n_layers: int) -> list[int]:
    """The layer indices ``freeze`` names in a model of ``n_layers`` layers, whole or in part (a name such as
    ``22.cv3``); a ConfigError for an index it has not or for freezing every layer (nothing would train).

    >>> frozen_indices(3, 23), frozen_indices([0, 22], 23), frozen_indices(None, 23), frozen_indices([1, "22.cv3"], 23)
    ([0, 1, 2], [0, 22], [], [1, 22])
    """
    whole = _whole_layers(freeze, n_layers)
    parts = sorted({_layer_of(f) for f in freeze if isinstance(f, str)}) if isinstance(freeze, list) else []
    beyond = [i for i in parts if i >= n_layers]
    if beyond:
        raise ConfigError(
            f"invalid value for 'freeze': {freeze}; the model has layers 0 to {n_layers - 1}, not layer {beyond[0]}"
        )
    return sorted(set(whole) | set(parts))


def _whole_layers(freeze: Freeze, n_layers: int) -> list[int]:
    """The layers ``freeze`` fixes whole: the first N, or the indices it lists (its names are
    :func:`frozen_indices`')."""
    if not freeze:
        return []
    if isinstance(freeze, int):
        if freeze >= n_layers:
            raise ConfigError(
                f"invalid value for 'freeze': {freeze}; the model has {n_layers} layers (0 to "
                f"{n_layers - 1}) and freezing all of them leaves nothing to train: use at most "
                f"freeze={n_layers - 1}"
            )
        return list(range(freeze))
    listed = [f for f in freeze if isinstance(f, int)]
    beyond = [i for i in listed if i >= n_layers]
    if beyond:
        raise ConfigError(
            f"invalid value for 'freeze': {freeze}; the model has layers 0 to {n_layers - 1}, "
            f"not {', '.join(map(str, beyond[:5]))}"
        )
    if len(set(listed)) >= n_layers:
        raise ConfigError(
            f"invalid value for 'freeze': {freeze}; it names all {n_layers} layers and leaves nothing to train"
        )
    return sorted(set(listed))


def freeze_layers(model: DetectionModel, freeze: Freeze, verbose: bool = False) -> list[int]:
    """Set ``requires_grad=False`` on every parameter of the layers ``freeze`` names in ``model`` (a
    DetectionModel, layers in ``model.model``), and on those below a name it lists; returns the indices of the
    layers it touched. Call before building the optimizer and DDP."""
    layers = model.model
    indices = frozen_indices(freeze, len(layers))
    names = [f for f in freeze if isinstance(f, str)] if isinstance(freeze, list) else []
    whole = _whole_layers(freeze, len(layers))
    for i in whole:
        layers[i].requires_grad_(False)
    for name in names:
        prefix = f"model.{name}."
        found = [p for full, p in model.named_parameters() if full.startswith(prefix)]
        if not found:
            layer = _layer_of(name)
            parts = sorted({n.split(".", 1)[0] for n, _ in layers[layer].named_parameters()})
            raise ConfigError(
                f"invalid value for 'freeze': {freeze}; {name!r} names no parameter of the model (layer {layer} "
                f"holds {', '.join(parts) or 'no parameters'}: e.g. {layer}.{parts[0] if parts else 'cv1'})"
            )
        for param in found:
            param.requires_grad_(False)
    if indices and not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"invalid value for 'freeze': {freeze}; the layers it leaves have no weights to train")
    if indices and verbose:
        from detrain.log import console

        fixed = sum(p.numel() for i in indices for p in layers[i].parameters() if not p.requires_grad)
        shown = ", ".join(([f"layers {_spans(whole)}"] if whole else []) + names)
        console.print(f"freeze: {shown} fixed ({fixed:,} parameters; their BatchNorm statistics still adapt)")
    return indices


def _spans(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2, 5'``.

    >>> _spans([0, 1, 2, 5, 7, 8])
    '0-2, 5, 7-8'
    """
    spans: list[list[int]] = []
    for i in indices:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def model_layer_count(model: str) -> int | None:
    """Layers of the architecture a ``model=`` yaml describes (None for weights: their file is not read before
    training starts); a look at the yaml only, so a bad ``freeze`` is one line before any data is prepared."""
    from detrain.engine.build import architecture, is_weights
    from detrain.nn.model import load_model_yaml

    if is_weights(model):
        return None
    d, _ = load_model_yaml(architecture(model)[0])
    parts = [d.get("backbone") or [], d.get("head") or []]
    if not all(isinstance(p, list) for p in parts):
        return None  # a malformed yaml: building it says what is wrong
    return sum(len(p) for p in parts)


def check_freeze(model: str, freeze: Freeze) -> None:
    """Raise the ConfigError training would raise for ``freeze`` on a ``model=`` yaml, before it starts."""
    if not freeze:
        return
    n_layers = model_layer_count(model)
    if n_layers:
        frozen_indices(freeze, n_layers)


def parameter_names(model: DetectionModel, indices: list[int]) -> set[str]:
    """State-dict names of the frozen parameters of layers ``indices`` (what :class:`detrain.engine.train.ema.ModelEMA`
    keeps as they are): after :func:`freeze_layers`, all of a layer frozen whole, those below a name of a layer frozen
    in part.

    >>> from detrain.nn.model import DetectionModel
    >>> model = DetectionModel(nc=2)
    >>> sorted(parameter_names(model, freeze_layers(model, [0])))
    ['model.0.bn.bias', 'model.0.bn.weight', 'model.0.conv.weight']
    >>> sorted({n.split(".")[2] for n in parameter_names(model, freeze_layers(model, ["22.cv3"]))})  # dfl: fixed anyway
    ['cv3', 'dfl']
    """
    layers = model.model
    return {f"model.{i}.{name}" for i in indices for name, p in layers[i].named_parameters() if not p.requires_grad}
