"""Task-aligned assignment of anchors to ground-truth boxes (TOOD, as used by YOLOv8).

Each ground-truth box picks the ``topk`` anchors whose centre lies inside it and whose prediction is best
aligned with it, where alignment = ``score[gt class] ** alpha * IoU(pred, gt) ** beta``. The soft target
of a positive anchor is its alignment, rescaled per box so that the best-aligned anchor of a box gets that
box's best IoU. Everything is computed on padded (B, M, N) tensors, with no Python loop over images,
boxes or anchors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class Assignment(NamedTuple):
    """Targets for every anchor; background anchors have ``fg_mask`` False.

    ``labels`` (B, N) long: class of the assigned box, ``num_classes`` on background.
    ``bboxes_xyxy`` (B, N, 4): assigned box in pixels, zeros on background.
    ``scores`` (B, N, nc): one-hot class times the normalised alignment, zeros on background.
    ``fg_mask`` (B, N) bool. ``gt_idx`` (B, N) long: index of the assigned box in the padded M axis.
    """

    labels: Tensor
    bboxes_xyxy: Tensor
    scores: Tensor
    fg_mask: Tensor
    gt_idx: Tensor


def _iou_xyxy(box1: Tensor, box2: Tensor, eps: float = 1e-9) -> Tensor:
    """Element-wise plain IoU of (K, 4) xyxy boxes, (K,). ``_iou_xyxy(b, b)`` is 1 for non-empty ``b``."""
    inter_wh = (torch.minimum(box1[:, 2:], box2[:, 2:]) - torch.maximum(box1[:, :2], box2[:, :2])).clamp(0)
    inter = inter_wh[:, 0] * inter_wh[:, 1]
    area1 = (box1[:, 2:] - box1[:, :2]).clamp(0).prod(-1)
    area2 = (box2[:, 2:] - box2[:, :2]).clamp(0).prod(-1)
    return inter / (area1 + area2 - inter + eps)


def anchors_inside_boxes(anchor_points: Tensor, gt_bboxes_xyxy: Tensor, eps: float = 1e-9) -> Tensor:
    """(B, M, N) bool: anchor centre strictly inside the box.

    >>> anchors_inside_boxes(torch.tensor([[1., 1], [5, 5]]), torch.tensor([[[0., 0, 2, 2]]])).tolist()
    [[[True, False]]]
    """
    ax, ay = anchor_points[:, 0], anchor_points[:, 1]
    x1, y1, x2, y2 = (gt_bboxes_xyxy[..., i, None] for i in range(4))
    # four broadcast comparisons instead of a (B, M, N, 4) distance tensor: a quarter of the memory
    return (ax - x1 > eps) & (ay - y1 > eps) & (x2 - ax > eps) & (y2 - ay > eps)


class TaskAlignedAssigner:
    """Assign anchors to ground-truth boxes by task alignment; call it under any grad mode, it uses none.

    >>> assigner = TaskAlignedAssigner(topk=2, num_classes=1)
    >>> anchors = torch.tensor([[4., 4], [12, 4], [20, 4]])
    >>> scores = torch.tensor([[[0.9], [0.5], [0.1]]])
    >>> boxes = torch.tensor([[[0., 0, 16, 8]] * 3])
    >>> gt = torch.tensor([[[0., 0, 16, 8]]])
    >>> out = assigner(scores, boxes, anchors, torch.zeros(1, 1, 1), gt, torch.ones(1, 1, 1, dtype=torch.bool))
    >>> out.fg_mask.tolist()
    [[True, True, False]]
    """

    def __init__(
        self, topk: int = 10, num_classes: int = 80, alpha: float = 0.5, beta: float = 6.0, eps: float = 1e-9
    ) -> None:
        self.topk = topk
        self.num_classes = num_classes
        self.alpha = alpha
        self.beta = beta
        self.eps = eps

    @torch.no_grad()
    def __call__(
        self,
        pd_scores: Tensor,
        pd_bboxes_xyxy: Tensor,
        anchor_points: Tensor,
        gt_labels: Tensor,
        gt_bboxes_xyxy: Tensor,
        mask_gt: Tensor,
    ) -> Assignment:
        """Assign targets.

        ``pd_scores`` (B, N, nc) sigmoid scores, ``pd_bboxes_xyxy`` (B, N, 4) and ``anchor_points`` (N, 2) in
        pixels; ``gt_labels`` (B, M, 1), ``gt_bboxes_xyxy`` (B, M, 4) and ``mask_gt`` (B, M, 1) padded to M.
        """
        b, n, _ = pd_scores.shape
        m = gt_bboxes_xyxy.shape[1]
        if m == 0:
            return self._background(pd_scores, pd_bboxes_xyxy)

        mask_gt = mask_gt.reshape(b, m, 1).bool()
        labels = gt_labels.reshape(b, m).long()
        candidates = anchors_inside_boxes(anchor_points, gt_bboxes_xyxy, self.eps) & mask_gt  # (B, M, N)

        overlaps, align_metric = self._alignment(pd_scores, pd_bboxes_xyxy, labels, gt_bboxes_xyxy, candidates)

        # top-k by alignment per box; picks outside the candidates (ties at zero) are dropped by the mask
        k = min(self.topk, n)
        topk_idx = align_metric.topk(k, dim=-1).indices
        mask_pos = torch.zeros_like(candidates).scatter_(-1, topk_idx, True) & candidates  # (B, M, N)

        # an anchor claimed by several boxes goes to the one its prediction overlaps most; boxes that did
        # not claim it score -1 so they never win
        gt_idx = torch.where(mask_pos, overlaps, -1.0).argmax(1)  # (B, N)
        fg_mask = mask_pos.any(1)
        gt_idx = gt_idx * fg_mask  # background points at box 0, harmlessly (everything below is masked)

        # normalise per box: its best-aligned anchor gets the box's best IoU. Per-anchor values and per-box
        # maxima via scatter keep this at (B, N) and (B, M) instead of another pass over (B, M, N).
        metric = align_metric.gather(1, gt_idx[:, None]).squeeze(1) * fg_mask
        iou = overlaps.gather(1, gt_idx[:, None]).squeeze(1) * fg_mask
        max_metric = metric.new_zeros(b, m).scatter_reduce_(1, gt_idx, metric, "amax")
        max_iou = iou.new_zeros(b, m).scatter_reduce_(1, gt_idx, iou, "amax")
        norm_align = metric * max_iou.gather(1, gt_idx) / (max_metric.gather(1, gt_idx) + self.eps)

        target_labels = labels.gather(1, gt_idx)
        target_bboxes = gt_bboxes_xyxy.gather(1, gt_idx[..., None].expand(-1, -1, 4)) * fg_mask[..., None]
        target_scores = torch.zeros_like(pd_scores).scatter_(
            -1, target_labels[..., None], norm_align[..., None].to(pd_scores.dtype)
        )
        target_labels = target_labels.masked_fill(~fg_mask, self.num_classes)
        return Assignment(target_labels, target_bboxes, target_scores, fg_mask, gt_idx)

    def _alignment(
        self, pd_scores: Tensor, pd_bboxes: Tensor, labels: Tensor, gt_bboxes: Tensor, candidates: Tensor
    ) -> tuple[Tensor, Tensor]:
        """IoU and alignment metric (B, M, N), zero outside the candidates.

        Both are computed only at candidate pairs, typically a small fraction of the B*M*N, then scattered.
        """
        b, m, n = candidates.shape
        img, box, anchor = candidates.nonzero(as_tuple=True)
        iou = _iou_xyxy(gt_bboxes[img, box], pd_bboxes[img, anchor]).clamp_(0)
        score = pd_scores[img, anchor, labels[img, box]]
        overlaps = pd_bboxes.new_zeros(b, m, n)
        align_metric = pd_bboxes.new_zeros(b, m, n)
        overlaps[img, box, anchor] = iou.to(overlaps.dtype)
        align_metric[img, box, anchor] = (score.pow(self.alpha) * iou.pow(self.beta)).to(overlaps.dtype)
        return overlaps, align_metric

    def _background(self, pd_scores: Tensor, pd_bboxes: Tensor) -> Assignment:
        """Every anchor is background (no ground truth in the batch)."""
        b, n, _ = pd_scores.shape
        device = pd_scores.device
        return Assignment(
            torch.full((b, n), self.num_classes, dtype=torch.long, device=device),
            torch.zeros_like(pd_bboxes),
            torch.zeros_like(pd_scores),
            torch.zeros(b, n, dtype=torch.bool, device=device),
            torch.zeros(b, n, dtype=torch.long, device=device),
        )
