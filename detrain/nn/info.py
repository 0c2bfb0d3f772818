"""Model size and cost: layers, parameter counts, GFLOPs at an image size, strides and classes.

GFLOPs are counted, not estimated: one forward at the full ``imgsz`` runs under torch's
``FlopCounterMode`` on the meta device (shapes only, no arithmetic and no memory for activations), so even
the x scale at 1280 costs well under a second. The count follows the usual convention of 2 FLOPs per
multiply-accumulate of convolutions and matrix products; BatchNorm, activations, pooling and the box
decoding are elementwise and not counted, so a fused model costs the same as an unfused one. YOLO26's end-to-end
head is counted with both of its branches, the model as it trains and as Ultralytics' published figures count it
(inference runs the one-to-one branch alone: at n, about 0.6 of its 6.1 GFLOPs less).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from detrain.errors import ConfigError
from detrain.nn.blocks11 import C2PSA, C3k2
from detrain.nn.head import Head, is_head
from detrain.nn.modules import SPPF, C2f, Concat, Conv

if TYPE_CHECKING:
    from detrain.nn.model import DetectionModel

__all__ = ["MAX_GFLOPS", "LayerInfo", "ModelInfo", "check_cost", "layer_args", "model_info", "print_info"]

# The most one forward of a model a checkpoint describes may cost at its recorded image size, as a checkpoint's
# parameter count is bounded (:data:`detrain.nn.yaml_plan.MAX_PARAMETERS`): YOLOv8x costs 258 GFLOPs at 640 and
# 1,031 at 1280, so the bound admits it up to imgsz 3936; read at each check, so a test may lower it.
MAX_GFLOPS = 10_000
_MAX_COUNTED_IMGSZ = 1 << 16  # a recorded image size beyond this is refused, not counted
_COSTS: dict[str, float] = {}  # GFLOPs by architecture and size: a process loading a model again counts it once


@dataclass(frozen=True)
class LayerInfo:
    """One row of the per-layer table: a layer of the model yaml as built at the model's scale."""

    index: int  #: position in ``model.model`` (the ``model.<index>.`` state-dict prefix)
    source: int | list[int]  #: the yaml's ``from``: -1 = the previous layer, else the layer(s) it reads
    repeats: int  #: the yaml's repeats after the depth multiple (inner blocks of a C2f, C3k2 or C2PSA, else 1)
    params: int  #: parameters of this layer
    module: str  #: the yaml's module name (Conv, C2f, C3k2, C2PSA, SPPF, nn.Upsample, Concat, Detect)
    args: list[Any]  #: the built arguments: channels in/out, kernel, stride, … (see :func:`layer_args`)
    gflops: float  #: GFLOPs of this layer in one forward at the model's ``imgsz`` (batch 1)


@dataclass(frozen=True)
class ModelInfo:
    """What :func:`model_info` (and ``Model.info()`` / ``detrain info``) reports about a detector.

    ``params`` counts every parameter as the model is now (for a trained model, with its BatchNorms);
    ``fused_params`` counts them after ``model.fuse()`` folds each BatchNorm into its convolution (each
    such convolution gains a bias and loses the BatchNorm's weight and bias), the figure Ultralytics
    publishes for its models (3,151,904 for the 80-class YOLOv8n, which has 3,157,200 unfused).
    ``gradients`` counts the parameters that train (all but the fixed DFL weights).
    """

    layers: int  #: layers of the model yaml (rows of ``table``)
    modules: int  #: torch modules inside the model (every Conv2d, BatchNorm2d, SiLU, … counted once)
    params: int  #: parameters
    fused_params: int  #: parameters once BatchNorms are folded into the convolutions
    gradients: int  #: parameters with ``requires_grad``
    gflops: float  #: GFLOPs of one forward at ``imgsz`` (batch 1)
    imgsz: tuple[int, int]  #: the (height, width) GFLOPs were counted at
    stride: tuple[int, ...]  #: output stride of each detection level, e.g. (8, 16, 32)
    nc: int  #: number of classes
    names: dict[int, str]  #: class index -> name
    scale: str  #: model scale (n/s/m/l/x)
    table: tuple[LayerInfo, ...] = dataclasses.field(repr=False)  #: one row per layer

    def summary(self) -> str:
        """One line: ``23 layers (281 modules), 3,157,200 parameters (3,151,904 fused), …``."""
        h, w = self.imgsz
        size = f"{h}" if h == w else f"{h}x{w}"
        return (
            f"scale {self.scale}: {self.layers} layers ({self.modules} modules), {self.params:,} parameters "
            f"({self.fused_params:,} fused), {self.gradients:,} gradients, {self.gflops:.1f} GFLOPs at {size}, "
            f"stride {'/'.join(map(str, self.stride))}, {self.nc} classes"
        )


