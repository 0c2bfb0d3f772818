"""Box geometry shared by the model head, the loss and the validator.

Conventions: ``xyxy`` is (x1, y1, x2, y2) in pixels, ``xywh`` is (cx, cy, w, h); a trailing ``n`` means
normalised to [0, 1] by the image size. Anchor points are cell centres in feature-map units.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def xywh2xyxy(boxes_xywh: Tensor) -> Tensor:
    """Centre/size to corners. ``xywh2xyxy(torch.tensor([[5., 5, 2, 4]]))`` -> ``[[4, 3, 6, 7]]``."""
    xy, wh = boxes_xywh[..., :2], boxes_xywh[..., 2:4] / 2
    return torch.cat((xy - wh, xy + wh), -1)


def make_anchors(feats: list[Tensor], strides: Tensor | Sequence[float], offset: float = 0.5) -> tuple[Tensor, Tensor]:
    """Anchor centres (N, 2) in feature units and their strides (N, 1) for feature maps (B, C, H, W)."""
    points, stride_list = [], []
    dtype, device = feats[0].dtype, feats[0].device
    for feat, stride in zip(feats, strides):
        h, w = feat.shape[2:]
        # integers cast to dtype: the values a range in dtype gives (one rounding each), and an exported float16
        # graph's Range runs on integers (ONNX has no float16 Range)
        sx = torch.arange(w, device=device).to(dtype) + offset
        sy = torch.arange(h, device=device).to(dtype) + offset
        yy, xx = torch.meshgrid(sy, sx, indexing="ij")
        points.append(torch.stack((xx, yy), -1).view(-1, 2))
        stride_list.append(torch.full((h * w, 1), float(stride), dtype=dtype, device=device))
    return torch.cat(points), torch.cat(stride_list)


def dist2bbox(distance_ltrb: Tensor, anchor_points: Tensor, xywh: bool = True, dim: int = -1) -> Tensor:
    """Distances (left, top, right, bottom) from anchor points to boxes, xywh or xyxy."""
    lt, rb = distance_ltrb.chunk(2, dim)
    x1y1 = anchor_points - lt
    x2y2 = anchor_points + rb
    if xywh:
        return torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), dim)
    return torch.cat((x1y1, x2y2), dim)


def bbox2dist(anchor_points: Tensor, boxes_xyxy: Tensor, reg_max: int) -> Tensor:
    """Inverse of :func:`dist2bbox` (xyxy), clamped to the DFL range [0, reg_max - 1 - eps]."""
    x1y1, x2y2 = boxes_xyxy.chunk(2, -1)
    return torch.cat((anchor_points - x1y1, x2y2 - anchor_points), -1).clamp_(0, reg_max - 1 - 0.01)


def bbox_iou_ciou(box1_xyxy: Tensor, box2_xyxy: Tensor, eps: float = 1e-7) -> tuple[Tensor, Tensor]:
    """Element-wise IoU and Complete-IoU of two broadcastable sets of xyxy boxes, each shaped (..., 1).

    >>> iou, ciou = bbox_iou_ciou(torch.tensor([[0., 0, 2, 2]]), torch.tensor([[0., 0, 2, 2]]))
    >>> round(float(iou), 4), round(float(ciou), 4)
    (1.0, 1.0)
    """
    b1_x1, b1_y1, b1_x2, b1_y2 = box1_xyxy.chunk(4, -1)
    b2_x1, b2_y1, b2_x2, b2_y2 = box2_xyxy.chunk(4, -1)
    w1, h1 = b1_x2 - b1_x1, (b1_y2 - b1_y1).clamp(eps)
    w2, h2 = b2_x2 - b2_x1, (b2_y2 - b2_y1).clamp(eps)
    inter = (b1_x2.minimum(b2_x2) - b1_x1.maximum(b2_x1)).clamp(0) * (
        b1_y2.minimum(b2_y2) - b1_y1.maximum(b2_y1)
    ).clamp(0)
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    cw = b1_x2.maximum(b2_x2) - b1_x1.minimum(b2_x1)
    ch = b1_y2.maximum(b2_y2) - b1_y1.minimum(b2_y1)
    c2 = cw.pow(2) + ch.pow(2) + eps
    rho2 = ((b2_x1 + b2_x2 - b1_x1 - b1_x2).pow(2) + (b2_y1 + b2_y2 - b1_y1 - b1_y2).pow(2)) / 4
    v = (4 / math.pi**2) * (torch.atan(w2 / h2) - torch.atan(w1 / h1)).pow(2)
    with torch.no_grad():
        alpha = v / (v - iou + (1 + eps))
    return iou, iou - (rho2 / c2 + v * alpha)


def clip_boxes_(boxes_xyxy: Tensor, shape_hw: tuple[int, int]) -> Tensor:
    """Clip xyxy boxes in place to an image of ``shape_hw``."""
    boxes_xyxy[..., 0].clamp_(0, shape_hw[1])
    boxes_xyxy[..., 1].clamp_(0, shape_hw[0])
    boxes_xyxy[..., 2].clamp_(0, shape_hw[1])
    boxes_xyxy[..., 3].clamp_(0, shape_hw[0])
    return boxes_xyxy


def scale_boxes_to_original(
    boxes_xyxy: Tensor, ratio: float | tuple[float, float], pad_xy: tuple[float, float], orig_shape_hw: tuple[int, int]
) -> Tensor:
    """Map boxes from a letterboxed input back to the original image (in place), clipped to it.

    ``ratio`` is the resize gain (one number, or (gain_x, gain_y)); ``pad_xy`` the left/top padding in pixels.
    """
    gx, gy = (ratio, ratio) if isinstance(ratio, (int, float)) else ratio
    boxes_xyxy[..., [0, 2]] -= pad_xy[0]
    boxes_xyxy[..., [1, 3]] -= pad_xy[1]
    boxes_xyxy[..., [0, 2]] /= gx
    boxes_xyxy[..., [1, 3]] /= gy
    return clip_boxes_(boxes_xyxy, orig_shape_hw)
