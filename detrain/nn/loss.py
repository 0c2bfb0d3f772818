"""Detection loss: BCE classification + CIoU box + distribution focal loss, on task-aligned targets.

The three components are normalised by the sum of the soft target scores. Under DDP that sum is
all-reduced so that W ranks holding B/W images each produce, after DDP's gradient averaging, exactly the gradient
one process would get on all B images. The trainer calls the two halves itself, with the all-reduce between them in
plain sight (``assign``, then ``dist.all_reduce_sum`` of the scores' sum, then ``score``); calling the loss does
both, with ``normalizer_reduce`` as the all-reduce (the template of :class:`detrain.nn.head.Criterion`).

The YOLO heads' gains (:data:`YOLO_GAINS`, :class:`LossGains`) are the config's loss section: ``box``, ``cls`` and
``dfl``, their defaults in ``config/keys.py`` only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import Tensor

from detrain.config.keys import Loss
from detrain.nn.assigner import SparseAssignment, TaskAlignedAssigner
from detrain.nn.boxes import bbox2dist, bbox_iou_ciou, dist2bbox, make_anchors, xywh2xyxy
from detrain.nn.head import Criterion
from detrain.nn.memory_format import memory_format_of

#: the gains YOLOv8's, YOLO11's and YOLO26's losses take, with their defaults: the config's loss section
YOLO_GAINS: Mapping[str, float] = MappingProxyType(asdict(Loss()))


@dataclass(frozen=True)
class LossGains:
    """The YOLO losses' per-term gains (the ``box``, ``cls`` and ``dfl`` keys): the third weighs DFL for a ``reg_max``
    > 1 head and the L1 distance term for a ``reg_max`` 1 head, as Ultralytics' ``dfl`` gain does. No defaults here:
    the run's come from its config, whose ``loss`` section holds the one copy of the default gains.

    >>> LossGains.of({"box": 1.0, "cls": 2.0, "dfl": 3.0})
    LossGains(box=1.0, cls=2.0, dfl=3.0)
    """

    box: float
    cls: float
    dfl: float

    @classmethod
    def of(cls, gains: Mapping[str, float]) -> LossGains:
        """The three gains of a head's mapping (:func:`detrain.nn.head.head_gains`)."""
        return cls(box=gains["box"], cls=gains["cls"], dfl=gains["dfl"])


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