def layer_args(layer: nn.Module) -> list[Any]:
    """The arguments a yaml layer was built with, read back from the built module (so they show the
    scaled channel counts and repeats, not the yaml's nominal ones).

    Conv: [c_in, c_out, kernel, stride]; C2f: [c_in, c_out, repeats, shortcut]; C3k2: [c_in, c_out, repeats,
    c3k], and ``"attn"`` after them for YOLO26's attention form; C2PSA: [c_in, c_out, repeats]; SPPF: [c_in,
    c_out, kernel], and for YOLO26's form (linear cv1) [c_in, c_out, kernel, pools, residual]; Upsample:
    [scale_factor, mode]; Concat: [dimension]; a head: its own (:meth:`detrain.nn.head.Head.yaml_args`; Detect:
    [nc, [c_in per level]], and ``"end2end"`` after them for YOLO26's end-to-end head).

    >>> layer_args(Conv(3, 16, 3, 2)), layer_args(C2f(32, 32, 1, True)), layer_args(C3k2(32, 64, 2, True))
    ([3, 16, 3, 2], [32, 32, 1, True], [32, 64, 2, True])
    >>> layer_args(C3k2(128, 128, 1, attn=True)), layer_args(SPPF(64, 64, 5, 3, True, cv1_act=False))
    ([128, 128, 1, False, 'attn'], [64, 64, 5, 3, True])
    """
    if isinstance(layer, Conv):
        return [layer.conv.in_channels, layer.conv.out_channels, layer.conv.kernel_size[0], layer.conv.stride[0]]
    if isinstance(layer, C3k2):
        attn = ["attn"] if layer.attn else []
        return [layer.cv1.conv.in_channels, layer.cv2.conv.out_channels, len(layer.m), layer.c3k, *attn]
    if isinstance(layer, C2PSA):
        return [layer.cv1.conv.in_channels, layer.cv2.conv.out_channels, len(layer.m)]
    if isinstance(layer, C2f):
        shortcut = bool(layer.m[0].add) if len(layer.m) else False
        return [layer.cv1.conv.in_channels, layer.cv2.conv.out_channels, len(layer.m), shortcut]
    if isinstance(layer, SPPF):
        args = [layer.cv1.conv.in_channels, layer.cv2.conv.out_channels, layer.m.kernel_size]
        yolo26 = isinstance(layer.cv1.act, nn.Identity) or layer.n != 3 or layer.add
        return [*args, layer.n, layer.add] if yolo26 else args
    if isinstance(layer, nn.Upsample):
        return [layer.scale_factor, layer.mode]
    if isinstance(layer, Concat):
        return [layer.d]
    if is_head(layer):
        return cast(Head, layer).yaml_args()
    return []


def _image_size(imgsz: int | tuple[int, int] | list[int], stride: int) -> tuple[int, int]:
    hw = (imgsz, imgsz) if isinstance(imgsz, int) else tuple(imgsz)
    if len(hw) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v % stride for v in hw):
        raise ConfigError(f"imgsz must be a positive multiple of {stride} (or two of them), got {imgsz!r}")
    return hw[0], hw[1]


def _fused_params(model: DetectionModel) -> int:
    """Parameters after ``fuse()``: each Conv with a BatchNorm trades BN's weight and bias for a conv bias."""
    params = sum(p.numel() for p in model.parameters())
    for m in model.modules():
        if isinstance(m, Conv) and isinstance(m.bn, nn.BatchNorm2d):
            gained_bias = 0 if m.conv.bias is not None else m.conv.out_channels
            params -= sum(p.numel() for p in m.bn.parameters()) - gained_bias
    return params


def _count_flops(model: DetectionModel, h: int, w: int) -> tuple[float, list[float]]:
    """(total FLOPs, FLOPs per layer of ``model.model``) of one batch-1 forward at (h, w), on the meta device.

    The weights are swapped for meta tensors of the same shapes only for this call (``functional_call``),
    so the model is neither copied nor changed. The head runs without decoding (its decoding is
    elementwise: nothing to count) because anchors cannot be built from meta strides: it gives the raw maps its
    criterion reads, so both branches of an end-to-end head are counted.
    """
    meta = {name: torch.empty_like(t, device="meta") for name, t in [*model.named_parameters(), *model.named_buffers()]}
    layers = list(model.model)
    marks: list[float] = []
    counter = FlopCounterMode(display=False)
    hooks = [layer.register_forward_pre_hook(lambda *_: marks.append(counter.get_total_flops())) for layer in layers]
    was_training = model.training
    model.eval()  # BatchNorm must not try to update (meta) running statistics
    try:
        x = torch.empty(1, 3, h, w, device="meta")
        with torch.no_grad(), counter:
            functional_call(model, meta, (x,), {"decode": False})
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    total = float(counter.get_total_flops())
    per_layer = [b - a for a, b in zip(marks, [*marks[1:], total])]
    return total, per_layer


