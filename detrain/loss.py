"""Detection loss: BCE classification + CIoU box + distribution focal loss, on task-aligned targets.

The three components are normalised by the sum of the soft target scores. Under DDP that sum is
all-reduced (``normalizer_reduce``) so that W ranks holding B/W images each produce, after DDP's gradient
averaging, exactly the gradient one process would get on all B images.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from detrain.assigner import TaskAlignedAssigner
from detrain.boxes import bbox2dist, bbox_iou_ciou, dist2bbox, make_anchors, xywh2xyxy


def distribution_focal_loss(pred_logits: Tensor, target: Tensor) -> Tensor:
    """DFL of (K, reg_max) logits against (K,) continuous targets in [0, reg_max - 1): (K,).

    Cross-entropy against the two integer bins around the target, each weighted by its closeness, so the
    loss is smallest when the predicted distribution puts exactly that mass on those two bins.

    >>> logits = torch.log(torch.tensor([[0.0001, 0.7, 0.3, 0.0001]]))
    >>> round(float(distribution_focal_loss(logits, torch.tensor([1.3]))), 3)  # entropy of (0.7, 0.3)
    0.611
    """
    left = target.long()
    right = left + 1
    weight_left = right.to(target.dtype) - target
    weight_right = 1 - weight_left
    return (
        F.cross_entropy(pred_logits, left, reduction="none") * weight_left
        + F.cross_entropy(pred_logits, right, reduction="none") * weight_right
    )


def pad_targets(
    batch_idx: Tensor, cls: Tensor, bboxes: Tensor, batch_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Flat per-box labels -> padded (B, M, 1) classes, (B, M, 4) boxes and (B, M, 1) bool mask.

    M is the largest number of boxes in one image; the scatter avoids a Python loop over images.

    >>> c, b, m = pad_targets(torch.tensor([1., 1]), torch.tensor([[3.], [4.]]), torch.ones(2, 4), 2)
    >>> c.shape, m[:, :, 0].tolist()
    (torch.Size([2, 2, 1]), [[False, False], [True, True]])
    """
    image = batch_idx.reshape(-1).long()
    counts = torch.bincount(image, minlength=batch_size)
    m = int(counts.max()) if image.numel() else 0
    order = torch.argsort(image, stable=True)
    image = image[order]
    first = counts.cumsum(0) - counts  # index of each image's first box in the sorted order
    slot = torch.arange(image.numel(), device=image.device) - first[image]
    out_cls = cls.new_zeros(batch_size, m, 1)
    out_boxes = bboxes.new_zeros(batch_size, m, 4)
    out_cls[image, slot] = cls.reshape(-1, 1)[order]
    out_boxes[image, slot] = bboxes.reshape(-1, 4)[order]
    mask = torch.arange(m, device=image.device)[None, :] < counts[:, None]
    return out_cls, out_boxes, mask[..., None]


