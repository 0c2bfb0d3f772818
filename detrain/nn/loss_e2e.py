"""End-to-end (NMS-free) detection loss for a YOLO26-style head: box distances without DFL (``reg_max`` 1) and
two branches trained side by side.

The one-to-many branch learns as YOLOv8 does: each box teaches its 10 best-aligned anchors, which is what makes
training converge fast but leaves several detections per object (hence NMS). The one-to-one branch (fed detached
features by the head, so it cannot pull the backbone) picks 7 candidates per box in the same way, then keeps only
the single best-aligned one: one anchor per object, so its top-k detections need no NMS. The loss is
``w_o2m * L_o2m + w_o2o * L_o2o``, with the one-to-many weight falling linearly from 0.8 in the first epoch to 0.1
in the last (:func:`branch_weights`): early on the dense branch shapes the features, late the deployed branch
gets most of the signal. These are Ultralytics 8.4's rules for YOLO26 (``tests/unit/test_parity_loss_e2e.py``
checks loss and gradients against it when it is importable).

Each branch's terms are: BCE on the classes against the task-aligned soft targets, CIoU on the boxes, and, in
place of DFL, an L1 distance between the predicted and target (left, top, right, bottom) distances in units of
the image size. Each is normalised by the branch's sum of target scores; under DDP both sums are all-reduced in
one call (``score_sum`` is a (2,) tensor), exactly as :class:`detrain.nn.loss.DetectionLoss` does with its one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from detrain.nn.assigner import SparseAssignment, TaskAlignedAssigner, pair_overlap
from detrain.nn.boxes import bbox_iou_ciou, dist2bbox, make_anchors
from detrain.nn.head import Criterion
from detrain.nn.loss import LossGains, bce_with_logits_sum_sparse, host_targets, split_head_maps

ITEM_NAMES = ("box_loss", "cls_loss", "l1_loss")
O2M_TOPK = 10  # candidates per box, one-to-many branch
O2O_TOPK, O2O_KEEP = 7, 1  # one-to-one branch: candidates per box, then the best one kept
O2M_START, O2M_END = 0.8, 0.1  # one-to-many weight in the first and the last epoch


def branch_weights(epoch: float, epochs: int, start: float = O2M_START, end: float = O2M_END) -> tuple[float, float]:
    """(one-to-many, one-to-one) loss weights in ``epoch`` (0-based) of ``epochs``: the one-to-many weight is
    ``start`` in the first epoch and falls linearly to ``end`` in the last; the one-to-one weight is the rest of 1.

    >>> [tuple(round(w, 3) for w in branch_weights(e, 8)) for e in (0, 7, 20)]
    [(0.8, 0.2), (0.1, 0.9), (0.1, 0.9)]
    """
    o2m = start if epoch <= 0 else max(1 - epoch / max(epochs - 1, 1), 0) * (start - end) + end
    return o2m, max(1.0 - o2m, 0.0)


def keep_best_per_box(
    target: SparseAssignment,
    align: Tensor,
    iou: Tensor,
    boxes_per_image: int,
    keep: int,
    num_classes: int,
    eps: float = 1e-9,
) -> SparseAssignment:
    """``target`` with each box keeping only its ``keep`` best-aligned positive anchors, the target scores
    renormalised over those (the best one gets the box's best overlap among them).

    ``align`` and ``iou`` (P,) are the alignment and overlap of the P positive anchors, in ``fg_mask.nonzero()``
    order; ``boxes_per_image`` is the padded M of the assignment's ``gt_idx``; dropped anchors become background
    (label ``num_classes``).

    >>> fg = torch.tensor([[True, True, False]])
    >>> t = SparseAssignment(torch.tensor([[0, 0, 1]]), torch.ones(1, 3, 4), fg.float(), fg,
    ...                      torch.zeros(1, 3, dtype=torch.long))
    >>> out = keep_best_per_box(t, torch.tensor([0.2, 0.5]), torch.tensor([0.6, 0.8]), 1, keep=1, num_classes=1)
    >>> out.fg_mask.tolist(), [round(s, 3) for s in out.score[0].tolist()], out.labels.tolist()
    ([[False, True, False]], [0.0, 0.8, 0.0], [[1, 0, 1]])
    """
    b = target.fg_mask.shape[0]
    fg_img, fg_anchor = target.fg_mask.nonzero(as_tuple=True)
    box = fg_img * boxes_per_image + target.gt_idx[fg_img, fg_anchor]
    # rank each positive within its box by alignment, best first (two stable sorts: by alignment, then by box)
    order = torch.argsort(align, descending=True, stable=True)
    order = order[torch.argsort(box[order], stable=True)]
    sorted_box = box[order]
    counts = torch.bincount(sorted_box, minlength=b * boxes_per_image)
    rank = torch.arange(order.numel(), device=order.device) - (counts.cumsum(0) - counts)[sorted_box]
    kept = order[rank < keep]
    k_img, k_anchor, k_box = fg_img[kept], fg_anchor[kept], box[kept]
    k_align, k_iou = align[kept], iou[kept]
    max_align = k_align.new_zeros(b * boxes_per_image).scatter_reduce_(0, k_box, k_align, "amax")
    max_iou = k_iou.new_zeros(b * boxes_per_image).scatter_reduce_(0, k_box, k_iou, "amax")

    fg_mask = torch.zeros_like(target.fg_mask)
    fg_mask[k_img, k_anchor] = torch.ones_like(k_img, dtype=torch.bool)  # made on the device, not copied there
    score = torch.zeros_like(target.score)
    score[k_img, k_anchor] = (k_align * max_iou[k_box] / (max_align[k_box] + eps)).to(score.dtype)
    dropped = target.fg_mask & ~fg_mask  # the dropped anchors become background
    return SparseAssignment(
        target.labels.masked_fill(dropped, num_classes),
        target.bboxes_xyxy.masked_fill(dropped[..., None], 0.0),
        score,
        fg_mask,
        target.gt_idx.masked_fill(dropped, 0),
    )


class E2EHeadMaps(NamedTuple):
    """What an end-to-end head returns in training: per level (B, 4 + nc, H_i, W_i) raw maps of each branch
    (4 ltrb distances in strides, then nc class logits)."""

    one2many: list[Tensor]
    one2one: list[Tensor]


@dataclass(frozen=True)
class BranchTargets:
    """What :meth:`RegMax1BranchLoss.assign` decided for one branch: its predictions as the loss reads them,
    which anchor learns which box (``target``), and ``score_sum``, this rank's normaliser before the all-reduce."""

    batch: int
    pred_box: Tensor  # (B, N, 4) ltrb distances in strides
    pred_logits: Tensor  # (B, N, nc)
    anchors: Tensor  # (N, 2) in strides
    stride_per_anchor: Tensor  # (N, 1)
    imgsz_whwh: Tensor  # (4,) input width, height, width, height in pixels
    target: SparseAssignment
    score_sum: Tensor


class RegMax1BranchLoss:
    """Loss terms of one branch of a ``reg_max`` 1 head: ``assign`` then ``items`` (box, cls, L1, gains applied,
    divided by a normaliser, with gradient). ``keep`` < ``topk`` keeps only that many best-aligned anchors per box
    (the one-to-one branch keeps 1 of 7).

    >>> branch = RegMax1BranchLoss(nc=2, strides=[8.0], topk=7, keep=1, gains=LossGains(box=1.0, cls=1.0, dfl=1.0))
    >>> maps = [torch.ones(1, 6, 4, 4, requires_grad=True)]
    >>> t = branch.assign(maps, torch.zeros(1), torch.zeros(1, 1), torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    >>> int(t.target.fg_mask.sum()), branch.items(t, t.score_sum.clamp(min=1)).shape
    (1, torch.Size([3]))
    """

    def __init__(
        self,
        nc: int,
        strides: Tensor | Sequence[float],
        topk: int = O2M_TOPK,
        keep: int | None = None,
        *,
        gains: LossGains,
    ) -> None:
        self.nc = nc
        self.strides = [float(s) for s in (strides.tolist() if isinstance(strides, Tensor) else strides)]
        self.topk = topk
        self.keep = keep if keep is not None and keep < topk else None
        self.gains = (gains.box, gains.cls, gains.dfl)  # the dfl gain weighs the L1 term
        # boxes smaller than the middle stride are widened to it when candidate anchors are found (as Ultralytics)
        min_side = self.strides[1] if len(self.strides) > 1 else self.strides[0]
        self.assigner = TaskAlignedAssigner(topk=topk, num_classes=nc, alpha=0.5, beta=6.0, min_side=min_side)
        self._anchor_cache: dict[tuple, tuple[Tensor, Tensor]] = {}
        self._sizes: dict[tuple, Tensor] = {}  # the input's (4,) width, height, width, height, for the last size
        self._gains: Tensor | None = None  # the gains as a tensor, on the device

    def assign(self, head_maps: list[Tensor], batch_idx: Tensor, cls: Tensor, bboxes_xywhn: Tensor) -> BranchTargets:
        """Which anchors learn which boxes, for head maps (B, 4 + nc, H_i, W_i) and flat labels; in float32."""
        batch = head_maps[0].shape[0]
        pred_box, pred_logits = split_head_maps(head_maps, 4)
        if pred_logits.dtype != torch.float64:  # half-precision maps (AMP) are scored in float32
            pred_box, pred_logits = pred_box.float(), pred_logits.float()
        anchors, stride_per_anchor = self._anchors(head_maps, pred_logits.dtype, pred_logits.device)
        img_h, img_w = (float(s) * self.strides[0] for s in head_maps[0].shape[2:])
        key = (img_w, img_h, pred_logits.dtype, pred_logits.device)  # made once per size: no copy every step
        if key not in self._sizes:
            self._sizes = {key: pred_logits.new_tensor([img_w, img_h, img_w, img_h])}
        imgsz_whwh = self._sizes[key]
        # the ground truth padded and in pixels where the labels are (host memory in training), with the anchor points
        # there: the assigner finds the numbers of boxes and candidate pairs without waiting for the device
        image_whwh = torch.tensor([img_w, img_h, img_w, img_h], dtype=pred_logits.dtype, device=batch_idx.device)
        gt_cls, gt_boxes, mask_gt, host_points = host_targets(
            batch_idx, cls, bboxes_xywhn, batch, image_whwh, head_maps, self.strides
        )

        def boxes_at(img: Tensor, anchor: Tensor) -> Tensor:  # predicted boxes in pixels, only where asked
            dist = pred_box.detach()[img, anchor]
            return dist2bbox(dist, anchors[anchor], xywh=False) * stride_per_anchor[anchor]

        assigner = self.assigner
        target = assigner.assign_sparse(
            pred_logits.detach(),
            boxes_at,
            anchors * stride_per_anchor,
            gt_cls,
            gt_boxes,
            mask_gt,
            logits=True,
            host_anchor_points=host_points,
        )
        if self.keep is not None and target.fg_mask.any():
            # the alignment and overlap of each positive, as the assigner computed them, to pick the best per box
            img, anchor = target.fg_mask.nonzero(as_tuple=True)
            iou = pair_overlap(target.bboxes_xyxy[img, anchor], boxes_at(img, anchor))
            score = pred_logits.detach()[img, anchor, target.labels[img, anchor]].sigmoid()
            align = score.pow(assigner.alpha) * iou.pow(assigner.beta)
            target = keep_best_per_box(target, align, iou, gt_boxes.shape[1], self.keep, self.nc, assigner.eps)
        return BranchTargets(
            batch, pred_box, pred_logits, anchors, stride_per_anchor, imgsz_whwh, target, target.score.sum()
        )

    def items(self, t: BranchTargets, normalizer: Tensor) -> Tensor:
        """(3,) box, cls and L1 terms of ``t``, each times its gain and divided by ``normalizer``; with gradient."""
        target = t.target
        fg_img, fg_anchor = target.fg_mask.nonzero(as_tuple=True)
        weight, fg_labels = target.score[fg_img, fg_anchor], target.labels[fg_img, fg_anchor]
        loss_cls = bce_with_logits_sum_sparse(t.pred_logits, fg_img, fg_anchor, fg_labels, weight)
        if fg_img.numel():
            fg_box = t.pred_box[fg_img, fg_anchor]  # (F, 4) distances in strides
            fg_anchors, fg_strides = t.anchors[fg_anchor], t.stride_per_anchor[fg_anchor]
            target_bboxes = target.bboxes_xyxy[fg_img, fg_anchor] / fg_strides
            _, ciou = bbox_iou_ciou(dist2bbox(fg_box, fg_anchors, xywh=False), target_bboxes)
            loss_box = ((1.0 - ciou.squeeze(-1)) * weight).sum()
            # the distances in units of the image's width and height, so every level and size weighs alike
            target_ltrb = torch.cat((fg_anchors - target_bboxes[:, :2], target_bboxes[:, 2:] - fg_anchors), -1)
            l1 = (fg_box * fg_strides / t.imgsz_whwh - target_ltrb * fg_strides / t.imgsz_whwh).abs().mean(-1)
            loss_l1 = (l1 * weight).sum()
        else:
            # zero but still attached to the box channels, so DDP sees every parameter take part
            loss_box = loss_l1 = t.pred_box.sum() * 0.0
        like = t.pred_logits
        if self._gains is None or self._gains.dtype != like.dtype or self._gains.device != like.device:
            self._gains = like.new_tensor(self.gains)  # made once: no copy to the device every step
        return torch.stack((loss_box, loss_cls, loss_l1)) / normalizer * self._gains

    def _anchors(self, head_maps: list[Tensor], dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """Anchor points (N, 2) and strides (N, 1), cached per feature shapes."""
        key = (tuple(tuple(m.shape[2:]) for m in head_maps), dtype, device)
        if key not in self._anchor_cache:
            shapes = [torch.empty(0, 0, *k, dtype=dtype, device=device) for k in key[0]]
            if len(self._anchor_cache) >= 8:  # multi-scale training: keep memory bounded
                self._anchor_cache.pop(next(iter(self._anchor_cache)))
            self._anchor_cache[key] = make_anchors(shapes, torch.tensor(self.strides), 0.5)
        return self._anchor_cache[key]


@dataclass(frozen=True)
class E2ETargets:
    """Both branches' targets; ``score_sum`` (2,) is this rank's [one-to-many, one-to-one] normalisers, all-reduced
    (SUM) in one call before :meth:`EndToEndLoss.score`."""

    one2many: BranchTargets
    one2one: BranchTargets
    score_sum: Tensor


class EndToEndLoss(Criterion):
    """End-to-end detection loss over an end-to-end head's raw maps (:class:`E2EHeadMaps`).

    ``loss, items = criterion(head_maps, batch_idx, cls, bboxes_xywhn)``: ``loss`` is ``(w_o2m * sum(o2m terms) +
    w_o2o * sum(o2o terms)) * global batch``, with gradient; ``items`` are the one-to-one branch's detached (3,)
    [box, cls, l1] terms (named in ``item_names``), each times its gain: the branch that is deployed, so its
    terms are what the log follows (as Ultralytics logs them). Call ``set_epoch`` at every epoch's start; the
    weights then follow :func:`branch_weights`.

    Distributed: as :class:`detrain.nn.loss.DetectionLoss`: ``assign``, all-reduce (SUM) its ``score_sum`` (here
    (2,), both branches at once) on every rank at every step, and give the result to ``score``; or give
    ``normalizer_reduce`` and call the loss.

    >>> criterion = EndToEndLoss(nc=2, strides=[8.0], epochs=10, gains=LossGains(box=1.0, cls=1.0, dfl=1.0))
    >>> maps = E2EHeadMaps([torch.ones(1, 6, 4, 4, requires_grad=True)], [torch.ones(1, 6, 4, 4, requires_grad=True)])
    >>> criterion.set_epoch(9); criterion.weights
    (0.1, 0.9)
    >>> loss, items = criterion(maps, torch.zeros(1), torch.zeros(1, 1), torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    >>> loss.backward(); criterion.item_names, items.shape
    (('box_loss', 'cls_loss', 'l1_loss'), torch.Size([3]))
    """

    item_names = ITEM_NAMES

    def __init__(
        self,
        nc: int,
        strides: Tensor | Sequence[float],
        epochs: int,
        *,
        gains: LossGains,
        normalizer_reduce: Callable[[Tensor], Tensor] | None = None,
        world_size: int = 1,
        o2m_start: float = O2M_START,
        o2m_end: float = O2M_END,
    ) -> None:
        self.one2many = RegMax1BranchLoss(nc, strides, topk=O2M_TOPK, gains=gains)
        self.one2one = RegMax1BranchLoss(nc, strides, topk=O2O_TOPK, keep=O2O_KEEP, gains=gains)
        self.epochs = epochs
        self.o2m_start, self.o2m_end = o2m_start, o2m_end
        self.normalizer_reduce = normalizer_reduce
        self.world_size = world_size
        self.weights = branch_weights(0, epochs, o2m_start, o2m_end)

    def set_epoch(self, epoch: float) -> None:
        """Weigh the branches for ``epoch`` (0-based); a resumed run calls it with its first epoch."""
        self.weights = branch_weights(epoch, self.epochs, self.o2m_start, self.o2m_end)

    # assign and score: the template's (detrain.nn.head.Criterion), both branches under one autocast-free section
    def _assign(self, head_maps: E2EHeadMaps, batch_idx: Tensor, cls: Tensor, bboxes_xywhn: Tensor) -> E2ETargets:
        o2m = self.one2many.assign(head_maps.one2many, batch_idx, cls, bboxes_xywhn)
        o2o = self.one2one.assign(head_maps.one2one, batch_idx, cls, bboxes_xywhn)
        return E2ETargets(o2m, o2o, torch.stack((o2m.score_sum, o2o.score_sum)))

    def _score(
        self, targets: E2ETargets, summed_scores: Tensor | None, global_batch: int | None
    ) -> tuple[Tensor, Tensor]:
        # summed_scores (2,): each branch's target scores summed over every rank
        normalizer = (targets.score_sum if summed_scores is None else summed_scores).clamp(min=1.0)
        scale_items = self.world_size if summed_scores is not None else 1
        o2m = self.one2many.items(targets.one2many, normalizer[0]) * scale_items
        o2o = self.one2one.items(targets.one2one, normalizer[1]) * scale_items
        if global_batch is None:
            global_batch = targets.one2one.batch * self.world_size
        w_o2m, w_o2o = self.weights
        return (o2m.sum() * w_o2m + o2o.sum() * w_o2o) * global_batch, o2o.detach()