def host_targets(
    batch_idx: Tensor,
    cls: Tensor,
    bboxes_xywhn: Tensor,
    batch_size: int,
    image_whwh: Tensor,
    head_maps: Sequence[Tensor],
    strides: Sequence[float] | Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The ground truth padded ((B, M, 1) classes, (B, M, 4) xyxy boxes in pixels, (B, M, 1) mask) and the anchor
    points in pixels (N, 2), all where the labels are (the loader's host memory in training) and in
    ``image_whwh``'s dtype: what ``TaskAlignedAssigner.assign_sparse`` reads to find the real boxes and candidate
    pairs without waiting for the device. ``image_whwh``: the input's (4,) width, height, width, height there."""
    dtype, host = image_whwh.dtype, batch_idx.device
    gt_cls, gt_boxes, mask_gt = pad_targets(batch_idx, cls.to(dtype), bboxes_xywhn.to(dtype), batch_size)
    gt_boxes = xywh2xyxy(gt_boxes * image_whwh)
    # the anchor points made afresh there (a few hundred microseconds on the host)
    points, point_strides = make_anchors(
        [torch.empty(0, 0, *m.shape[2:], dtype=dtype, device=host) for m in head_maps], strides
    )
    return gt_cls, gt_boxes, mask_gt, points * point_strides


def pad_targets(batch_idx: Tensor, cls: Tensor, bboxes: Tensor, batch_size: int) -> tuple[Tensor, Tensor, Tensor]:
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


class _SplitHeadMaps(torch.autograd.Function):
    """Head maps (B, C, H_i, W_i) -> box (B, N, nb) and class (B, N, C - nb) logits, each contiguous.

    A channels_last map already is (B, H, W, C) in memory, so each part is gathered by one strided copy.
    The backward writes both gradients straight into one buffer per map, in the map's own memory layout:
    every level's gradient is then dense per image, so the head's last 1x1 convolutions take it as is.
    """

    @staticmethod
    def forward(ctx, nb: int, *maps: Tensor) -> tuple[Tensor, Tensor]:
        b = maps[0].shape[0]
        rows = [m.permute(0, 2, 3, 1).reshape(b, -1, m.shape[1]) for m in maps]  # views for channels_last
        ctx.nb = nb
        ctx.maps = [(m.shape, m.dtype, m.device, memory_format_of(m)) for m in maps]
        return torch.cat([r[..., :nb] for r in rows], 1), torch.cat([r[..., nb:] for r in rows], 1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_box: Tensor | None, grad_cls: Tensor | None) -> tuple[Tensor | None, ...]:
        grads: list[Tensor | None] = [None]
        start = 0
        for shape, dtype, device, layout in ctx.maps:
            _, _, h, w = shape
            grad = torch.empty(shape, dtype=dtype, device=device, memory_format=layout)
            rows = grad.permute(0, 2, 3, 1)  # (B, H, W, C) view
            for part, g in ((rows[..., : ctx.nb], grad_box), (rows[..., ctx.nb :], grad_cls)):
                if g is None:
                    part.zero_()
                else:
                    part.copy_(g[:, start : start + h * w].unflatten(1, (h, w)))
            grads.append(grad)
            start += h * w
        return tuple(grads)


def split_head_maps(head_maps: list[Tensor], nb: int) -> tuple[Tensor, Tensor]:
    """Head maps (B, C, H_i, W_i) -> (B, N, nb) and (B, N, C - nb), anchors in ``make_anchors`` order.

    Both parts come out contiguous, with one read of the maps and, in the backward, one write per map.

    >>> maps = [torch.arange(8.).reshape(1, 2, 2, 2), torch.zeros(1, 2, 1, 1)]
    >>> box, cls = split_head_maps(maps, 1)
    >>> box[0, :, 0].tolist(), cls.shape
    ([0.0, 1.0, 2.0, 3.0, 0.0], torch.Size([1, 5, 1]))
    """
    return _SplitHeadMaps.apply(nb, *head_maps)


class _SparseTargetBCE(torch.autograd.Function):
    """Sum of BCE-with-logits over every logit, against targets that are zero except at K given entries.

    BCE(x, t) = softplus(x) - t * x, so the sum is one dense softplus pass plus a K-term correction; the
    gradient sigmoid(x) - t is one dense pass with the K targets subtracted in place.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, img: Tensor, anchor: Tensor, label: Tensor, target: Tensor) -> Tensor:
        ctx.save_for_backward(logits, img, anchor, label, target)
        return F.softplus(logits).sum() - (logits[img, anchor, label] * target).sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        logits, img, anchor, label, target = ctx.saved_tensors
        out = torch.sigmoid(logits)
        out.index_put_((img, anchor, label), -target, accumulate=True)
        return out.mul_(grad), None, None, None, None


def bce_with_logits_sum_sparse(logits: Tensor, img: Tensor, anchor: Tensor, label: Tensor, target: Tensor) -> Tensor:
    """``F.binary_cross_entropy_with_logits(logits, t, reduction="sum")`` for the (B, N, nc) ``t`` that is
    zero except ``t[img, anchor, label] = target`` (distinct positions), without building ``t``.

    >>> x, t = torch.randn(2, 5, 3), torch.zeros(2, 5, 3)
    >>> t[1, 2, 0] = 0.7
    >>> i, a, c = (torch.tensor([v]) for v in (1, 2, 0))
    >>> ours = bce_with_logits_sum_sparse(x, i, a, c, torch.tensor([0.7]))
    >>> torch.allclose(ours, F.binary_cross_entropy_with_logits(x, t, reduction="sum"))
    True
    """
    return _SparseTargetBCE.apply(logits, img, anchor, label, target.to(logits.dtype))


@dataclass(frozen=True)
class Targets:
    """What ``DetectionLoss.assign`` decided for one batch: the predictions as the loss reads them, which anchor
    learns which box (``target``), and ``score_sum``, this rank's sum of the soft target scores: the loss's
    normaliser before it is summed over the ranks."""

    batch: int
    pred_distri: Tensor
    pred_logits: Tensor
    anchors: Tensor
    stride_per_anchor: Tensor
    proj: Tensor
    target: SparseAssignment
    score_sum: Tensor


class DetectionLoss(Criterion):
    """YOLOv8-style detection loss over raw head maps.

    ``loss, items = criterion(head_maps, batch_idx, cls, bboxes_xywhn)``: ``items`` is the detached (3,)
    [box, cls, dfl], each times its gain; ``loss`` is their sum times the global batch size, with gradient.
    Class ids must lie in [0, nc).

    Distributed: give ``world_size`` and either call ``assign``, all-reduce (SUM) its ``score_sum`` on every rank
    at every step, and give the result to ``score`` (as the trainer does), or give ``normalizer_reduce`` (that
    all-reduce) and call the loss. Each rank's items are then its share of the global sums times ``world_size``,
    so their mean over ranks is the single-process value, and ``global_batch`` (default local batch *
    ``world_size``) makes DDP's gradient average equal the single-process gradient. Without a summed normaliser
    each rank normalises by its own target sum and ``world_size`` only sets the default ``global_batch``.

    >>> criterion = DetectionLoss(nc=2, strides=[8.0], reg_max=4, gains=LossGains(box=1.0, cls=1.0, dfl=1.0))
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
        *,
        gains: LossGains,
        normalizer_reduce: Callable[[Tensor], Tensor] | None = None,
        world_size: int = 1,
    ) -> None:
        self.nc = nc
        self.strides = [float(s) for s in (strides.tolist() if isinstance(strides, Tensor) else strides)]
        self.reg_max = reg_max
        self.gains = (gains.box, gains.cls, gains.dfl)
        self.normalizer_reduce = normalizer_reduce
        self.world_size = world_size
        # boxes smaller than the middle stride are widened to it when candidate anchors are found (as Ultralytics)
        min_side = self.strides[1] if len(self.strides) > 1 else self.strides[0]
        self.assigner = TaskAlignedAssigner(topk=10, num_classes=nc, alpha=0.5, beta=6.0, min_side=min_side)
        self._anchor_cache: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}
        self._constants: dict[tuple, Tensor] = {}  # _cached's

    item_names = ("box_loss", "cls_loss", "dfl_loss")

    # assign and score (the template's, in float32: autocast would run the DFL expectation, a matmul, in half
    # precision, boxes off by ~0.1 px and a noisy CIoU) for head maps (B, 4*reg_max + nc, H_i, W_i)
    def _assign(self, head_maps: list[Tensor], batch_idx: Tensor, cls: Tensor, bboxes_xywhn: Tensor) -> Targets:
        batch = head_maps[0].shape[0]
        # box logits (B, N, 4 * reg_max) are only ever read at a few rows; the class logits (B, N, nc) go
        # through a dense softplus, several times faster on contiguous memory than on a strided view
        pred_distri, pred_logits = split_head_maps(head_maps, 4 * self.reg_max)
        if pred_logits.dtype != torch.float64:  # half-precision maps (AMP) are scored in float32
            pred_distri, pred_logits = pred_distri.float(), pred_logits.float()
        anchors, stride_per_anchor, proj = self._anchors(head_maps, pred_logits.dtype, pred_logits.device)

        # the ground truth padded and in pixels where the labels are (the loader's host memory in training), so
        # that the assigner finds the real boxes and the candidate pairs there: no device sync for their numbers
        image_whwh = self._image_size(head_maps, pred_logits.dtype, batch_idx.device)
        gt_cls, gt_boxes, mask_gt, host_points = host_targets(
            batch_idx, cls, bboxes_xywhn, batch, image_whwh, head_maps, self.strides
        )

        def boxes_at(img: Tensor, anchor: Tensor) -> Tensor:  # predicted boxes in pixels, only where asked
            dist = self._decode(pred_distri.detach()[img, anchor], proj)
            return dist2bbox(dist, anchors[anchor], xywh=False) * stride_per_anchor[anchor]

        # the assigner reads scores and boxes only at candidate pairs: no dense sigmoid or box decode
        target = self.assigner.assign_sparse(
            pred_logits.detach(),
            boxes_at,
            anchors * stride_per_anchor,
            gt_cls,
            gt_boxes,
            mask_gt,
            logits=True,
            host_anchor_points=host_points,
        )
        return Targets(batch, pred_distri, pred_logits, anchors, stride_per_anchor, proj, target, target.score.sum())

    def _score(self, targets: Targets, summed_scores: Tensor | None, global_batch: int | None) -> tuple[Tensor, Tensor]:
        t = targets
        target, pred_distri, pred_logits = t.target, t.pred_distri, t.pred_logits
        anchors, stride_per_anchor, proj = t.anchors, t.stride_per_anchor, t.proj
        normalizer = (t.score_sum if summed_scores is None else summed_scores).clamp(min=1.0)

        fg_img, fg_anchor = target.fg_mask.nonzero(as_tuple=True)
        weight = target.score[fg_img, fg_anchor]
        loss_cls = bce_with_logits_sum_sparse(pred_logits, fg_img, fg_anchor, target.labels[fg_img, fg_anchor], weight)
        if fg_img.numel():
            # box and DFL terms only at the foreground anchors
            fg_distri = pred_distri[fg_img, fg_anchor]  # (F, 4 * reg_max)
            fg_anchors, fg_strides = anchors[fg_anchor], stride_per_anchor[fg_anchor]
            pred_bboxes = dist2bbox(self._decode(fg_distri, proj), fg_anchors, xywh=False)
            target_bboxes = target.bboxes_xyxy[fg_img, fg_anchor] / fg_strides
            _, ciou = bbox_iou_ciou(pred_bboxes, target_bboxes)
            loss_box = ((1.0 - ciou.squeeze(-1)) * weight).sum()
            target_ltrb = bbox2dist(fg_anchors, target_bboxes, self.reg_max)
            dfl = distribution_focal_loss(fg_distri.reshape(-1, self.reg_max), target_ltrb.reshape(-1))
            loss_dfl = (dfl.reshape(-1, 4).mean(-1) * weight).sum()
        else:
            # zero but still attached to the box channels, so DDP sees every parameter take part
            loss_box = loss_dfl = pred_distri.sum() * 0.0

        scale_items = self.world_size if summed_scores is not None else 1
        gains = self._cached(
            ("gains", scale_items), pred_logits, lambda: pred_logits.new_tensor(self.gains) * scale_items
        )
        items = torch.stack((loss_box, loss_cls, loss_dfl)) / normalizer * gains
        if global_batch is None:
            global_batch = t.batch * self.world_size
        return items.sum() * global_batch, items.detach()

    def _decode(self, distri: Tensor, proj: Tensor) -> Tensor:
        """(K, 4 * reg_max) DFL logits -> (K, 4) distances: the softmax expectation over bins, per side."""
        return distri.reshape(-1, 4, self.reg_max).softmax(-1) @ proj

    def _image_size(self, head_maps: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
        """(4,) the input's width, height, width, height in pixels, as ``dtype`` on ``device`` (cached)."""
        img_h, img_w = (float(s) * self.strides[0] for s in head_maps[0].shape[2:])
        like = torch.empty(0, dtype=dtype, device=device)
        return self._cached(("size", img_w, img_h), like, lambda: like.new_tensor([img_w, img_h, img_w, img_h]))

    def _cached(self, key: tuple, like: Tensor, make: Callable[[], Tensor]) -> Tensor:
        """``make()``, kept per ``key`` and ``like``'s dtype and device: a tensor made from Python numbers on a GPU
        is a copy the host waits for, which every step would otherwise make again (a few entries: multi-scale sizes)."""
        full = (*key, like.dtype, like.device)
        if full not in self._constants:
            if len(self._constants) >= 16:
                self._constants.pop(next(iter(self._constants)))
            self._constants[full] = make()
        return self._constants[full]

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
