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
candidate (box, anchor) pairs, and everything after the per-box top-k works on tensors of fixed shape ((V, topk)
picks, (B * N,) anchors), so that the one host sync of an assignment on a GPU is the number of candidate pairs
(V, the number of real boxes, is read where the labels are: host memory in training). There is no Python loop
over images, boxes or anchors.
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
    half = torch.where(size < min_side, min_side, size) / 2  # a Python number: no tensor copied to the device
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
        host_anchor_points: Tensor | None = None,
    ) -> SparseAssignment:
        """Assign targets, reading predictions only where an anchor centre lies inside a box.

        Arguments as for ``__call__``, except: ``pd_scores`` may be raw logits (``logits=True``; the sigmoid is
        then taken only at the candidate pairs) and need not be contiguous, and ``pd_bboxes_xyxy`` may be a
        function ``(img, anchor) -> (K, 4)`` that decodes boxes only at the K candidate pairs. Everything
        past the candidates works on the at most B * M * topk positive pairs, never on another (B, N, nc). The ground
        truth (all on one device) may lie in host memory, with ``host_anchor_points`` there: the numbers of real
        boxes and candidate pairs are then found there and moved without waiting (the device waits for nothing)."""
        b, n, _ = pd_scores.shape
        device = pd_scores.device
        points = anchor_points.to(gt_bboxes_xyxy.device) if host_anchor_points is None else host_anchor_points
        found = self._candidates(points, gt_labels, gt_bboxes_xyxy, mask_gt, device, host_anchor_points is not None)
        if found is None:
            return self._background(b, n, gt_bboxes_xyxy.dtype, pd_scores.dtype, device)
        real, candidates, row, anchor = found
        v_img, v_labels, v_boxes = real.img, real.labels, real.xyxy
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

        # top-k by alignment per box; picks outside the candidates (ties at zero) are dropped. From here on every
        # tensor has a fixed shape (V, k) or (B * N,): no host sync however many anchors are picked or contested
        k = min(self.topk, n)
        topk_idx = align_metric.topk(k, dim=-1).indices  # (V, k)
        picked = candidates.gather(-1, topk_idx)
        a_row = _one_box_per_anchor(topk_idx, picked, v_img, row, img * n + anchor, iou, b, n)  # (B * N,), V: none
        fg = a_row < v
        box = torch.where(fg, a_row, v)  # background anchors go to a spare row V, read by nobody
        a_box, a_anchor = box.clamp(max=v - 1), torch.arange(b * n, device=device) % n  # a real row to read anywhere
        a_metric, a_iou = align_metric[a_box, a_anchor], overlaps[a_box, a_anchor]

        # normalise per box: its best-aligned anchor gets the box's best overlap
        max_metric = a_metric.new_zeros(v + 1).scatter_reduce_(0, box, a_metric, "amax")
        max_iou = a_iou.new_zeros(v + 1).scatter_reduce_(0, box, a_iou, "amax")
        norm_align = a_metric * max_iou[box] / (max_metric[box] + self.eps)
        return self._targets((b, n), real, fg, a_box, norm_align, pd_scores.dtype)

    def _candidates(
        self,
        points: Tensor,
        gt_labels: Tensor,
        gt_bboxes_xyxy: Tensor,
        mask_gt: Tensor,
        device: torch.device,
        moved: bool,
    ) -> tuple[_RealBoxes, Tensor, Tensor, Tensor] | None:
        """The real boxes (V of the B * M padded slots: padding to the fullest image is free), the (V, N) candidates
        (anchor ``points`` inside a box, widened when small) and the (row, anchor) candidate pairs, found where the
        ground truth lies and given on ``device``; None without a pair. ``moved``: the ground truth lies elsewhere
        (host memory), so the candidates are made again on ``device`` from the pairs."""
        b, m = mask_gt.shape[:2]
        v_img, v_box = mask_gt.reshape(b, m).bool().nonzero(as_tuple=True)
        v_boxes = gt_bboxes_xyxy[v_img, v_box]  # (V, 4)
        inside = anchors_inside_boxes(points, widen_small_boxes(v_boxes, self.min_side)[None], self.eps)[0]
        row, anchor = (t.to(device, non_blocking=True) for t in inside.nonzero(as_tuple=True))
        if row.numel() == 0:
            return None
        v_labels = gt_labels.reshape(b, m)[v_img, v_box].long()  # (V,)
        real = _RealBoxes(*(t.to(device, non_blocking=True) for t in (v_img, v_box, v_labels, v_boxes)))
        candidates = inside
        if moved:  # the same (V, N) candidates on the device, from the pairs
            ones = torch.ones_like(row, dtype=torch.bool)  # made on the device (not a Python True copied there)
            candidates = torch.zeros_like(inside, device=device).index_put_((row, anchor), ones)
        return real, candidates, row, anchor

    def _targets(
        self,
        shape: tuple[int, int],
        real: _RealBoxes,
        fg: Tensor,
        a_row: Tensor,
        a_score: Tensor,
        score_dtype: torch.dtype,
    ) -> SparseAssignment:
        """The (B, N) targets of the flat (B * N,) anchors: where ``fg``, the slot, class and corners of the real box
        at ``a_row`` and ``a_score`` (the normalised alignment); background everywhere else."""
        b, n = shape
        fg_box = fg[:, None]
        return SparseAssignment(
            torch.where(fg, real.labels[a_row], self.num_classes).view(b, n),
            torch.where(fg_box, real.xyxy[a_row], 0.0).view(b, n, 4),
            torch.where(fg, a_score.to(score_dtype), 0.0).view(b, n),
            fg.view(b, n),
            torch.where(fg, real.slot[a_row], 0).view(b, n),
        )

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
    topk_idx: Tensor, picked: Tensor, v_img: Tensor, row: Tensor, flat_c: Tensor, iou: Tensor, b: int, n: int
) -> Tensor:
    """(B * N,) the box row each anchor (image * N + anchor) is assigned to, V (the number of real boxes) where
    none, from the (V, k) top-k anchors of each box (``topk_idx``; ``picked`` where they are candidates) and
    ``v_img``, each box's image. An anchor picked by several boxes goes to the box its prediction overlaps most among
    *all* the boxes it is a candidate of (the lowest box index among equals), even one whose top-k did not pick it;
    ``row``, ``flat_c`` (image * N + anchor) and ``iou`` are every candidate pair's. Fixed shapes throughout: no
    host sync."""
    v = topk_idx.shape[0]
    flat = (v_img[:, None] * n + topk_idx).reshape(-1)
    p_row = torch.where(picked, torch.arange(v, device=row.device)[:, None], v).reshape(-1)
    claims = torch.zeros(b * n, dtype=torch.long, device=row.device).scatter_add_(0, flat, picked.reshape(-1).long())
    claimed = row.new_full((b * n,), v).scatter_reduce_(0, flat, p_row, "amin")  # the one box, where one picked it
    contested = claims > 1
    best = iou.new_full((b * n,), -1.0).scatter_reduce_(0, flat_c, iou, "amax")
    top = torch.where((iou == best[flat_c]) & contested[flat_c], row, v)
    winner = row.new_full((b * n,), v).scatter_reduce_(0, flat_c, top, "amin")
    return torch.where(contested, winner, claimed)
