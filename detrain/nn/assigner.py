"""Task-aligned assignment of anchors to ground-truth boxes (TOOD, as used by YOLOv8).

Each ground-truth box picks the ``topk`` anchors whose centre lies inside it and whose prediction is best
aligned with it, where alignment = ``score[gt class] ** alpha * overlap(pred, gt) ** beta`` and the overlap
is the Complete IoU clamped at 0 (the quantity the box loss optimises, so the assigner ranks predictions by
what the loss rewards). A box side shorter than ``min_side`` (the middle stride, 16 px for YOLOv8) is
widened to it about the box centre when candidates are found, so that a small object still has anchor
centres inside it on the finer levels; the targets keep the real box. An anchor claimed by several boxes
goes to the box its prediction overlaps most among all boxes it lies inside. The soft target of a positive
anchor is its alignment, rescaled per box so that the best-aligned anchor of a box gets that box's best
overlap. These are the rules of Ultralytics' current assigner (``tests/unit/test_parity_loss.py`` checks the
loss and its gradients against it when it is importable).

Candidates are found on (V, N) tensors for the V real (unpadded) boxes; predictions are read only at
candidate (box, anchor) pairs, and everything after the per-box top-k works on the at most V * topk positive
pairs. There is no Python loop over images, boxes or anchors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from detrain.nn.boxes import bbox_iou_ciou


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


class SparseAssignment(NamedTuple):
    """:class:`Assignment` without the dense (B, N, nc) scores: one target score per anchor instead.

    ``score`` (B, N): the normalised alignment of the anchor's assigned box, zero on background; the
    dense ``scores`` of :class:`Assignment` are this value at ``labels`` and zero at every other class.
    The other fields are as in :class:`Assignment`.
    """

    labels: Tensor
    bboxes_xyxy: Tensor
    score: Tensor
    fg_mask: Tensor
    gt_idx: Tensor


class _RealBoxes(NamedTuple):
    """The V real boxes of a padded batch (V of its B * M slots): image, slot in M, class (long), xyxy corners."""

    img: Tensor
    slot: Tensor
    labels: Tensor
    xyxy: Tensor


BoxesAt = Callable[[Tensor, Tensor], Tensor]
"""``boxes(img, anchor) -> (K, 4)`` predicted xyxy boxes in pixels at K (image, anchor) index pairs."""


def pair_overlap(gt_xyxy: Tensor, pd_xyxy: Tensor) -> Tensor:
    """Element-wise CIoU of (K, 4) xyxy boxes clamped at 0, (K,): the assigner's overlap measure.

    >>> pair_overlap(torch.tensor([[0., 0, 4, 4], [0, 0, 4, 4]]), torch.tensor([[0., 0, 4, 4], [8, 8, 9, 9]])).tolist()
    [1.0, 0.0]
    """
    return bbox_iou_ciou(gt_xyxy, pd_xyxy)[1].squeeze(-1).clamp_(0)


def widen_small_boxes(boxes_xyxy: Tensor, min_side: float) -> Tensor:
    """(..., 4) xyxy boxes with every side shorter than ``min_side`` widened to it about the box centre.

    >>> widen_small_boxes(torch.tensor([[10., 10, 14, 40]]), 16.0).tolist()
    [[4.0, 10.0, 20.0, 40.0]]
    """
    if min_side <= 0:
        return boxes_xyxy
    centre = (boxes_xyxy[..., :2] + boxes_xyxy[..., 2:]) / 2
    size = boxes_xyxy[..., 2:] - boxes_xyxy[..., :2]
    half = torch.where(size < min_side, size.new_tensor(min_side), size) / 2
    return torch.cat((centre - half, centre + half), -1)


def anchors_inside_boxes(anchor_points: Tensor, gt_bboxes_xyxy: Tensor, eps: float = 1e-9) -> Tensor:
    """(B, M, N) bool: anchor centre strictly inside the box.

    >>> anchors_inside_boxes(torch.tensor([[1., 1], [5, 5]]), torch.tensor([[[0., 0, 2, 2]]])).tolist()
    [[[True, False]]]
    """
    ax, ay = anchor_points[:, 0], anchor_points[:, 1]
    x1, y1, x2, y2 = (gt_bboxes_xyxy[..., i, None] for i in range(4))
    # four broadcast comparisons instead of a (B, M, N, 4) distance tensor: a quarter of the memory
    inside = ax - x1 > eps
    inside &= ay - y1 > eps
    inside &= x2 - ax > eps
    inside &= y2 - ay > eps
    return inside


class TaskAlignedAssigner:
    """Assign anchors to ground-truth boxes by task alignment; call it under any grad mode, it uses none.

    ``min_side``: sides shorter than this are widened to it when candidates are found (0 = off); the loss
    passes its middle stride, as Ultralytics does.

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
        self,
        topk: int = 10,
        num_classes: int = 80,
        alpha: float = 0.5,
        beta: float = 6.0,
        eps: float = 1e-9,
        min_side: float = 0.0,
    ) -> None:
        self.topk = topk
        self.min_side = float(min_side)
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
        out = self.assign_sparse(pd_scores, pd_bboxes_xyxy, anchor_points, gt_labels, gt_bboxes_xyxy, mask_gt)
        scores = torch.zeros_like(pd_scores)
        fg = out.fg_mask
        scores[fg, out.labels[fg]] = out.score[fg].to(scores.dtype)
        return Assignment(out.labels, out.bboxes_xyxy, scores, fg, out.gt_idx)

    @torch.no_grad()
    def assign_sparse(
        self,
        pd_scores: Tensor,
        pd_bboxes_xyxy: Tensor | BoxesAt,
        anchor_points: Tensor,
        gt_labels: Tensor,
        gt_bboxes_xyxy: Tensor,
        mask_gt: Tensor,
        logits: bool = False,
    ) -> SparseAssignment:
        """Assign targets, reading predictions only where an anchor centre lies inside a box.

        Arguments as for ``__call__``, except: ``pd_scores`` may be raw logits (``logits=True``; the sigmoid is
        then taken only at the candidate pairs) and need not be contiguous, and ``pd_bboxes_xyxy`` may be a
        function ``(img, anchor) -> (K, 4)`` that decodes boxes only at the K candidate pairs. Everything
        past the candidates works on the at most B * M * topk positive pairs, never on another (B, N, nc).
        """
        b, n, _ = pd_scores.shape
        m = gt_bboxes_xyxy.shape[1]
        device = pd_scores.device
        # work on the real boxes only (V of the B * M padded slots), so padding to the fullest image is free
        v_img, v_box = mask_gt.reshape(b, m).bool().nonzero(as_tuple=True)
        v_boxes = gt_bboxes_xyxy[v_img, v_box]  # (V, 4)
        candidates = anchors_inside_boxes(anchor_points, widen_small_boxes(v_boxes, self.min_side)[None], self.eps)[0]
        row, anchor = candidates.nonzero(as_tuple=True)  # (V, N) -> candidate pairs
        if row.numel() == 0:
            return self._background(b, n, gt_bboxes_xyxy.dtype, pd_scores.dtype, device)
        v_labels = gt_labels.reshape(b, m)[v_img, v_box].long()  # (V,)
        img = v_img[row]

        # overlap and alignment at the candidate pairs only, scattered into (V, N) for the per-box top-k
        pd_boxes = pd_bboxes_xyxy(img, anchor) if callable(pd_bboxes_xyxy) else pd_bboxes_xyxy[img, anchor]
        # a non-finite forward (its step is skipped: engine/train/nonfinite.py) must not break the assignment's
        # indexing: a NaN overlap would match no candidate in _one_box_per_anchor; finite overlaps are untouched
        iou = pair_overlap(v_boxes[row], pd_boxes.to(v_boxes.dtype)).nan_to_num(0.0)
        score = pd_scores[img, anchor, v_labels[row]]
        if logits:
            score = score.sigmoid()
        v = v_boxes.shape[0]
        dtype = gt_bboxes_xyxy.dtype
        overlaps = torch.zeros(v, n, dtype=dtype, device=device)
        align_metric = torch.zeros(v, n, dtype=dtype, device=device)
        overlaps[row, anchor] = iou.to(dtype)
        align_metric[row, anchor] = (score.pow(self.alpha) * iou.pow(self.beta)).to(dtype)

        # top-k by alignment per box; picks outside the candidates (ties at zero) are dropped
        k = min(self.topk, n)
        topk_idx = align_metric.topk(k, dim=-1).indices  # (V, k)
        p_row, p_slot = candidates.gather(-1, topk_idx).nonzero(as_tuple=True)
        p_anchor = topk_idx[p_row, p_slot]

        a_row, a_anchor = _one_box_per_anchor(p_row, p_anchor, v_img, row, img * n + anchor, iou, b, n)
        a_metric, a_iou = align_metric[a_row, a_anchor], overlaps[a_row, a_anchor]

        # normalise per box: its best-aligned anchor gets the box's best overlap
        max_metric = a_metric.new_zeros(v).scatter_reduce_(0, a_row, a_metric, "amax")
        max_iou = a_iou.new_zeros(v).scatter_reduce_(0, a_row, a_iou, "amax")
        norm_align = a_metric * max_iou[a_row] / (max_metric[a_row] + self.eps)
        real = _RealBoxes(v_img, v_box, v_labels, v_boxes)
        return self._targets((b, n), real, a_row, a_anchor, norm_align, gt_bboxes_xyxy, pd_scores.dtype)

    def _targets(
        self,
        shape: tuple[int, int],
        real: _RealBoxes,
        a_row: Tensor,
        a_anchor: Tensor,
        a_score: Tensor,
        gt_bboxes_xyxy: Tensor,
        score_dtype: torch.dtype,
    ) -> SparseAssignment:
        """The (B, N) targets of the assigned pairs (``a_row`` of the real boxes, ``a_anchor``): their box's slot,
        class, corners and ``a_score`` (the normalised alignment); background everywhere else."""
        (b, n), device = shape, a_score.device  # pd_scores': the alignment was computed there
        a_img = real.img[a_row]
        fg_mask = torch.zeros(b, n, dtype=torch.bool, device=device)
        fg_mask[a_img, a_anchor] = True
        gt_idx = torch.zeros(b, n, dtype=torch.long, device=device)
        gt_idx[a_img, a_anchor] = real.slot[a_row]
        target_labels = torch.full((b, n), self.num_classes, dtype=torch.long, device=device)
        target_labels[a_img, a_anchor] = real.labels[a_row]
        target_bboxes = gt_bboxes_xyxy.new_zeros(b, n, 4)
        target_bboxes[a_img, a_anchor] = real.xyxy[a_row]
        target_score = torch.zeros(b, n, dtype=score_dtype, device=device)
        target_score[a_img, a_anchor] = a_score.to(score_dtype)
        return SparseAssignment(target_labels, target_bboxes, target_score, fg_mask, gt_idx)

    def _background(
        self, b: int, n: int, box_dtype: torch.dtype, score_dtype: torch.dtype, device: torch.device
    ) -> SparseAssignment:
        """Every anchor is background (no ground truth, or no anchor inside any box)."""
        return SparseAssignment(
            torch.full((b, n), self.num_classes, dtype=torch.long, device=device),
            torch.zeros(b, n, 4, dtype=box_dtype, device=device),
            torch.zeros(b, n, dtype=score_dtype, device=device),
            torch.zeros(b, n, dtype=torch.bool, device=device),
            torch.zeros(b, n, dtype=torch.long, device=device),
        )


