"""DetectionModel: a YOLOv8-, YOLO11- or YOLO26-class detector built from a model yaml at a scale (n/s/m/l/x).

The layers live in ``self.model`` (an ``nn.Sequential`` indexed as in the yaml), so state-dict keys are
``model.<i>.…`` exactly as in Ultralytics' checkpoints. The yaml format is Ultralytics' (the packaged
``cfg/models/yolov8.yaml``, ``yolo11.yaml`` and ``yolo26.yaml``, or the dict a checkpoint records), read by our
own builder. The last row's module name picks the head from the registry of :mod:`detrain.nn.head` (``Detect``;
``DetectE2E``, which Ultralytics' YOLO26 yamls write as ``Detect`` under ``end2end: True``; or a head a user
registered), and the model reaches it only through that seam.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from detrain.errors import ConfigError
from detrain.nn.blocks11 import C2PSA, C3k2
from detrain.nn.head import Criterion, Head, InferenceOptions, head_class, head_gains
from detrain.nn.modules import BN_EPS, BN_MOMENTUM, SPPF, C2f, Concat, Conv, Upsample
from detrain.nn.yaml_plan import MAX_CLASSES, LayerPlan, Plan, check_nc, head_name, plan_layers, where
from detrain.nn.yaml_plan import MAX_LAYERS as MAX_LAYERS  # re-exported: the builder's bounds
from detrain.nn.yaml_plan import MAX_REPEATS as MAX_REPEATS
from detrain.system.assets import asset_dir
from detrain.system.safe_yaml import YamlRefused, read_yaml
from detrain.system.text import excerpt, listed, name_problem, shown

DEFAULT_SCALE = "n"
DEFAULT_NC = 80
SCALES = ("n", "s", "m", "l", "x")
ARCHITECTURE = "yolov8.yaml"  # the packaged default architecture; DetectionModel() builds it at DEFAULT_SCALE
FAMILIES = ("yolov8", "yolo11", "yolo26")  # the packaged architectures: cfg/models/<family>.yaml
# The bundled scale names, and the only file names whose last letter means a scale: n.yaml ... x.yaml,
# yolov8n.yaml ... yolov8x.yaml, yolo11n.yaml ... yolo11x.yaml and yolo26n.yaml ... yolo26x.yaml. A letter at
# the end of any other name means nothing (model.yaml is not L).
_BUNDLED_SCALE_NAME = re.compile(r"^(?P<family>yolov8|yolo11|yolo26)?(?P<scale>[nsmlx])\.ya?ml$")
# The blocks that make a yaml YOLO11's rather than YOLOv8's (both share Conv, SPPF, Concat, Upsample, Detect).
_YOLO11_BLOCKS = frozenset({"C3k2", "C2PSA"})


def _packaged_models_dir() -> Path:
    return asset_dir("cfg/models")


def is_packaged_name(name: str) -> bool:
    """Whether ``name`` is a packaged architecture's name (a family and scale such as ``yolo11s.yaml``, ``n.yaml``,
    or a family such as ``yolo26.yaml``), never a path.

    >>> is_packaged_name("yolo26n.yaml"), is_packaged_name("yolov8.yaml"), is_packaged_name("../../etc/x.yaml")
    (True, True, False)
    """
    return bool(_BUNDLED_SCALE_NAME.match(name)) or name in {f"{family}.yaml" for family in FAMILIES}


def packaged_architecture(name: str | Path = "") -> Path:
    """The packaged architecture yaml a bundled name builds (a file of the same name in the working directory
    does not stand in for it): ``yolo11n.yaml`` -> ``yolo11.yaml``, ``yolo26n.yaml`` -> ``yolo26.yaml``;
    ``n.yaml``, ``yolov8s.yaml`` or no name -> ``yolov8.yaml``.

    >>> packaged_architecture("yolo11s.yaml").name, packaged_architecture("yolo26x.yaml").name
    ('yolo11.yaml', 'yolo26.yaml')
    >>> packaged_architecture().name
    'yolov8.yaml'
    """
    match = _BUNDLED_SCALE_NAME.match(Path(name).name)
    family = match["family"] if match and match["family"] else FAMILIES[0]
    return _packaged_models_dir() / f"{family}.yaml"


def bundled_scale(name: str | Path) -> str | None:
    """The scale a bundled model name implies, else None: only the file name counts, wherever it lies.

    >>> bundled_scale("yolov8s.yaml"), bundled_scale("configs/m.yaml"), bundled_scale("yolo11x.yaml")
    ('s', 'm', 'x')
    >>> bundled_scale("model.yaml")
    """
    match = _BUNDLED_SCALE_NAME.match(Path(name).name)
    return match["scale"] if match else None


def family(d: dict) -> str:
    """The family of an architecture dict: the one its head names (``"yolo26"`` for the end-to-end head); else
    ``"yolo11"`` when it uses YOLO11's blocks (C3k2, C2PSA), which YOLO26 shares; else ``"yolov8"``. Layers of two
    families do not correspond, even where a key and shape happen to agree.

    >>> family(load_model_yaml("yolo11n.yaml")[0]), family(load_model_yaml("n.yaml")[0])
    ('yolo11', 'yolov8')
    >>> family(load_model_yaml("yolo26s.yaml")[0])
    'yolo26'
    """
    specs = list(d.get("backbone") or []) + list(d.get("head") or [])
    names = [
        spec[2] for spec in specs if isinstance(spec, (list, tuple)) and len(spec) == 4 and isinstance(spec[2], str)
    ]
    head = head_class(head_name(names[-1], d.get("end2end") is True)) if names else None
    own = getattr(head, "family", None)
    if isinstance(own, str):
        return own
    return "yolo11" if set(names) & _YOLO11_BLOCKS else "yolov8"


def _own_scale(d: dict, source: str) -> str | None:
    """The scale a yaml names itself (``scale: s``), checked against its ``scales``; None when it names none."""
    scales = d.get("scales")
    if scales is not None and not (isinstance(scales, dict) and scales):
        raise ConfigError(
            f"model yaml {source}: 'scales' must map scale names to [depth, width, max_channels], "
            f"got {excerpt(scales, 80)}"
        )
    scale = d.get("scale")
    if scale is None or scale == "":
        return None
    if not isinstance(scale, str) or (scales and scale not in scales):
        valid = listed(scales, 80) if scales else "a scale name such as n"
        raise ConfigError(f"model yaml {source}: scale {excerpt(scale, 40)} is not one of {valid}")
    return scale


def load_model_yaml(cfg: str | Path | dict) -> tuple[dict, str | None]:
    """Read a model yaml (a packaged name, a path, or a dict) -> (a deep copy of the dict, the scale it names).

    The scale named is the yaml's own ``scale:``, else the one a bundled name implies (:func:`bundled_scale`),
    else None. A bundled name that is not a file (``yolov8s.yaml``, ``s.yaml``, ``yolo11m.yaml``) resolves to
    its packaged architecture; the packaged ``yolov8.yaml``, ``yolo11.yaml`` and ``yolo26.yaml`` themselves name
    DEFAULT_SCALE.
    A yaml whose ``scale:`` differs from the scale its name implies is a ConfigError: nothing says which of the
    two the user meant.

    >>> d, scale = load_model_yaml("yolov8m.yaml"); scale, len(d["backbone"])
    ('m', 10)
    """
    if isinstance(cfg, dict):
        data = copy.deepcopy(cfg)
        return data, _own_scale(data, "(a dict)")
    path = Path(cfg)
    named = bundled_scale(path)
    if path.is_file():
        found: Path | None = path
    elif (_packaged_models_dir() / path.name).is_file():
        found = _packaged_models_dir() / path.name
        if path.name in {f"{f}.yaml" for f in FAMILIES}:
            named = DEFAULT_SCALE
    else:
        found = packaged_architecture(path) if named is not None else None
    if found is None:
        known = sorted(p.name for p in _packaged_models_dir().glob("*.yaml"))
        raise ConfigError(f"model yaml {str(cfg)!r} not found; packaged models: {', '.join(known) or 'none'}")
    try:
        data = read_yaml(found)
    except (YamlRefused, OSError) as e:
        raise ConfigError(f"model yaml {shown(str(found))}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model yaml {found} is not a mapping")
    own = _own_scale(data, str(found))
    if own is not None and named is not None and own != named:
        raise ConfigError(
            f"model yaml {found} says 'scale: {own}' but its name {path.name} means scale {named}: "
            f"rename the file (e.g. custom.yaml) to build {own}, or make that line 'scale: {named}'"
        )
    return data, own or named


def choose_scale(d: dict, scale: str | None, source: str) -> str:
    """The scale to build ``d`` at: ``scale`` (the caller's, else the one the yaml names) checked against the
    yaml's ``scales``. A yaml that defines several scales and names none is a ConfigError listing them:
    building one of them silently could train a model twenty times the size the user meant (x for n), or a
    twentieth of it.
    A single-scale yaml (depth/width multiples) builds the same whatever the letter, which is then a label.

    >>> choose_scale({"scales": {"n": [0.33, 0.25, 1024]}}, None, "custom.yaml")
    Traceback (most recent call last):
    ...
    detrain.errors.ConfigError: model yaml custom.yaml defines scales n but names none: add a line such as ...
    """
    scales = d.get("scales")
    if scale is None:
        if scales:
            raise ConfigError(
                f"model yaml {source} defines scales {listed(scales, 80)} but names none: "
                f"add a line such as 'scale: {excerpt(next(iter(scales)), quote=False)}' to it"
            )
        return DEFAULT_SCALE
    if not isinstance(scale, str) or (scales and scale not in scales):
        raise ConfigError(
            f"model scale {excerpt(scale, 40)} is not one of {listed(scales or SCALES, 80)}"
            + (f" (the scales of {source})" if scales else "")
        )
    return scale


def build_layers(
    d: dict, scale: str, nc: int, in_channels: int = 3, source: str = ""
) -> tuple[nn.Sequential, set[int], list[float]]:
    """Turn the yaml's backbone + head into layers -> (Sequential, indices whose output is reused, strides).

    The yaml is first checked and planned by :func:`detrain.nn.yaml_plan.plan_layers` (every field typed and
    bounded, the parameter count computed), so nothing is allocated for a yaml that asks too much; ``source``
    names the yaml in its one-line errors. Strides are traced through the layers rather than measured with a dummy
    forward, so building even the x scale costs no compute. The head is the registered class the last row names,
    built from its planned row (:meth:`detrain.nn.head.Head.from_row`). Rules that follow Ultralytics so its
    YOLO11 and YOLO26 yamls and checkpoints build the same: a C3k2 uses C3k inner blocks at scales m, l and x
    whatever its own flag says (its attention flag still wins), a yaml with any C3k2 gets the head's depthwise
    class branch, and a ``Detect`` row in a yaml that sets ``end2end`` builds the end-to-end head (``DetectE2E``;
    reg_max 1 and the depthwise class branch are the only form detrain builds).

    >>> d, _ = load_model_yaml("yolov8.yaml")
    >>> layers, save, strides = build_layers(d, "n", 80); len(layers), strides
    (23, [8.0, 16.0, 32.0])
    """
    plan = plan_layers(d, scale, nc, in_channels, source)
    layers: list[nn.Module] = []
    for spec in plan.layers:
        try:
            layer = _module(spec, plan, nc)
        # a backstop: the plan checked every value, so torch should never refuse one (RuntimeError: a size)
        except (TypeError, ValueError, IndexError, KeyError, ArithmeticError, RuntimeError) as e:
            at = f"{where(source)}, layer" if source else "model layer"
            raise ConfigError(
                f"{at} {spec.index} ({spec.name} {excerpt(spec.args, 60)}) cannot be built: "
                f"{excerpt(str(e), 160, quote=False)}"
            ) from None
        layer.f, layer.i, layer.type = spec.froms, spec.index, spec.name  # type: ignore[assignment]
        layers.append(layer)
    return nn.Sequential(*layers), plan.save, plan.head_strides


def check_architecture(d: dict, scale: str, source: str = "", nc: int | None = None) -> Plan:
    """Check the model yaml ``d`` at ``scale`` as :func:`build_layers` would, building nothing (a command calls it
    before any process starts): ``nc`` defaults to the yaml's own, else :data:`DEFAULT_NC`.

    >>> check_architecture(load_model_yaml("yolov8.yaml")[0], "n").params
    3157200
    """
    if nc is None:
        nc = check_nc(d.get("nc", DEFAULT_NC), f"{where(source)}: nc")
    return plan_layers(d, scale, nc, source=source)


def _module(spec: LayerPlan, plan: Plan, nc: int) -> nn.Module:
    """The module of one planned layer, from the options the plan read off its row."""
    name, opts, c_out = spec.name, spec.options, spec.c_out
    c_in = spec.inputs[0][0]
    if name in ("Upsample", "nn.Upsample"):
        return Upsample(scale_factor=opts[0], mode=opts[1])
    if name == "Concat":
        return Concat(opts[0])
    if spec.index == len(plan.layers) - 1:  # the head: its registered class, from the row the plan checked
        head, row = opts
        return cast(nn.Module, head.from_row(row))
    if name == "Conv":
        return Conv(c_in, c_out, opts[0], opts[1])
    if name == "C2f":
        return C2f(c_in, c_out, spec.repeats, opts[0])
    if name == "C3k2":
        c3k, e, attn = opts
        return C3k2(c_in, c_out, spec.repeats, c3k, e, attn=attn)
    if name == "C2PSA":
        return C2PSA(c_in, c_out, spec.repeats)
    # SPPF from [channels, k] (YOLOv8, YOLO11) or [channels, k, n, shortcut] (YOLO26): as in Ultralytics 8.4, a
    # row with any argument after k builds the YOLO26 form, whose cv1 has no activation
    k, pools, shortcut, cv1_act = opts
    return SPPF(c_in, c_out, k, pools, shortcut, cv1_act=cv1_act)


def class_names(names: Any) -> dict[int, str]:
    """Class names as ``{index: name}`` with indices 0 to n-1 (whole numbers, or their digits as text); anything else
    is a one-line ConfigError naming the first bad key.

    >>> class_names({0: "cat", "1": "dog"})
    {0: 'cat', 1: 'dog'}
    >>> class_names({"cat": 0})
    Traceback (most recent call last):
    ...
    detrain.errors.ConfigError: class names must map the indices 0 to 0 to names; key 'cat' is not one
    """
    if not isinstance(names, dict) or len(names) > MAX_CLASSES:
        raise ConfigError(f"class names must be a dict of index -> name, got {excerpt(names, 60)}")
    out: dict[int, str] = {}
    for key, value in names.items():
        digits = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 6
        index = int(key) if digits else key
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(names) or index in out:
            raise ConfigError(
                f"class names must map the indices 0 to {len(names) - 1} to names; key {excerpt(key, 40)} is not one"
            )
        out[index] = value if isinstance(value, str) else str(value)
    problem = name_problem(out)
    if problem is not None:
        raise ConfigError(problem)
    return out


def initialize_weights(model: nn.Module) -> None:
    """Set every BatchNorm to YOLOv8's eps/momentum; convolutions keep PyTorch's default init.

    >>> m = nn.Sequential(nn.BatchNorm2d(4)); initialize_weights(m); m[0].eps, m[0].momentum
    (0.001, 0.03)
    """
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eps, m.momentum = BN_EPS, BN_MOMENTUM


class DetectionModel(nn.Module):
    """YOLOv8-, YOLO11- or YOLO26-class detector (:attr:`family`), or any body and registered head a yaml names.

    ``cfg`` is a packaged yaml name (``"yolov8.yaml"``, ``"yolo11.yaml"``, ``"yolo26.yaml"``, or ``"yolov8s.yaml"``,
    ``"yolo26s.yaml"`` meaning scale s), a path, or a dict (e.g. another model's ``.yaml``). ``scale`` defaults
    to the one the yaml names (its ``scale:`` key, else a bundled name's letter, ``"n"`` for the packaged
    ``yolov8.yaml`` and ``yolo11.yaml``; see :func:`load_model_yaml`);
    a yaml with several ``scales`` that names none needs ``scale``. ``nc`` defaults to ``len(names)``, else the
    yaml's ``nc``, else 80.

    Training mode returns the raw head maps [(B, 4 * reg_max + nc, H/s, W/s)] for s in 8, 16, 32 (YOLO26: both
    branches' maps, :class:`detrain.nn.loss_e2e.E2EHeadMaps`); eval mode returns the head's inference output:
    (B, 4 + nc, N) xywh boxes in input pixels and sigmoid class scores for NMS, or YOLO26's (B, 300, 6) top-k
    detections. ``decode=`` overrides the choice (e.g. raw maps for a validation loss while BN uses running
    statistics). What the engine needs of the head it asks the head itself through :attr:`head` (:class:`detrain.nn.
    head.Head`), or here: :meth:`criterion`, :attr:`loss_names`, :meth:`set_inference`, :meth:`postprocess`.

    >>> model = DetectionModel("yolov8.yaml", scale="n", nc=3).eval()
    >>> model(torch.zeros(1, 3, 64, 64)).shape
    torch.Size([1, 7, 84])
    """

    # declared so the type checker sees these attributes as what they are, not as nn.Module's Tensor | Module
    stride: Tensor  # per-level strides (a non-persistent buffer)
    model: nn.Sequential
    imgsz: int  # the training image size, set when loaded from a checkpoint

    def __init__(
        self,
        cfg: str | Path | dict = "yolov8.yaml",
        scale: str | None = None,
        nc: int | None = None,
        names: dict[int, str] | None = None,
    ) -> None:
        super().__init__()
        d, named_scale = load_model_yaml(cfg)
        source = "" if isinstance(cfg, dict) else shown(str(cfg))
        scale = choose_scale(d, scale or named_scale, source or "(a dict)")
        if names is not None:
            names = class_names(names)
            if nc is not None and nc != len(names):
                raise ConfigError(f"nc={excerpt(nc, 20)} but {len(names)} class names were given")
            nc = len(names)
        # the caller's count, else the yaml's (checked when present either way: see yaml_plan.top_level)
        nc = check_nc(nc, "nc") if nc is not None else check_nc(d.get("nc", DEFAULT_NC), f"{where(source)}: nc")
        d["nc"], d["scale"] = nc, scale
        self.model, self.save, strides = build_layers(d, scale, nc, source=source)
        self.register_buffer("stride", torch.tensor(strides, dtype=torch.float), persistent=False)
        self.yaml = d
        self.scale = scale
        self.nc = nc
        self.reg_max = int(getattr(self.head, "reg_max", 1))  # DFL bins of the box distances (1: none, plain ones)
        self.names = names or {i: str(i) for i in range(nc)}
        initialize_weights(self)

    @property
    def family(self) -> str:
        """``"yolov8"``, ``"yolo11"`` or ``"yolo26"`` (:func:`family`): ``DetectionModel("yolo11n.yaml").family``."""
        return family(self.yaml)

    @property
    def head(self) -> Head:
        """The detection head (the last layer), through which the engine reaches loss and postprocess
        (:mod:`detrain.nn.head`): ``DetectionModel().head.reg_max`` -> 16."""
        return cast(Head, self.model[-1])

    @property
    def loss_names(self) -> tuple[str, ...]:
        """The head's loss item names, e.g. ``("box_loss", "cls_loss", "dfl_loss")`` for YOLOv8 and YOLO11."""
        return self.head.loss_names

    def criterion(self, loss: Mapping[str, float], epochs: int, world_size: int = 1) -> Criterion:
        """The loss this model trains with (its head's; see :class:`detrain.nn.head.Head`), its terms weighed by the
        gains of ``loss`` (the config's loss section, as a mapping) that the head takes, its own defaults for the
        others (:func:`detrain.nn.head.head_gains`).

        >>> DetectionModel(nc=2).criterion({"box": 1.0, "cls": 2.0, "dfl": 3.0}, epochs=3).gains
        (1.0, 2.0, 3.0)
        """
        return self.head.criterion(head_gains(self.head, loss), epochs, world_size)

    def set_inference(self, max_det: int = 300, agnostic: bool = False, nms: bool = False) -> DetectionModel:
        """Shape the inference output (an end-to-end head's top-k count and class-agnostic selection; ``nms``: its
        one-to-many branch with NMS instead); returns ``self``."""
        self.head.set_inference(max_det, agnostic, nms)
        return self

    def postprocess(self, preds: Tensor, options: InferenceOptions) -> list[Tensor]:
        """Inference output -> per image (n, 6) ``[x1, y1, x2, y2, score, class]`` detections, best first: NMS for
        a one-to-many head, a confidence filter of the top-k for a one-to-one head.

        >>> m = DetectionModel(nc=2).eval()
        >>> [d.shape for d in m.postprocess(m(torch.zeros(1, 3, 64, 64)), InferenceOptions(conf=0.99))]
        [torch.Size([0, 6])]
        """
        return self.head.postprocess(preds, options)

    def forward(self, x: Tensor, decode: bool | None = None) -> Any:
        outputs: list[Tensor | None] = []
        y: Any = x
        head = self.model[-1]
        for layer in self.model:
            f = cast("int | list[int]", layer.f)  # set on every layer by build_layers
            if f != -1:
                y = outputs[f] if isinstance(f, int) else [y if j == -1 else outputs[j] for j in f]
            y = layer(y, decode) if layer is head else layer(y)
            outputs.append(y if layer.i in self.save else None)
        return y

    def decode(self, maps: Any) -> Tensor:
        """Raw head maps (training-mode output) -> the inference output, as in eval mode.

        >>> m = DetectionModel(nc=2).eval()
        >>> with torch.no_grad():
        ...     maps = m(torch.zeros(1, 3, 64, 64), decode=False)
        ...     m.decode(maps).shape
        torch.Size([1, 6, 84])
        """
        return cast(Any, self.head).decode(maps)

    def fuse(self) -> DetectionModel:
        """Fold every BatchNorm into its convolution, in place, for inference; returns ``self``.

        >>> m = DetectionModel(nc=1).eval().fuse(); any(isinstance(x, nn.BatchNorm2d) for x in m.modules())
        False
        """
        for m in self.modules():
            if isinstance(m, Conv):
                m.fuse_()
        return self

    def reset_classes(self, nc: int, names: dict[int, str] | None = None) -> DetectionModel:
        """Replace only the final class conv of each head branch for ``nc`` classes; keep all other weights.

        The head keeps its other shapes, and says which of the yaml's settings rebuild them (a YOLO head: its
        class-branch width, in ``yaml["head_cls_channels"]`` when it differs from what a fresh model with ``nc``
        classes would use), so ``DetectionModel(model.yaml)`` rebuilds the same shapes.

        >>> m = DetectionModel(nc=80).reset_classes(2, {0: "cat", 1: "dog"}); m.nc, m.model[22].cv3[0][2].out_channels
        (2, 2)
        """
        if names is not None and len(names) != nc:
            raise ConfigError(f"nc={nc} but {len(names)} class names were given")
        for key, value in self.head.reset_classes(nc).items():  # what rebuilds the head's shapes from the yaml
            if value is None:
                self.yaml.pop(key, None)
            else:
                self.yaml[key] = value
        self.nc = self.yaml["nc"] = nc
        self.names = {int(k): str(v) for k, v in names.items()} if names else {i: str(i) for i in range(nc)}
        return self