class DetectionLoss:
    """YOLOv8-style detection loss over raw head maps.

    ``loss, items = criterion(head_maps, batch_idx, cls, bboxes_xywhn)``: ``items`` is the detached (3,)
    [box, cls, dfl], each times its gain; ``loss`` is their sum times the global batch size, with gradient.
    Class ids must lie in [0, nc).

    Distributed: give ``normalizer_reduce`` (an all-reduce SUM of a scalar tensor, called on every rank at
    every step) and ``world_size``. Each rank's items are then its share of the global sums times
    ``world_size``, so their mean over ranks is the single-process value, and ``global_batch`` (default
    local batch * ``world_size``) makes DDP's gradient average equal the single-process gradient. Without
    ``normalizer_reduce`` each rank normalises by its own target sum and ``world_size`` only sets the
    default ``global_batch``.

    >>> criterion = DetectionLoss(nc=2, strides=[8.0], reg_max=4)
    >>> maps = [torch.zeros(1, 4 * 4 + 2, 4, 4, requires_grad=True)]
    >>> loss, items = criterion(maps, torch.zeros(1), torch.zeros(1, 1), torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    >>> loss.backward(); items.shape
    torch.Size([3])
    """

    def __init__(
        self,
        nc: int,
        strides: Tensor | Sequence[float],
        reg_max: int = 16,
        box: float = 7.5,
        cls: float = 0.5,
        dfl: float = 1.5,
        normalizer_reduce: Callable[[Tensor], Tensor] | None = None,
        world_size: int = 1,
    ) -> None:
        self.nc = nc
        self.strides = [float(s) for s in (strides.tolist() if isinstance(strides, Tensor) else strides)]
        self.reg_max = reg_max
        self.gains = (box, cls, dfl)
        self.normalizer_reduce = normalizer_reduce
        self.world_size = world_size
        self.assigner = TaskAlignedAssigner(topk=10, num_classes=nc, alpha=0.5, beta=6.0)
        self._anchor_cache: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}

    def __call__(
        self,
        head_maps: list[Tensor],
        batch_idx: Tensor,
        cls: Tensor,
        bboxes_xywhn: Tensor,
        global_batch: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Loss for head maps (B, 4*reg_max + nc, H_i, W_i) and flat labels; see the class docstring."""
        # a caller's autocast would run the DFL expectation (a matmul) in half precision: boxes off by
        # ~0.1 px and a noisy CIoU; the loss is cheap next to the model, so it always runs in float32
        with torch.autocast(head_maps[0].device.type, enabled=False):
            return self._loss(head_maps, batch_idx, cls, bboxes_xywhn, global_batch)

    def _loss(
        self, head_maps: list[Tensor], batch_idx: Tensor, cls: Tensor, bboxes_xywhn: Tensor, global_batch: int | None
    ) -> tuple[Tensor, Tensor]:
        batch = head_maps[0].shape[0]
        pred = torch.cat([m.reshape(batch, m.shape[1], -1) for m in head_maps], 2)
        if pred.dtype != torch.float64:  # half-precision maps (AMP) are scored in float32
            pred = pred.float()
        pred_distri, pred_logits = pred.permute(0, 2, 1).split((4 * self.reg_max, self.nc), -1)
        anchors, stride_per_anchor, proj = self._anchors(head_maps, pred.dtype, pred.device)

        # box = softmax expectation over reg_max bins per side, in feature units
        pred_dist = pred_distri.reshape(batch, -1, 4, self.reg_max)
        pred_bboxes = dist2bbox(pred_dist.softmax(-1) @ proj, anchors, xywh=False)

        img_h, img_w = (float(s) * self.strides[0] for s in head_maps[0].shape[2:])
        scale = pred.new_tensor([img_w, img_h, img_w, img_h])
        gt_cls, gt_boxes, mask_gt = pad_targets(
            batch_idx.to(pred.device), cls.to(pred), xywh2xyxy(bboxes_xywhn.to(pred) * scale), batch
        )
        target = self.assigner(
            pred_logits.detach().sigmoid(),
            pred_bboxes.detach() * stride_per_anchor,
            anchors * stride_per_anchor,
            gt_cls,
            gt_boxes,
            mask_gt,
        )

        normalizer = target.scores.sum()
        if self.normalizer_reduce is not None:
            # every rank must reach this collective, with or without boxes of its own
            normalizer = self.normalizer_reduce(normalizer.detach().clone())
        normalizer = normalizer.clamp(min=1.0)

        loss_cls = F.binary_cross_entropy_with_logits(pred_logits, target.scores, reduction="sum")
        fg = target.fg_mask
        if bool(fg.any()):
            weight = target.scores.sum(-1)[fg]
            target_bboxes = target.bboxes_xyxy / stride_per_anchor
            _, ciou = bbox_iou_ciou(pred_bboxes[fg], target_bboxes[fg])
            loss_box = ((1.0 - ciou.squeeze(-1)) * weight).sum()
            target_ltrb = bbox2dist(anchors, target_bboxes, self.reg_max)[fg]
            dfl = distribution_focal_loss(pred_dist[fg].reshape(-1, self.reg_max), target_ltrb.reshape(-1))
            loss_dfl = (dfl.reshape(-1, 4).mean(-1) * weight).sum()
        else:
            # zero but still attached to the box channels, so DDP sees every parameter take part
            loss_box = loss_dfl = pred_distri.sum() * 0.0

        scale_items = self.world_size if self.normalizer_reduce is not None else 1
        gains = pred.new_tensor(self.gains) * scale_items
        items = torch.stack((loss_box, loss_cls, loss_dfl)) / normalizer * gains
        if global_batch is None:
            global_batch = batch * self.world_size
        return items.sum() * global_batch, items.detach()

    def _anchors(self, head_maps: list[Tensor], dtype: torch.dtype, device: torch.device) -> tuple[Tensor, ...]:
        """Anchor points (N, 2), strides (N, 1) and the DFL projection, cached per feature shapes."""
        key = (tuple(tuple(m.shape[2:]) for m in head_maps), dtype, device)
        if key not in self._anchor_cache:
            shapes = [torch.empty(0, 0, *k, dtype=dtype, device=device) for k in key[0]]
            anchors, strides = make_anchors(shapes, torch.tensor(self.strides), 0.5)
            proj = torch.arange(self.reg_max, dtype=dtype, device=device)
            if len(self._anchor_cache) >= 8:  # multi-scale training: keep memory bounded
                self._anchor_cache.pop(next(iter(self._anchor_cache)))
            self._anchor_cache[key] = (anchors, strides, proj)
        return self._anchor_cache[key]
