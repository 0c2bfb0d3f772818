"""``augment=True`` at val and predict: test-time augmentation, as Ultralytics' ``DetectionModel._predict_augment``
does it for a YOLO detector.

The batch runs three times: as it is, scaled by 0.83 and flipped left-right, and scaled by 0.67 (bilinear, each
side padded right and below to a multiple of the largest stride with grey 0.447). Each output's boxes are brought
back to the input's pixels (divided by the scale, the flip undone: x = width - x), then the tails Ultralytics cuts
are cut: the full-scale pass loses its coarsest level's anchors (the largest objects, which the smaller scales see
better) and the smallest-scale pass its finest level's (the smallest objects, which it sees worst). The three are
concatenated along the anchors, so one NMS (the model's own postprocess) merges them.

It needs a head whose inference output is boxes for NMS (``head.output == "boxes"``): an end-to-end head's top-k
detections (YOLO26 without ``nms=True``) and an exported graph run at one scale, with one line saying so, as
Ultralytics reverts to one scale there.

>>> from detrain.nn.model import DetectionModel
>>> net = DetectionModel(nc=2).eval()
>>> augmented_forward(net, torch.zeros(1, 3, 64, 96)).shape  # 126 anchors a pass: 126 - 6, 126, 126 - 96
torch.Size([1, 6, 276])
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FLIPS", "SCALES", "augmented_forward", "clip_tails", "descale", "scale_image", "tta_problem"]

#: the scales of the three passes and whether each is flipped left-right (Ultralytics' 1, 0.83 flipped, 0.67)
SCALES = (1.0, 0.83, 0.67)
FLIPS = (False, True, False)
#: what a scaled image is padded with (Ultralytics' ImageNet-mean grey)
PAD_VALUE = 0.447


def tta_problem(net: nn.Module) -> str | None:
    """Why ``net`` cannot run augmented (one line's reason), or None when it can."""
    head = getattr(net, "head", None)
    if head is None or not hasattr(net, "stride"):
        return "an exported graph runs at the one scale it is given"
    if getattr(head, "output", None) != "boxes":
        return "an end-to-end head's top-k detections cannot be merged across scales (nms=true can)"
    return None


def scale_image(x: Tensor, ratio: float, stride: int) -> Tensor:
    """``x`` (B, C, H, W) resized by ``ratio`` (bilinear) and padded right and below to multiples of ``stride``.

    >>> scale_image(torch.zeros(1, 3, 64, 96), 0.83, 32).shape
    torch.Size([1, 3, 64, 96])
    """
    if ratio == 1.0:
        return x
    h, w = x.shape[2:]
    size = (int(h * ratio), int(w * ratio))
    scaled = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
    ph, pw = (math.ceil(v * ratio / stride) * stride for v in (h, w))
    return F.pad(scaled, [0, pw - size[1], 0, ph - size[0]], value=PAD_VALUE)


def descale(pred: Tensor, flipped: bool, ratio: float, width: int) -> Tensor:
    """Inference output (B, 4 + nc, N: xywh, then class scores) of a pass at ``ratio`` (flipped left-right when
    ``flipped``) -> its boxes in the pixels of the input, ``width`` wide.

    >>> p = torch.tensor([[[(640 - 100) * 0.83], [50 * 0.83], [20 * 0.83], [10 * 0.83], [0.9]]])
    >>> [round(v, 3) for v in descale(p, True, 0.83, 640).flatten().tolist()]
    [100.0, 50.0, 20.0, 10.0, 0.9]
    """
    boxes = pred[:, :4] / ratio
    if flipped:
        boxes = torch.cat((width - boxes[:, :1], boxes[:, 1:]), 1)
    return torch.cat((boxes, pred[:, 4:]), 1)


def clip_tails(preds: list[Tensor], levels: int) -> list[Tensor]:
    """The first pass without its coarsest level's anchors, the last without its finest level's (anchors in level
    order, each level a quarter of the one before: a level of ``levels`` holds 4**k / (4**levels - 1) * 3 of them).

    >>> [p.shape[-1] for p in clip_tails([torch.zeros(1, 6, 126), torch.zeros(1, 6, 84), torch.zeros(1, 6, 63)], 3)]
    [120, 84, 15]
    """
    parts = sum(4**k for k in range(levels))  # anchors come in (finest ... coarsest) = (4**(levels-1) ... 1) parts
    first, last = preds[0], preds[-1]
    out = list(preds)
    out[0] = first[..., : first.shape[-1] - first.shape[-1] // parts]
    out[-1] = last[..., (last.shape[-1] // parts) * 4 ** (levels - 1) :]
    return out


def augmented_forward(net: nn.Module, x: Tensor) -> Tensor:
    """``net``'s inference output for ``x`` from the three passes (the module docstring), one tensor for NMS."""
    strides = cast(Tensor, net.stride)
    stride, levels = int(max(strides.tolist())), len(strides)
    width = int(x.shape[-1])
    outputs = []
    for ratio, flipped in zip(SCALES, FLIPS):
        pred: Any = net(scale_image(x.flip(-1) if flipped else x, ratio, stride))
        if isinstance(pred, (tuple, list)):
            pred = pred[0]
        outputs.append(descale(pred, flipped, ratio, width))
    return torch.cat(clip_tails(outputs, levels), -1)
