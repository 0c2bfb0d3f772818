"""Building blocks of the YOLOv8-class detector, and the head and depthwise convolution YOLO11 shares.

Attribute names and nesting follow Ultralytics' exactly (``conv``/``bn``/``act``, ``cv1``/``cv2``/``m``,
``cv2``/``cv3``/``dfl`` in the head) because state-dict keys are derived from them, and real YOLOv8 and
YOLO11 checkpoints are loaded by key. YOLO11's own blocks (C3k2, C2PSA, ...) are in :mod:`detrain.nn.blocks11`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from detrain.nn.boxes import dist2bbox, make_anchors
from detrain.nn.head import BOXES, Criterion, HeadRow, InferenceOptions, nms, register_head
from detrain.nn.loss import YOLO_GAINS, DetectionLoss, LossGains
from detrain.nn.memory_format import memory_format_of

BN_EPS = 1e-3
BN_MOMENTUM = 0.03


class Conv(nn.Module):
    """Conv2d (no bias) -> BatchNorm2d -> SiLU, with "same" padding for odd kernels.

    >>> Conv(3, 16, k=3, s=2)(torch.zeros(1, 3, 64, 64)).shape
    torch.Size([1, 16, 32, 32])
    """

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, g: int = 1, act: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2, groups=g, bias=False)
        self.bn: nn.Module = nn.BatchNorm2d(c2, eps=BN_EPS, momentum=BN_MOMENTUM)
        self.act: nn.Module = nn.SiLU() if act else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.bn(conv2d(self.conv, x)))

    def fuse_(self) -> None:
        """Fold the BatchNorm into the convolution, for inference. Idempotent."""
        if isinstance(self.bn, nn.Identity):
            return
        self.conv = fuse_conv_bn(self.conv, self.bn)  # type: ignore[arg-type]
        self.bn = nn.Identity()


class DWConv(Conv):
    """A depthwise Conv: one filter group per channel when ``c1 == c2`` (groups = gcd of the two widths).

    >>> DWConv(8, 8, 3).conv.weight.shape
    torch.Size([8, 1, 3, 3])
    """

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, act: bool = True) -> None:
        super().__init__(c1, c2, k, s, g=math.gcd(c1, c2), act=act)


def _pointwise_as_matmul(conv: nn.Conv2d, x: Tensor) -> bool:
    """Whether ``conv`` is a plain 1x1 convolution best run as a matmul over channels_last pixels."""
    return (
        type(conv) is nn.Conv2d  # not a subclass with a forward of its own
        and x.device.type == "cpu"
        and conv.kernel_size == (1, 1)
        and conv.stride == (1, 1)
        and conv.padding == (0, 0)
        and conv.groups == 1
        and x.dim() == 4
        and x.is_contiguous(memory_format=torch.channels_last)
        and not (torch.jit.is_tracing() or torch.jit.is_scripting() or torch.onnx.is_in_onnx_export())
    )


def conv2d(conv: nn.Conv2d, x: Tensor) -> Tensor:
    """``conv(x)``; a 1x1 convolution of a channels_last CPU tensor runs as one matmul over its pixels.

    In channels_last memory a 1x1 convolution is exactly ``(N*H*W, C_in) @ (C_in, C_out)``, and the result
    is again channels_last: no layout conversion either way. On one CPU thread PyTorch otherwise sends
    small-batch 1x1 convolutions to its unblocked NCHW kernel, which copies to and from NCHW each time;
    with more threads (oneDNN) the matmul is still no slower. Hooks on ``conv`` itself are bypassed here;
    subclasses of ``nn.Conv2d`` always run their own forward.

    >>> c = nn.Conv2d(8, 4, 1)
    >>> x = torch.randn(2, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    >>> y = conv2d(c, x); torch.allclose(y, c(x), atol=1e-5), y.is_contiguous(memory_format=torch.channels_last)
    (True, True)
    """
    if not _pointwise_as_matmul(conv, x):
        return conv(x)
    w = conv.weight.view(conv.out_channels, conv.in_channels)  # a view for either layout of a 1x1 weight
    return torch.nn.functional.linear(x.permute(0, 2, 3, 1), w, conv.bias).permute(0, 3, 1, 2)


def fuse_conv_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """A new Conv2d (with bias) computing ``bn(conv(x))`` with BN's running statistics.

    >>> c, b = nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8).eval()
    >>> x = torch.randn(1, 3, 8, 8)
    >>> torch.allclose(fuse_conv_bn(c, b)(x), b(c(x)), atol=1e-5)
    True
    """
    if bn.running_mean is None or bn.running_var is None or bn.weight is None or bn.bias is None:
        raise ValueError("fuse_conv_bn needs an affine BatchNorm2d that tracks running statistics")
    # torch stores a Conv2d's geometry as tuple[int, ...] but types its constructor for 2-tuples
    pair = tuple[int, int]
    fused = nn.Conv2d(
        conv.in_channels,
        conv.out_channels,
        cast(pair, conv.kernel_size),
        cast(pair, conv.stride),
        cast("str | pair", conv.padding),
        cast(pair, conv.dilation),
        conv.groups,
        bias=True,
        device=conv.weight.device,
        dtype=conv.weight.dtype,
    )
    fused_bias = cast(Tensor, fused.bias)  # built with bias=True
    with torch.no_grad():
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        fused.weight.copy_(conv.weight * scale.view(-1, 1, 1, 1))
        bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
        fused_bias.copy_((bias - bn.running_mean) * scale + bn.bias)
    # keep channels_last (or whatever layout the model was moved to) after fusing
    if conv.weight.is_contiguous(memory_format=torch.channels_last) and not conv.weight.is_contiguous():
        fused.to(memory_format=torch.channels_last)
    fused.requires_grad_(False)
    return fused


class GhostBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` that in training normalises each run of about ``ghost_images`` images of a forward pass
    on its own ("ghost batches", Hoffer et al. 2017), as ranks of that many images each would; the running
    statistics take one update per run. The same parameters, buffers and state-dict keys; outside training, or for
    a pass of at most ``ghost_images`` images, it is the plain layer. The batch is cut into ``ceil(n / ghost_images)``
    near-equal runs, so no run is a lone image.

    >>> bn = use_ghost_batches(nn.Sequential(nn.BatchNorm2d(2)), 4)[0]
    >>> x = torch.randn(8, 2, 3, 3)
    >>> torch.allclose(bn(x)[:4], nn.BatchNorm2d(2)(x[:4]), atol=1e-6), int(bn.num_batches_tracked)
    (True, 2)
    """

    ghost_images: int = 0

    def forward(self, x: Tensor) -> Tensor:
        g = self.ghost_images
        if not self.training or g <= 0 or x.shape[0] <= g:
            return super().forward(x)
        runs = []
        for run in torch.tensor_split(x, ghost_runs(x.shape[0], g)):
            runs.append(super().forward(run))
        return torch.cat(runs)


