"""A model yaml checked and planned before anything is built: every field typed and bounded, every layer's channels
and strides traced, and the parameter and module counts of the model computed from formulas, all in plain Python.

A model yaml decides what the builder allocates, and it may come from a file nobody vetted (a checkpoint records
its own): widths, repeats or ``reg_max`` in the millions asked torch for 129 GB to 5.7 TB, a kernel of 10,000 for
19 GB, and wrongly typed fields ended in tracebacks deep in torch. So :func:`plan_layers` reads the yaml first and
refuses, in one :class:`~detrain.errors.ConfigError` line naming the key or layer and what is valid:

* a row that is not ``[from, repeats, module, args]`` of the right types: ``from`` a layer index (a list of them
  for Concat and a head) of a layer already built, ``repeats`` a whole number, ``module`` one detrain builds (a
  layer of :data:`MODULE_NAMES`, or as the last row a registered head: :mod:`detrain.nn.head`), ``args`` a list
  of that module's arguments, each of its type (whole numbers, True/False, a number);
* a layer wider than :data:`MAX_CHANNELS` after width scaling, more than :data:`MAX_REPEATS` repeats after depth
  scaling, a kernel above :data:`MAX_KERNEL`, a stride above :data:`MAX_CONV_STRIDE`, an upsampling factor above
  :data:`MAX_UPSAMPLE`, ``nc`` outside 1 to :data:`MAX_CLASSES`, ``reg_max`` outside 1 to 64, depth and width
  multiples that are not finite numbers in (0, :data:`MAX_MULTIPLE`];
* a model of more than :data:`MAX_PARAMETERS` parameters or :data:`MAX_MODULES` modules, as counted from the plan
  (exactly what the builder then makes: ``tests/unit/test_model_yaml_bounds.py`` compares both counts for every
  packaged and Ultralytics detect yaml at every scale).

The head's cost is counted from the head itself, built on the meta device from its planned row (shapes only:
nothing is allocated), so any registered head is counted exactly as the builder then makes it; the head's own
refusal of a row (:meth:`detrain.nn.head.Head.from_row`) is the layer's one line.

The bounds sit far above the detectors detrain builds: YOLOv8x has 68 million parameters in 461 modules, at most
640 channels in a block (1,280 where a Concat joins two) and 6 repeats; Ultralytics' YOLO26-P6 x, the largest
detect yaml detrain builds, 88 million parameters in 1,141 modules. The bounds cost nothing to check (no model is
built to count) and stop a model before a byte of it is allocated; whatever a model within them still needs (its
activations grow with ``imgsz`` and the batch) the user's own settings decide.

>>> plan = plan_layers({"backbone": [[-1, 1, "Conv", [16, 3, 2]]], "head": [[[0], 1, "Detect", ["nc"]]]}, "n", 2)
>>> [(layer.name, layer.c_out, layer.stride) for layer in plan.layers], plan.params
([('Conv', 16, 2.0), ('Detect', 0, 0.0)], 55682)
>>> plan_layers({"backbone": [[-1, 1, "Conv", [10**6, 3, 2]]], "head": [[[0], 1, "Detect", [2]]]}, "n", 2)
Traceback (most recent call last):
...
detrain.errors.ConfigError: model layer 0 (Conv [1000000, 3, 2]) cannot be built: 1000000 output channels; ...
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import torch

from detrain.errors import ConfigError
from detrain.nn.head import HeadRow, head_class, registered_heads

# the built-in heads: registered where they are defined; imported so that every plan knows them
from detrain.nn.head_e2e import DetectE2E
from detrain.nn.modules import Detect
from detrain.system.text import excerpt, listed

# Bounds on what a yaml may ask for (see the module docstring for the largest values real detectors use).
MAX_LAYERS = 256
MAX_REPEATS = 32
MAX_CHANNELS = 8192  # any layer's output, after width scaling (YOLOv8x: 640, YOLO26x: 768)
MAX_KERNEL = 31
MAX_CONV_STRIDE = 8
MAX_UPSAMPLE = 8
MAX_INPUTS = 16  # layers one Concat or Detect reads
MAX_CLASSES = 100_000
MAX_REG_MAX = 64
MAX_MULTIPLE = 16.0  # depth and width multiples (the largest real ones: 1.0 and 1.5)
MAX_HEAD_STRIDE = 4096  # a Detect level's stride (P6 models: 64)
MAX_PARAMETERS = 1_000_000_000  # 4 GB of float32 weights, 15x YOLOv8x
MAX_MODULES = 10_000  # torch modules made (YOLOv8x: 461, YOLO26x: 848, YOLO26-P6 x: 1141); build time: seconds

MODULE_NAMES = ("Conv", "C2f", "C3k2", "C2PSA", "SPPF", "Upsample", "nn.Upsample", "Concat")  # the layers (heads apart)
_REPEATED = frozenset({"C2f", "C3k2", "C2PSA"})  # the modules that take ``repeats``; the others are built once
_MOST_ARGS = {"Conv": 3, "C2f": 2, "C3k2": 4, "C2PSA": 1, "SPPF": 4, "Concat": 1, "Upsample": 3, "nn.Upsample": 3}
UPSAMPLE_MODES = ("nearest", "nearest-exact", "bilinear", "bicubic", "area")


class LayerRefused(ValueError):
    """A layer row the builder cannot build; the reason is one short line (the caller names the layer)."""


@dataclass(frozen=True)
class Cost:
    """Parameters and torch modules of a part of the model, as the builder will make it."""

    params: int = 0
    modules: int = 0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.params + other.params, self.modules + other.modules)

    def __mul__(self, times: int) -> Cost:
        return Cost(self.params * times, self.modules * times)


@dataclass(frozen=True)
class LayerPlan:
    """One checked layer: its row as written (``froms``, ``name``, ``args`` with ``nc`` filled in), its repeats
    after depth scaling, the channels and strides of its inputs and output, and the module's own ``options``."""

    index: int
    froms: int | list[int]
    name: str
    args: list[Any]
    repeats: int
    inputs: list[tuple[int, float]]  # (channels, stride) of each layer it reads
    c_out: int
    stride: float
    options: tuple[Any, ...] = ()
    cost: Cost = Cost()