def check_cost(model: DetectionModel, imgsz: int | None, strides: list[float]) -> float:
    """The GFLOPs of one batch-1 forward of ``model`` (a shell on the meta device will do: nothing is allocated or
    computed) at ``imgsz`` (a checkpoint's record: None or not positive means 640, and it is rounded up to a
    multiple of the largest of ``strides`` as ``imgsz=`` is), counted as :func:`model_info` counts them; a one-line
    ConfigError when that is over :data:`MAX_GFLOPS` (or the model cannot run at that size).

    A checkpoint decides its model's architecture, and parameters alone do not bound what one image costs: 267
    million of them made a model of 55 TFLOPs an image. Costs under a second (YOLOv8x at 1280), once per
    architecture and size in a process.

    >>> from detrain.nn.model import DetectionModel
    >>> round(check_cost(DetectionModel(scale="n"), 100, [8, 16, 32]), 2)  # counted at 128
    0.35
    """
    stride = max(1, math.ceil(max(strides, default=1)))
    size = imgsz if isinstance(imgsz, int) and imgsz > 0 else 640
    size = max(stride, math.ceil(size / stride) * stride)
    if size > _MAX_COUNTED_IMGSZ:
        raise ConfigError(f"it records imgsz={size}, more than the {_MAX_COUNTED_IMGSZ} detrain runs a model at")
    key = repr((getattr(model, "yaml", None), model.scale, model.nc, size))  # the architecture, all of it
    gflops = _COSTS.get(key)
    if gflops is None:
        try:
            gflops = _count_flops(model, size, size)[0] / 1e9
        except (RuntimeError, ValueError) as e:  # shapes that do not meet (a layer deeper than the head's strides)
            reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            raise ConfigError(f"it cannot run at imgsz={size}: {reason}") from None
        if len(_COSTS) >= 64:
            _COSTS.clear()
        _COSTS[key] = gflops
    if gflops > MAX_GFLOPS:
        raise ConfigError(
            f"at imgsz={size} it costs {gflops:,.1f} GFLOPs an image, more than the {MAX_GFLOPS:,} detrain runs "
            "(YOLOv8x: 258 at 640)"
        )
    return gflops


def model_info(model: DetectionModel, imgsz: int | tuple[int, int] = 640) -> ModelInfo:
    """Layers, parameters, gradients and GFLOPs of one forward at ``imgsz`` (batch 1) of a DetectionModel.

    ``imgsz`` must be a multiple of the model's largest stride (an int, or (height, width)). The model is
    left as it was (weights, device, training mode).

    >>> from detrain.nn.model import DetectionModel
    >>> info = model_info(DetectionModel(scale="n"), 640)
    >>> info.layers, info.params, info.fused_params, round(info.gflops, 1), info.stride
    (23, 3157200, 3151904, 8.7, (8, 16, 32))
    """
    strides = tuple(int(s) for s in model.stride.tolist())
    h, w = _image_size(imgsz, max(strides))
    total, per_layer = _count_flops(model, h, w)
    table = tuple(
        LayerInfo(
            index=i,
            source=cast("int | list[int]", layer.f),  # set on every layer by build_layers
            repeats=len(layer.m) if isinstance(layer, (C2f, C2PSA)) else 1,
            params=sum(p.numel() for p in layer.parameters()),
            module=str(getattr(layer, "type", type(layer).__name__)),
            args=layer_args(layer),
            gflops=flops / 1e9,
        )
        for i, (layer, flops) in enumerate(zip(model.model, per_layer))
    )
    return ModelInfo(
        layers=len(model.model),
        modules=len(list(model.modules())),
        params=sum(p.numel() for p in model.parameters()),
        fused_params=_fused_params(model),
        gradients=sum(p.numel() for p in model.parameters() if p.requires_grad),
        gflops=total / 1e9,
        imgsz=(h, w),
        stride=strides,
        nc=int(model.nc),
        names={int(k): str(v) for k, v in dict(model.names).items()},
        scale=str(model.scale),
        table=table,
    )


def print_info(info: ModelInfo, title: str = "", table: bool = True) -> None:
    """Print the per-layer table (when ``table``), the summary line and the class names.

    Class names come from weights files and are printed literally, never read as rich markup.
    """
    from rich.table import Table
    from rich.text import Text

    from detrain.log import console

    if table:
        grid = Table(box=None, pad_edge=False)
        for col in ("", "from", "n", "params", "module", "arguments", "GFLOPs"):
            grid.add_column(col, justify="left" if col in ("module", "arguments") else "right")
        for row in info.table:
            cells = (row.index, row.source, row.repeats, f"{row.params:,}", row.module, row.args, f"{row.gflops:.3f}")
            grid.add_row(*(Text(str(cell)) for cell in cells))  # plain text: a "[...]" is never markup
        console.print(grid)
    # whole lines, never wrapped, so they grep and parse as they are
    console.print(Text(f"{title}: {info.summary()}" if title else info.summary()), soft_wrap=True)
    if all(name == str(i) for i, name in info.names.items()):
        console.print(f"classes: {info.nc}, unnamed (0-{info.nc - 1})", soft_wrap=True)
    else:
        console.print(
            Text("classes: " + ", ".join(f"{i} {name}" for i, name in sorted(info.names.items()))), soft_wrap=True
        )