def ghost_runs(images: int, ghost: int) -> int:
    """How many near-equal runs a pass of ``images`` is cut into for ghost batches of ``ghost`` (1 when off).

    >>> ghost_runs(256, 16), ghost_runs(33, 16), ghost_runs(16, 0)
    (16, 3, 1)
    """
    return -(-images // ghost) if ghost > 0 else 1


def use_ghost_batches(model: nn.Module, images: int) -> nn.Module:
    """Every plain ``nn.BatchNorm2d`` of ``model`` normalises ghost batches of ``images`` in training (0: the whole
    pass again), in place (the tensors stay the same objects: optimizers and the EMA are unaffected). Layers already
    synchronised over ranks (``sync_bn``) are left alone: they were asked for the global batch. Returns ``model``."""
    for m in model.modules():
        if type(m) is nn.BatchNorm2d and images > 0:
            m.__class__ = GhostBatchNorm2d
        if isinstance(m, GhostBatchNorm2d):
            m.ghost_images = images
            if images <= 0:
                m.__class__ = nn.BatchNorm2d  # type: ignore[assignment]
    return model


def ghost_batch_images(model: nn.Module) -> int:
    """The ghost batch the model's BatchNorm layers normalise in training (0: the whole pass)."""
    return next((m.ghost_images for m in model.modules() if isinstance(m, GhostBatchNorm2d)), 0)


class Bottleneck(nn.Module):
    """Two 3x3 Convs with an optional residual (only when the channel counts agree).

    >>> Bottleneck(8, 8)(torch.zeros(1, 8, 16, 16)).shape
    torch.Size([1, 8, 16, 16])
    """

    def __init__(self, c1: int, c2: int, shortcut: bool = True, e: float = 1.0) -> None:
        super().__init__()
        hidden = int(c2 * e)
        self.cv1 = Conv(c1, hidden, 3)
        self.cv2 = Conv(hidden, c2, 3)
        self.add = shortcut and c1 == c2

    def forward(self, x: Tensor) -> Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C2f(nn.Module):
    """CSP block with two halves: one half runs through ``n`` Bottlenecks, every output is concatenated.

    ``block`` makes each inner block from the half's width (default: a full-width Bottleneck); YOLO11's C3k2
    is this same CSP wiring around other blocks.

    >>> C2f(16, 32, n=2, shortcut=True)(torch.zeros(1, 16, 8, 8)).shape
    torch.Size([1, 32, 8, 8])
    """

    def __init__(
        self,
        c1: int,
        c2: int,
        n: int = 1,
        shortcut: bool = False,
        e: float = 0.5,
        block: Callable[[int], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        self.c = int(c2 * e)
        self.cv1 = Conv(c1, 2 * self.c, 1)
        self.cv2 = Conv((2 + n) * self.c, c2, 1)
        make = block or (lambda c: Bottleneck(c, c, shortcut))
        self.m = nn.ModuleList(make(self.c) for _ in range(n))

    def forward(self, x: Tensor) -> Tensor:
        # One cv1 then views of its halves: the only copy is the final concatenation into cv2's input.
        y = self.cv1(x)
        parts = [y]
        # the second half as a dense tensor of y's layout: a convolution would copy the strided channel slice
        # in its forward and again in its backward
        last = y[:, self.c :].contiguous(memory_format=memory_format_of(y))
        for block in self.m:
            last = block(last)
            parts.append(last)
        return self.cv2(torch.cat(parts, 1))


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: ``n`` chained max-pools of kernel ``k`` (three of 5: 5/9/13 receptive fields),
    the input and every pooled map concatenated and mixed by ``cv2``.

    YOLOv8 and YOLO11 use the defaults. YOLO26's form (its yaml row names ``n`` and ``shortcut``) leaves ``cv1``
    linear (``cv1_act=False``, as Ultralytics 8.4 builds any row with those arguments) and, with ``shortcut``
    and equal widths, adds the input to the output.

    >>> SPPF(32, 32)(torch.zeros(1, 32, 4, 4)).shape
    torch.Size([1, 32, 4, 4])
    >>> SPPF(32, 32, n=2, shortcut=True, cv1_act=False).cv2.conv.in_channels  # 16 channels, pooled twice
    48
    """

    def __init__(self, c1: int, c2: int, k: int = 5, n: int = 3, shortcut: bool = False, cv1_act: bool = True) -> None:
        super().__init__()
        hidden = c1 // 2
        self.cv1 = Conv(c1, hidden, 1, act=cv1_act)
        self.cv2 = Conv(hidden * (n + 1), c2, 1)
        self.m = nn.MaxPool2d(kernel_size=k, stride=1, padding=k // 2)
        self.n = n
        self.add = shortcut and c1 == c2

    def forward(self, x: Tensor) -> Tensor:
        pooled = [self.cv1(x)]
        for _ in range(self.n):
            pooled.append(self.m(pooled[-1]))
        y = self.cv2(torch.cat(pooled, 1))
        return x + y if self.add else y


class _NearestUpsample(torch.autograd.Function):
    """Nearest upsampling by an integer factor k (each input pixel becomes a k x k block) whose backward
    reads a strided gradient as it is.

    The gradient reaching an upsample is usually a channel slice of the following concatenation's
    gradient; torch's own backward first copies it to a dense tensor. Here the k*k input-pixel sums are
    taken straight from the strided (B, H, k, W, k, C) view of a channels_last gradient.
    """

    @staticmethod
    def forward(ctx, x: Tensor, k: int) -> Tensor:
        ctx.k = k
        return nn.functional.interpolate(x, scale_factor=float(k), mode="nearest")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        k = ctx.k
        h, w = grad.shape[2:]
        cells = grad.permute(0, 2, 3, 1).unflatten(1, (h // k, k)).unflatten(3, (w // k, k))  # (B, H, k, W, k, C)
        out = cells[:, :, 0, :, 0].clone()
        for i in range(k):
            for j in range(k):
                if i or j:
                    out += cells[:, :, i, :, j]
        return out.permute(0, 3, 1, 2), None


class Upsample(nn.Upsample):
    """``nn.Upsample`` (same arguments, no state); 2x nearest upsampling of a channels_last CPU tensor takes
    a backward that avoids a copy of the incoming gradient.

    >>> up = Upsample(scale_factor=2.0)
    >>> x = torch.randn(1, 3, 2, 2).contiguous(memory_format=torch.channels_last).requires_grad_()
    >>> torch.equal(up(x), nn.Upsample(scale_factor=2.0)(x))
    True
    """

    def forward(self, x: Tensor) -> Tensor:
        if (
            self.mode == "nearest"
            and self.size is None
            and self.scale_factor in (2, 2.0, (2, 2), (2.0, 2.0))  # torch maps output pixel i to i >> 1 exactly
            and x.dim() == 4
            and x.device.type == "cpu"
            and x.requires_grad
            and x.is_contiguous(memory_format=torch.channels_last)
            and not (torch.jit.is_tracing() or torch.jit.is_scripting() or torch.onnx.is_in_onnx_export())
        ):
            return _NearestUpsample.apply(x, 2)
        return super().forward(x)


class Concat(nn.Module):
    """Concatenate a list of tensors along ``dimension``.

    >>> Concat()([torch.zeros(1, 2, 4, 4), torch.zeros(1, 3, 4, 4)]).shape
    torch.Size([1, 5, 4, 4])
    """

    def __init__(self, dimension: int = 1) -> None:
        super().__init__()
        self.d = dimension

    def forward(self, xs: list[Tensor]) -> Tensor:
        return torch.cat(xs, self.d)


class DFL(nn.Module):
    """Distribution focal loss integral: a softmax over ``reg_max`` bins -> its expected bin index.

    Input (B, 4 * reg_max, N), output (B, 4, N). The fixed ``conv`` weight (0..reg_max-1) is kept as a
    parameter, without gradient, so the state dict matches YOLOv8's.

    >>> DFL(16)(torch.zeros(1, 64, 10)).shape
    torch.Size([1, 4, 10])
    """

    def __init__(self, reg_max: int = 16) -> None:
        super().__init__()
        self.reg_max = reg_max
        self.conv = nn.Conv2d(reg_max, 1, 1, bias=False).requires_grad_(False)
        with torch.no_grad():
            self.conv.weight.copy_(torch.arange(reg_max, dtype=torch.float).view(1, reg_max, 1, 1))

    def forward(self, x: Tensor) -> Tensor:
        b, _, n = x.shape
        probs = x.view(b, 4, self.reg_max, n).softmax(2)
        # a weighted sum over the bin axis, without the transpose a 1x1 conv would need
        return (probs * self.conv.weight.view(1, 1, self.reg_max, 1)).sum(2)


def final_conv(branch: nn.Module) -> nn.Conv2d:
    """A head branch's final 1x1 convolution (``ModuleList`` items are typed as plain modules)."""
    return cast(nn.Conv2d, cast(nn.Sequential, branch)[-1])


def replace_final_conv(branch: nn.Module, nc: int) -> None:
    """Swap a class branch's final 1x1 convolution for a fresh one with ``nc`` outputs, on the old one's device,
    dtype and memory format (every other layer of the branch keeps its weights)."""
    old = final_conv(branch)
    new = nn.Conv2d(old.in_channels, nc, 1, device=old.weight.device, dtype=old.weight.dtype)
    if old.weight.is_contiguous(memory_format=torch.channels_last) and not old.weight.is_contiguous():
        new.to(memory_format=torch.channels_last)
    cast(nn.Sequential, branch)[-1] = new


def run_branch(seq: nn.Module, x: Tensor) -> Tensor:
    """``seq(x)`` for a head branch (Conv, Conv, 1x1 Conv2d), its final 1x1 convolution through :func:`conv2d`."""
    *convs, last = cast(nn.Sequential, seq)
    for layer in convs:
        x = layer(x)
    return conv2d(cast(nn.Conv2d, last), x)


def branch_inputs(branches: nn.ModuleList) -> list[int]:
    """The channels of the feature map each branch reads (its first layer is a Conv)."""
    return [cast(Conv, cast(nn.Sequential, branch)[0]).conv.in_channels for branch in branches]


def cls_width_setting(head: Any) -> dict[str, Any]:
    """The yaml setting that rebuilds ``head``'s class-branch width after ``reset_classes``: ``head_cls_channels``
    when it differs from the width a fresh head with ``head.nc`` classes would take, else None (the key goes).
    The class branch reads the first level's channels, as the box branch does."""
    fresh_width = max(branch_inputs(head.cv2)[0], min(head.nc, 100))
    return {"head_cls_channels": head.cls_channels if head.cls_channels != fresh_width else None}


def class_convs(c_in: int, width: int, depthwise: bool) -> tuple[nn.Module, nn.Module]:
    """The two feature stages of a class branch, before its final 1x1 convolution (see :class:`Detect`)."""
    if depthwise:
        return (
            nn.Sequential(DWConv(c_in, c_in, 3), Conv(c_in, width, 1)),
            nn.Sequential(DWConv(width, width, 3), Conv(width, width, 1)),
        )
    return Conv(c_in, width, 3), Conv(width, width, 3)


@register_head
class Detect(nn.Module):
    """Anchor-free decoupled head: per level a box branch (``cv2``, 4 * reg_max DFL logits) and a class
    branch (``cv3``, nc logits).

    The class branch is two 3x3 Convs (YOLOv8) or, with ``depthwise_cls`` (YOLO11), two pairs of a 3x3
    depthwise Conv and a 1x1 Conv, each pair an ``nn.Sequential`` as in Ultralytics' non-legacy head; the
    box branch and everything after the branches are the same.

    In training mode ``forward`` returns the raw maps (B, 4 * reg_max + nc, H, W) per level; otherwise
    the decoded (B, 4 + nc, N): xywh boxes in input pixels and sigmoid scores. Anchors are cached per
    feature-map shape, device and dtype.

    >>> head = Detect(nc=2, ch=(16, 32, 64), strides=(8, 16, 32)).eval()
    >>> maps = [torch.zeros(1, c, 64 // s, 64 // s) for c, s in ((16, 8), (32, 16), (64, 32))]
    >>> head(maps).shape
    torch.Size([1, 6, 84])
    """

    # declared so the type checker sees these attributes as what they are, not as nn.Module's Tensor | Module
    stride: Tensor  # per-level strides (a non-persistent buffer)
    cv2: nn.ModuleList
    cv3: nn.ModuleList
    dfl: nn.Module

    def __init__(
        self,
        nc: int = 80,
        ch: tuple[int, ...] | list[int] = (),
        strides: tuple[float, ...] | list[float] | None = None,
        reg_max: int = 16,
        cls_channels: int | None = None,
        depthwise_cls: bool = False,
    ) -> None:
        super().__init__()
        self.nc = nc
        self.nl = len(ch)
        self.reg_max = reg_max
        self.no = nc + 4 * reg_max
        c2 = max(16, ch[0] // 4, reg_max * 4)
        # cls_channels lets a head keep its width after reset_classes() changed nc
        c3 = cls_channels if cls_channels is not None else max(ch[0], min(nc, 100))
        self.cls_channels = c3
        self.cv2 = nn.ModuleList(
            nn.Sequential(Conv(c, c2, 3), Conv(c2, c2, 3), nn.Conv2d(c2, 4 * reg_max, 1)) for c in ch
        )
        self.depthwise_cls = depthwise_cls
        self.cv3 = nn.ModuleList(nn.Sequential(*class_convs(c, c3, depthwise_cls), nn.Conv2d(c3, nc, 1)) for c in ch)
        self.dfl = DFL(reg_max) if reg_max > 1 else nn.Identity()
        self.register_buffer("stride", torch.tensor(strides or [0.0] * self.nl, dtype=torch.float), persistent=False)
        self._anchor_key: tuple | None = None
        self._anchors = torch.empty(0)
        self._anchor_strides = torch.empty(0)
        if strides is not None:
            self.bias_init()

    @classmethod
    def from_row(cls, row: HeadRow) -> Detect:
        """The head of a yaml row: its ``reg_max``, class-branch width and (YOLO11) depthwise class branch are the
        yaml's settings.

        >>> Detect.from_row(HeadRow(nc=2, channels=(16, 32), strides=(8.0, 16.0), reg_max=4)).yaml_args()
        [2, [16, 32]]
        """
        return cls(row.nc, row.channels, row.strides, row.reg_max, row.cls_channels, row.depthwise_cls)

    def bias_init(self) -> None:
        """Box logits start at 1.0; class logits at a prior of ~5 objects per 640 px image.

        >>> Detect(nc=2, ch=(16, 32, 64), strides=(8, 16, 32)).cv3[0][2].bias[0] < -5
        tensor(True)
        """
        if self.stride.is_meta:  # a head built for its shapes only (see model_from_checkpoint): no values to set
            return
        with torch.no_grad():
            for box, cls, s in zip(self.cv2, self.cv3, self.stride.tolist()):
                cast(Tensor, final_conv(box).bias).fill_(1.0)
                cast(Tensor, final_conv(cls).bias).fill_(math.log(5 / self.nc / (640 / s) ** 2))

    def forward(self, xs: list[Tensor], decode: bool | None = None) -> list[Tensor] | Tensor:
        maps = [torch.cat((run_branch(box, x), run_branch(cls, x)), 1) for x, box, cls in zip(xs, self.cv2, self.cv3)]
        if decode is None:
            decode = not self.training
        return self.decode(maps) if decode else maps

    def decode(self, maps: list[Tensor]) -> Tensor:
        """Raw head maps -> (B, 4 + nc, N): xywh boxes in input pixels, sigmoid class scores.

        >>> head = Detect(nc=1, ch=(16, 16, 16), strides=(8, 16, 32))
        >>> head.decode([torch.zeros(2, 65, 4, 4), torch.zeros(2, 65, 2, 2), torch.zeros(2, 65, 1, 1)]).shape
        torch.Size([2, 5, 21])
        """
        b = maps[0].shape[0]
        anchors, strides = self.anchors(maps)
        x = torch.cat([m.reshape(b, self.no, -1) for m in maps], 2)
        box, cls = x.split((4 * self.reg_max, self.nc), 1)
        boxes_xywh = dist2bbox(self.dfl(box), anchors, xywh=True, dim=1) * strides
        return torch.cat((boxes_xywh, cls.sigmoid()), 1)

    def anchors(self, maps: list[Tensor]) -> tuple[Tensor, Tensor]:
        """Anchor centres (2, N) in feature units and strides (1, N) for these maps, cached by shape.

        >>> head = Detect(nc=1, ch=(16, 16, 16), strides=(8, 16, 32))
        >>> maps = [torch.zeros(1, 65, 2, 2), torch.zeros(1, 65, 1, 1), torch.zeros(1, 65, 1, 1)]
        >>> points, strides = head.anchors(maps)
        >>> points[:, :2].tolist(), strides.tolist()
        ([[0.5, 1.5], [0.5, 0.5]], [[8.0, 8.0, 8.0, 8.0, 16.0, 32.0]])
        """
        key = (tuple(m.shape[2:] for m in maps), maps[0].device, maps[0].dtype)
        if key != self._anchor_key:
            points, strides = make_anchors(maps, self.stride)
            self._anchors, self._anchor_strides = points.T.contiguous(), strides.T.contiguous()
            self._anchor_key = key
        return self._anchors, self._anchor_strides

    loss_names = ("box_loss", "cls_loss", "dfl_loss")
    loss_gains = YOLO_GAINS  # box, cls, dfl
    output = BOXES  # inference gives every anchor's boxes and scores, for NMS

    def criterion(self, gains: Mapping[str, float], epochs: int, world_size: int = 1) -> Criterion:
        """YOLOv8's loss (:class:`detrain.nn.loss.DetectionLoss`) for this head; it has no schedule, so ``epochs``
        does not change it.

        >>> head = Detect(nc=2, ch=(16,), strides=(8,), reg_max=4)
        >>> head.criterion({"box": 1.0, "cls": 1.0, "dfl": 1.0}, epochs=3).item_names == head.loss_names
        True
        """
        return DetectionLoss(
            nc=self.nc,
            strides=self.stride,
            reg_max=self.reg_max,
            gains=LossGains.of(gains),
            world_size=world_size,
        )

    def class_parameters(self) -> Iterator[nn.Parameter]:
        """The class branches' (``cv3``) parameters."""
        return self.cv3.parameters()

    def yaml_args(self) -> list[Any]:
        """``[nc, [channels read at each level]]``."""
        return [self.nc, branch_inputs(self.cv2)]

    def set_inference(self, max_det: int = 300, agnostic: bool = False, nms: bool = False) -> None:
        """Nothing to set: this head's inference output is every anchor's box and scores; NMS (in
        :meth:`postprocess`) applies ``max_det`` and ``agnostic``, and it always uses NMS."""

    def postprocess(self, preds: Tensor, options: InferenceOptions) -> list[Tensor]:
        """Decoded output (B, 4 + nc, N) -> per image (n, 6) detections after per-class NMS
        (:func:`detrain.nn.postprocess.non_max_suppression`).

        >>> head = Detect(nc=1, ch=(16,), strides=(8,)).eval()
        >>> [d.shape for d in head.postprocess(head([torch.zeros(2, 16, 4, 4)]), InferenceOptions(conf=0.5))]
        [torch.Size([0, 6]), torch.Size([0, 6])]
        """
        return nms(preds, options)

    def reset_classes(self, nc: int) -> dict[str, Any]:
        """Swap only the final class conv of every ``cv3`` branch for one with ``nc`` outputs; the class branches
        keep their width (:func:`cls_width_setting`).

        >>> head = Detect(nc=80, ch=(16, 32, 64), strides=(8, 16, 32))
        >>> head.reset_classes(3), head.cv3[0][2].out_channels, head.no
        ({'head_cls_channels': 80}, 3, 67)
        """
        for branch in self.cv3:
            replace_final_conv(branch, nc)
        self.nc = nc
        self.no = nc + 4 * self.reg_max
        self._anchor_key = None
        self.bias_init()
        return cls_width_setting(self)