@dataclass
class Plan:
    """The whole model as the builder will make it (see :func:`plan_layers`)."""

    layers: list[LayerPlan] = field(default_factory=list)
    save: set[int] = field(default_factory=set)
    head: type | None = None  # the head class the last row builds (detrain.nn.head's registry)
    head_strides: list[float] = field(default_factory=list)
    reg_max: int = 16
    end2end: bool = False
    depthwise_cls: bool = False
    cls_channels: int | None = None
    params: int = 0
    modules: int = 0


def whole(value: Any) -> bool:
    """A true whole number (an ``int``, not a bool: ``True`` is no layer count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def number(value: Any) -> bool:
    """A finite real number (``int`` or ``float``, not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def where(source: str) -> str:
    """How a message names the yaml: ``model yaml custom.yaml``, or ``model yaml`` for a dict."""
    return f"model yaml {source}" if source else "model yaml"


def check_nc(value: Any, what: str) -> int:
    """``value`` as a class count (a whole number from 1 to :data:`MAX_CLASSES`), else a one-line ConfigError
    that starts with ``what`` (``nc`` or ``model yaml x.yaml: nc``).

    >>> check_nc(80, "nc"), check_nc(2, "nc")
    (80, 2)
    >>> check_nc("x", "nc")
    Traceback (most recent call last):
    ...
    detrain.errors.ConfigError: nc must be a whole number from 1 to 100000, got 'x'
    """
    count = int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else 0
    if not 1 <= count <= MAX_CLASSES:
        raise ConfigError(f"{what} must be a whole number from 1 to {MAX_CLASSES}, got {excerpt(value, 40)}")
    return count


def scale_multiples(d: dict, scale: str, source: str = "") -> tuple[float, float, float]:
    """(depth multiple, width multiple, channel cap) of ``scale``: from ``scales`` (every entry checked), else the
    single-scale ``depth_multiple``/``width_multiple`` of older YOLOv8 checkpoints (no cap)."""
    scales = d.get("scales")
    if scales:
        if not isinstance(scales, dict) or len(scales) > 64:
            raise ConfigError(f"{where(source)}: 'scales' must map scale names to [depth, width, max_channels]")
        for name, multiples in scales.items():
            _check_multiples(name, multiples, source)
        if scale not in scales:
            raise ConfigError(f"{_at(source)}model scale {excerpt(scale)} is not one of {listed(scales, 80)}")
        depth, width, max_channels = scales[scale]
        return float(depth), float(width), float(max_channels)
    multiples = d.get("depth_multiple", 1.0), d.get("width_multiple", 1.0)
    if not all(number(v) and 0 < v <= MAX_MULTIPLE for v in multiples):
        raise ConfigError(
            f"{where(source)}: depth_multiple and width_multiple must be positive numbers up to {MAX_MULTIPLE:g}: "
            f"{excerpt(multiples, 60)}"
        )
    return float(multiples[0]), float(multiples[1]), math.inf


def _at(source: str) -> str:
    """A message's opening that names the yaml file, if there is one (a dict's caller names it)."""
    return f"model yaml {source}: " if source else ""


def _check_multiples(name: Any, multiples: Any, source: str) -> None:
    if not (
        isinstance(name, str)
        and isinstance(multiples, (list, tuple))
        and len(multiples) == 3
        and all(number(v) and v > 0 for v in multiples)
    ):
        raise ConfigError(
            f"{_at(source)}model scale {excerpt(name, 40, quote=False)}: expected [depth, width, max_channels] "
            f"(3 positive numbers), got {excerpt(multiples, 80)}"
        )
    if not (multiples[0] <= MAX_MULTIPLE and multiples[1] <= MAX_MULTIPLE):
        raise ConfigError(
            f"{_at(source)}model scale {name}: depth and width multiples of {excerpt(list(multiples[:2]), 60)}; "
            f"detrain builds multiples up to {MAX_MULTIPLE:g} (the largest YOLO scales use 1.0 and 1.5)"
        )


# Top-level yaml keys that change what Ultralytics builds in ways this builder does not follow: refused, never
# ignored (ignoring them would build another network under the same weight names).
_UNSUPPORTED_KEYS = {
    "activation": "a custom activation for every Conv",
}


def top_level(d: dict, source: str = "") -> tuple[int, bool, int | None]:
    """The yaml's head settings, checked: (``reg_max``, ``end2end``, ``head_cls_channels``); and ``nc`` when set;
    a key whose setting detrain does not build is refused."""
    for key, what in _UNSUPPORTED_KEYS.items():
        if d.get(key):
            raise ConfigError(
                f"{where(source)} sets {key}: {excerpt(d[key], 40)} ({what}), which detrain does not build"
            )
    reg_max = d.get("reg_max", 16)
    if not whole(reg_max) or not 1 <= reg_max <= MAX_REG_MAX:
        raise ConfigError(
            f"{where(source)}: reg_max must be a whole number of DFL bins (1 to {MAX_REG_MAX}), "
            f"got {excerpt(reg_max, 40)}"
        )
    end2end = d.get("end2end")
    if end2end is not None and not isinstance(end2end, bool):
        raise ConfigError(f"{where(source)}: end2end must be True or False, got {excerpt(end2end, 40)}")
    cls_channels = d.get("head_cls_channels")
    if cls_channels is not None and (not whole(cls_channels) or not 1 <= cls_channels <= MAX_CHANNELS):
        raise ConfigError(
            f"{where(source)}: head_cls_channels must be a whole number from 1 to {MAX_CHANNELS}, "
            f"got {excerpt(cls_channels, 40)}"
        )
    if d.get("nc") is not None:
        check_nc(d["nc"], f"{where(source)}: nc")
    return reg_max, bool(end2end), cls_channels


def layer_rows(d: dict, source: str = "") -> list[Any]:
    """The rows of ``backbone`` then ``head``: lists, at least one row, at most :data:`MAX_LAYERS`."""
    parts = d.get("backbone", []), d.get("head", [])
    if not all(isinstance(part, list) for part in parts):
        raise ConfigError(f"{where(source)}: 'backbone' and 'head' must be lists of layers")
    specs = list(parts[0]) + list(parts[1])
    if not specs:
        raise ConfigError(f"{where(source)} has no 'backbone'/'head' layers")
    if len(specs) > MAX_LAYERS:
        raise ConfigError(f"{where(source)} has {len(specs)} layers; detrain builds at most {MAX_LAYERS}")
    return specs


def plan_layers(d: dict, scale: str, nc: int, in_channels: int = 3, source: str = "") -> Plan:
    """Check ``d`` (a model yaml dict) at ``scale`` with ``nc`` classes and plan every layer, allocating nothing;
    a one-line ConfigError for the first thing the builder cannot build or that exceeds a bound (module docstring).
    ``source`` names the yaml in messages (empty for a dict: the caller names it)."""
    reg_max, end2end, cls_channels = top_level(d, source)
    depth, width, max_channels = scale_multiples(d, scale, source)
    specs = layer_rows(d, source)
    plan = Plan(reg_max=reg_max, end2end=end2end, cls_channels=cls_channels)
    plan.depthwise_cls = any(isinstance(s, (list, tuple)) and len(s) == 4 and s[2] == "C3k2" for s in specs)
    context = _Context(plan, nc, in_channels, scale, depth, width, max_channels, len(specs) - 1)
    for i, spec in enumerate(specs):
        layer = context.layer(i, spec, source)
        plan.layers.append(layer)
        plan.params += layer.cost.params
        plan.modules += layer.cost.modules
    if plan.head is None:
        raise ConfigError(
            f"{_at(source)}the last model layer must be Detect or another head ({listed(registered_heads(), 80)})"
        )
    plan.modules += 2  # the model and its Sequential of layers
    if plan.params > MAX_PARAMETERS or plan.modules > MAX_MODULES:
        raise ConfigError(
            f"{where(source)} at scale {scale} describes a model of {plan.params:,} parameters in {plan.modules:,} "
            f"modules; detrain builds at most {MAX_PARAMETERS:,} parameters and {MAX_MODULES:,} modules "
            f"(YOLOv8x: 68 million parameters)"
        )
    return plan


@dataclass
class _Context:
    """What planning a layer reads of the layers before it and of the yaml's settings."""

    plan: Plan
    nc: int
    in_channels: int
    scale: str
    depth: float
    width: float
    max_channels: float
    last: int  # the index of the last row, the only one that may be Detect

    def layer(self, i: int, spec: Any, source: str) -> LayerPlan:
        if not isinstance(spec, (list, tuple)) or len(spec) != 4:
            raise ConfigError(f"{_layer(i, source)} must be [from, repeats, module, args], got {excerpt(spec, 80)}")
        f, n, name, args = spec
        if not isinstance(name, str) or (name not in MODULE_NAMES and self._head_class(name) is None):
            raise ConfigError(f"{_layer(i, source)}: unknown module {excerpt(name, 60)}; known: {_known()}")
        args = [self.nc if a == "nc" else a for a in args] if isinstance(args, list) else args
        try:
            if args is None:
                args = []
            if not isinstance(args, list):
                raise LayerRefused(f"args must be a list, got {excerpt(args, 40)}")
            layer = self._planned(i, f, n, name, args)
        except LayerRefused as e:
            raise ConfigError(
                f"{_layer(i, source)} ({name} {excerpt(args, 60)}) cannot be built: {excerpt(str(e), 200, quote=False)}"
            ) from None
        return layer

    def _head_class(self, name: str) -> type | None:
        """The registered head a row's module name builds (:func:`head_name`), else None (a layer, or nothing)."""
        return None if name in MODULE_NAMES else head_class(head_name(name, self.plan.end2end))

    def _planned(self, i: int, f: Any, n: Any, name: str, args: list[Any]) -> LayerPlan:
        head = self._head_class(name)
        repeats = _repeats(n, self.depth, name)
        froms = _froms(i, f, multiple=name == "Concat" or head is not None)
        _check_arg_types(args, _MOST_ARGS.get(name, 4), name)
        for j in froms:
            if j != -1:
                self.plan.save.add(i + j if j < 0 else j)
        inputs = [self._source(i, j) for j in froms]
        if head is not None:
            if i != self.last:
                raise LayerRefused(f"{name} must be the last layer")
            return self._head(i, f, name, head, args, inputs)
        c_in, s_in = inputs[0]
        if name in ("Upsample", "nn.Upsample"):
            factor, mode = _upsample_options(args)
            return LayerPlan(i, f, name, args, repeats, inputs, c_in, s_in / factor, (factor, mode), Cost(0, 1))
        if name == "Concat":
            return self._concat(i, f, args, inputs, repeats)
        c_out = self._channels(args)
        options, stride, cost = _block(name, c_in, c_out, repeats, args, self.scale)
        return LayerPlan(i, f, name, args, repeats, inputs, c_out, s_in * stride, options, cost)

    def _source(self, i: int, j: int) -> tuple[int, float]:
        k = i + j if j < 0 else j
        if k < 0:
            return self.in_channels, 1.0
        layer = self.plan.layers[k]
        if self._head_class(layer.name) is not None:
            raise LayerRefused(f"it reads layer {j}, a {layer.name} layer, which has no feature map")
        return layer.c_out, layer.stride

    def _channels(self, args: list[Any]) -> int:
        """A block's output channels: its first argument, capped by the scale's channel cap, times its width."""
        if not args or not whole(args[0]) or args[0] < 1:
            raise LayerRefused(f"its first argument (output channels) must be a whole number >= 1, got {_arg(args)}")
        c_out = _make_divisible(min(args[0], self.max_channels) * self.width)
        if c_out > MAX_CHANNELS:
            raise LayerRefused(
                f"{c_out} output channels{_at_width(self.width)}; detrain builds at most {MAX_CHANNELS} per layer"
            )
        return c_out

    def _concat(self, i: int, f: Any, args: list[Any], inputs: list[tuple[int, float]], repeats: int) -> LayerPlan:
        dim = args[0] if args else 1
        if not whole(dim) or dim != 1:
            raise LayerRefused(f"Concat joins channels (dimension 1), not dimension {excerpt(dim, 20)}")
        if len({s for _, s in inputs}) != 1:
            raise LayerRefused(f"Concat inputs {f} have different strides")
        c_out = sum(c for c, _ in inputs)
        if c_out > MAX_CHANNELS:
            raise LayerRefused(f"{c_out} output channels; detrain builds at most {MAX_CHANNELS} per layer")
        return LayerPlan(i, f, "Concat", args, repeats, inputs, c_out, inputs[0][1], (dim,), Cost(0, 1))

    def _head(
        self, i: int, f: Any, name: str, head: Any, args: list[Any], inputs: list[tuple[int, float]]
    ) -> LayerPlan:
        """The head row: its class and :class:`HeadRow` as the layer's options; its cost counted from the head
        built on the meta device (nothing allocated), its own refusal of the row the layer's reason."""
        plan = self.plan
        strides = [s for _, s in inputs]
        if not all(1.0 <= s <= MAX_HEAD_STRIDE for s in strides):
            raise LayerRefused(f"it reads maps of strides {excerpt(strides, 60)}; a head reads 1 to {MAX_HEAD_STRIDE}")
        if plan.end2end and head is not DetectE2E:
            raise LayerRefused(
                f"the yaml sets end2end (Ultralytics' flag for YOLO26's Detect), which {name} does not take"
            )
        channels = tuple(c for c, _ in inputs)
        row = HeadRow(
            self.nc, channels, tuple(strides), tuple(args), plan.reg_max, plan.cls_channels, plan.depthwise_cls
        )
        try:
            with torch.device("meta"):
                built = head.from_row(row)
        except LayerRefused:
            raise
        except ValueError as e:  # the head's own refusal of this row: one line
            raise LayerRefused(str(e)) from None
        except (TypeError, IndexError, KeyError, ArithmeticError, RuntimeError) as e:
            raise LayerRefused(f"{name} cannot be built from this row: {excerpt(str(e), 160, quote=False)}") from None
        plan.head, plan.head_strides = head, strides
        cost = Cost(sum(p.numel() for p in built.parameters()), len(list(built.modules())))
        return LayerPlan(i, f, name, args, 1, inputs, 0, 0.0, (head, row), cost)


def head_name(name: str, end2end: bool) -> str:
    """The registered head a last row's module name builds: the name itself, except that Ultralytics' YOLO26 yamls
    write their end-to-end head as ``Detect`` under the yaml's ``end2end: True``, which builds ``DetectE2E``.

    >>> head_name("Detect", False), head_name("Detect", True), head_name("DetectE2E", False)
    ('Detect', 'DetectE2E', 'DetectE2E')
    """
    return DetectE2E.__name__ if end2end and name == Detect.__name__ else name


def _known() -> str:
    """The module names a row may use: the layers, and the heads registered now."""
    return ", ".join(sorted([*MODULE_NAMES, *registered_heads()]))


def _layer(i: int, source: str) -> str:
    """How a message names layer ``i``: ``model layer 3``, or ``model yaml x.yaml, layer 3``."""
    return f"model yaml {source}, layer {i}" if source else f"model layer {i}"


def _arg(args: list[Any], k: int = 0) -> str:
    return excerpt(args[k], 30) if len(args) > k else "nothing"


def _at_width(width: float) -> str:
    return f" at width multiple {width:g}" if width != 1.0 else ""


def _make_divisible(x: float, divisor: int = 8) -> int:
    return int(math.ceil(x / divisor) * divisor)


def _froms(i: int, f: Any, multiple: bool) -> list[int]:
    """The layers a row reads: a layer index (``-1``: the one before, at layer 0 the image) or, for Concat and
    Detect, a list of them; each an index of a layer already built."""
    if multiple:
        if not isinstance(f, list) or not 1 <= len(f) <= MAX_INPUTS:
            raise LayerRefused(f"'from' must be a list of 1 to {MAX_INPUTS} layer indices, got {excerpt(f, 40)}")
        froms = f
    else:
        if not whole(f):
            raise LayerRefused(f"'from' must be one layer index, got {excerpt(f, 40)}")
        froms = [f]
    for j in froms:
        lowest = -1 if i == 0 else -i
        if not whole(j) or not lowest <= j < i:
            valid = "-1 (the image)" if i == 0 else f"{-i} to {i - 1}"
            raise LayerRefused(f"it reads layer {excerpt(j, 30)}, which is not built yet (valid: {valid})")
    return froms


def _check_arg_types(args: list[Any], most: int, name: str) -> None:
    """At most ``most`` arguments, each a plain value (a number, text, True/False, None) or a flat list of them."""
    if len(args) > most:
        raise LayerRefused(f"detrain builds {name} from at most {most} arguments")
    for k, a in enumerate(args):
        if not (
            isinstance(a, _SCALARS)
            or (isinstance(a, list) and len(a) <= MAX_INPUTS and all(isinstance(v, _SCALARS) for v in a))
        ):
            raise LayerRefused(f"argument {k + 1} is {excerpt(a, 40)}, not a number, text or True/False")


_SCALARS = (int, float, str, bool, type(None))


def _repeats(n: Any, depth: float, name: str) -> int:
    """``repeats`` after depth scaling (Ultralytics' rule: a count above 1 scales, never below 1)."""
    if not whole(n):
        raise LayerRefused(f"repeats must be a whole number, got {excerpt(n, 30)}")
    if not 0 <= n <= 10**15:  # beyond, n * depth is no float
        raise LayerRefused(f"{excerpt(n, 30)} repeats; detrain builds 0 to {MAX_REPEATS}")
    scaled = max(round(n * depth), 1) if n > 1 else n
    if not 0 <= scaled <= MAX_REPEATS:
        raise LayerRefused(f"{scaled} repeats; detrain builds 0 to {MAX_REPEATS}")
    if scaled > 1 and name not in _REPEATED:
        raise LayerRefused(f"{scaled} repeats of {name}; detrain builds it once (repeats 1)")
    return scaled


def _flag(args: list[Any], k: int, what: str, default: bool) -> bool:
    if len(args) <= k:
        return default
    if not isinstance(args[k], bool):
        raise LayerRefused(f"argument {k + 1} ({what}) must be True or False, got {excerpt(args[k], 30)}")
    return args[k]


def _whole_arg(args: list[Any], k: int, what: str, default: int, low: int, high: int) -> int:
    if len(args) <= k:
        return default
    if not whole(args[k]) or not low <= args[k] <= high:
        raise LayerRefused(
            f"argument {k + 1} ({what}) must be a whole number from {low} to {high}, got {excerpt(args[k], 30)}"
        )
    return int(args[k])


def _upsample_options(args: list[Any]) -> tuple[float, str]:
    """(scale factor, mode) of ``[factor, mode]`` or YOLOv8's ``[None, factor, mode]``."""
    if args and args[0] in (None, "None"):
        args = args[1:]
    if len(args) > 2:
        raise LayerRefused("detrain builds Upsample from [size=None, scale_factor, mode]")
    factor = args[0] if args else 2.0
    if not number(factor) or not 1 <= factor <= MAX_UPSAMPLE:
        raise LayerRefused(f"the scale factor must be a number from 1 to {MAX_UPSAMPLE}, got {excerpt(factor, 30)}")
    mode = args[1] if len(args) > 1 else "nearest"
    if mode not in UPSAMPLE_MODES:
        raise LayerRefused(f"the mode must be one of {', '.join(UPSAMPLE_MODES)}, got {excerpt(mode, 30)}")
    return float(factor), str(mode)


def _block(name: str, c_in: int, c_out: int, n: int, args: list[Any], scale: str) -> tuple[tuple, int, Cost]:
    """A Conv, C2f, C3k2, C2PSA or SPPF row -> (the module's options, its stride, its cost)."""
    if name == "Conv":
        k = _whole_arg(args, 1, "kernel", 1, 1, MAX_KERNEL)
        s = _whole_arg(args, 2, "stride", 1, 1, MAX_CONV_STRIDE)
        return (k, s), s, conv_cost(c_in, c_out, k)
    if name == "C2f":
        shortcut = _flag(args, 1, "shortcut", False)
        return (shortcut,), 1, c2f_cost(c_in, c_out, n, lambda c: bottleneck_cost(c, c, 1.0))
    if name == "C3k2":
        c3k = scale in ("m", "l", "x") or _flag(args, 1, "c3k", False)
        e = args[2] if len(args) > 2 else 0.5
        if not number(e) or not 0 < e <= 1 or int(c_out * e) < 1:
            raise LayerRefused(f"argument 3 (expansion) must be a number in (0, 1], got {excerpt(e, 30)}")
        attn = _flag(args, 3, "attention", False)
        return (c3k, float(e), attn), 1, c2f_cost(c_in, c_out, n, _c3k2_block(c3k, attn), float(e))
    if name == "C2PSA":
        if c_in != c_out:
            raise LayerRefused(f"C2PSA keeps its width, but it reads {c_in} channels and would write {c_out}")
        return (), 1, c2psa_cost(c_in, n)
    k = _whole_arg(args, 1, "kernel", 5, 1, MAX_KERNEL)
    if len(args) > 2 and whole(args[2]) and not 1 <= args[2] <= MAX_REPEATS:
        raise LayerRefused(f"{args[2]} pooling steps; detrain builds 1 to {MAX_REPEATS}")
    pools = _whole_arg(args, 2, "pooling steps", 3, 1, MAX_REPEATS)
    shortcut = _flag(args, 3, "shortcut", False)
    return (k, pools, shortcut, len(args) <= 2), 1, sppf_cost(c_in, c_out, pools)


# ---------------------------------------------------------------------------------------------------------------
# What each layer costs, from the same widths its constructor computes (detrain/nn/modules.py, blocks11.py; a head
# is counted from itself, built on the meta device); tests/unit/test_model_yaml_bounds.py checks these against the
# built models.
# ---------------------------------------------------------------------------------------------------------------


def conv_cost(c1: int, c2: int, k: int = 1, g: int = 1) -> Cost:
    """A Conv (Conv2d without bias, BatchNorm, activation): 4 modules."""
    if c1 < 1 or c2 < 1:
        raise LayerRefused(f"it would make a convolution of {c1} -> {c2} channels")
    return Cost(c2 * (c1 // g) * k * k + 2 * c2, 4)


def bottleneck_cost(c1: int, c2: int, e: float) -> Cost:
    hidden = int(c2 * e)
    return Cost(0, 1) + conv_cost(c1, hidden, 3) + conv_cost(hidden, c2, 3)


def c2f_cost(c1: int, c2: int, n: int, block: Any, e: float = 0.5) -> Cost:
    """C2f's wiring (and C3k2's): two 1x1 Convs around ``n`` inner blocks on ``int(c2 * e)`` channels."""
    c = int(c2 * e)
    return Cost(0, 2) + conv_cost(c1, 2 * c, 1) + conv_cost((2 + n) * c, c2, 1) + block(c) * n


def _c3k2_block(c3k: bool, attn: bool) -> Any:
    def block(c: int) -> Cost:
        if attn:
            return Cost(0, 1) + bottleneck_cost(c, c, 0.5) + psa_block_cost(c, max(c // 64, 1))
        if c3k:  # C3k(c, c, 2): two 1x1 Convs on half the width, two full-width Bottlenecks, a 1x1 Conv
            h = int(c * 0.5)
            return Cost(0, 2) + conv_cost(c, h) * 2 + conv_cost(2 * h, c) + bottleneck_cost(h, h, 1.0) * 2
        return bottleneck_cost(c, c, 0.5)

    return block


def psa_block_cost(c: int, heads: int) -> Cost:
    """PSABlock: Attention (qkv, proj, depthwise pe) and a 2x feed-forward."""
    head_dim = c // heads
    key_dim = int(head_dim * 0.5)
    if key_dim < 1 or head_dim * heads != c:
        raise LayerRefused(f"attention over {c} channels in {heads} heads: the channels must split evenly, >= 2 each")
    qkv = c + 2 * key_dim * heads
    attention = Cost(0, 1) + conv_cost(c, qkv) + conv_cost(c, c) + conv_cost(c, c, 3, g=c)
    return Cost(0, 2) + attention + conv_cost(c, 2 * c) + conv_cost(2 * c, c)


def c2psa_cost(c1: int, n: int) -> Cost:
    c = int(c1 * 0.5)
    return Cost(0, 2) + conv_cost(c1, 2 * c) + conv_cost(2 * c, c1) + psa_block_cost(c, max(c // 64, 1)) * n


def sppf_cost(c1: int, c2: int, pools: int) -> Cost:
    hidden = c1 // 2
    return Cost(0, 2) + conv_cost(c1, hidden) + conv_cost(hidden * (pools + 1), c2)