def _one_box_per_anchor(
    p_row: Tensor, p_anchor: Tensor, v_img: Tensor, row: Tensor, flat_c: Tensor, iou: Tensor, b: int, n: int
) -> tuple[Tensor, Tensor]:
    """(box row, anchor) of every assigned pair, from the top-k picks (``p_row``, ``p_anchor``) of the V boxes
    (``v_img``: each box's image). An anchor picked by several boxes goes to the box its prediction overlaps most
    among *all* the boxes it is a candidate of (the lowest box index among equals), even one whose top-k did not
    pick it; ``row``, ``flat_c`` (image * N + anchor) and ``iou`` are every candidate pair's."""
    flat = v_img[p_row] * n + p_anchor
    claims = torch.bincount(flat, minlength=b * n)
    single = claims[flat] == 1
    a_row, a_anchor = p_row[single], p_anchor[single]
    contested = (claims > 1).nonzero(as_tuple=True)[0]
    if contested.numel():
        best = iou.new_full((b * n,), -1.0).scatter_reduce_(0, flat_c, iou, "amax")
        top = (iou == best[flat_c]) & (claims[flat_c] > 1)
        winner = row.new_full((b * n,), v_img.shape[0]).scatter_reduce_(0, flat_c[top], row[top], "amin")
        a_row = torch.cat((a_row, winner[contested]))
        a_anchor = torch.cat((a_anchor, contested % n))
    return a_row, a_anchor
