"""TaskAlignedAssigner on hand-made cases and against a slow per-box reference."""

from __future__ import annotations

import math

import torch

from detrain.nn.assigner import TaskAlignedAssigner, anchors_inside_boxes


def grid_anchors(cells: int = 8, stride: float = 8.0) -> torch.Tensor:
    """Anchor centres (cells*cells, 2) in pixels, row-major like make_anchors."""
    c = (torch.arange(cells, dtype=torch.float32) + 0.5) * stride
    yy, xx = torch.meshgrid(c, c, indexing="ij")
    return torch.stack((xx, yy), -1).reshape(-1, 2)


def iou(a: torch.Tensor, b: torch.Tensor) -> float:
    iw = (min(a[2], b[2]) - max(a[0], b[0])).clamp(0)
    ih = (min(a[3], b[3]) - max(a[1], b[1])).clamp(0)
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / (union + 1e-9))


def ciou(gt: torch.Tensor, pd: torch.Tensor) -> float:
    """Complete IoU clamped at 0, written out from its definition (IoU - centre distance term - aspect term)."""
    plain = iou(gt, pd)
    gw, gh, pw, ph = (float(v) for v in (gt[2] - gt[0], gt[3] - gt[1], pd[2] - pd[0], pd[3] - pd[1]))
    cw = float(max(gt[2], pd[2]) - min(gt[0], pd[0]))
    ch = float(max(gt[3], pd[3]) - min(gt[1], pd[1]))
    rho2 = (float(pd[0] + pd[2] - gt[0] - gt[2]) ** 2 + float(pd[1] + pd[3] - gt[1] - gt[3]) ** 2) / 4
    v = 4 / math.pi**2 * (math.atan(pw / ph) - math.atan(gw / gh)) ** 2
    alpha = v / (v - plain + 1)
    return max(plain - rho2 / (cw**2 + ch**2) - v * alpha, 0.0)


def test_one_box_picks_topk_candidates_by_score() -> None:
    anchors = grid_anchors()
    n, nc = anchors.shape[0], 3
    gt = torch.tensor([0.0, 0, 32, 32])
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(1, n, nc, generator=gen) * 0.9 + 0.05
    inside = anchors_inside_boxes(anchors, gt.view(1, 1, 4))[0, 0]
    scores[0, ~inside, 1] = 0.99  # outside anchors must lose despite a high score
    pd_boxes = gt.expand(1, n, 4).clone()  # IoU 1 everywhere: the score alone orders the candidates

    out = TaskAlignedAssigner(topk=10, num_classes=nc)(
        scores, pd_boxes, anchors, torch.tensor([[[1.0]]]), gt.view(1, 1, 4), torch.ones(1, 1, 1, dtype=torch.bool)
    )

    assert int(inside.sum()) == 16
    cand_scores = scores[0, :, 1].masked_fill(~inside, -1)
    expected = torch.zeros(n, dtype=torch.bool)
    expected[cand_scores.topk(10).indices] = True
    assert torch.equal(out.fg_mask[0], expected)
    assert torch.equal(out.labels[0], torch.where(expected, 1, nc))
    assert torch.equal(out.bboxes_xyxy[0][expected], gt.expand(10, 4))
    assert torch.all(out.bboxes_xyxy[0][~expected] == 0)
    metric = scores[0, :, 1].sqrt() * expected
    torch.testing.assert_close(out.scores[0, :, 1], metric / metric.max())
    assert torch.all(out.scores[0, :, [0, 2]] == 0)


def test_overlapping_boxes_resolved_by_iou() -> None:
    anchors = grid_anchors()
    n = anchors.shape[0]
    box_a = torch.tensor([0.0, 0, 32, 32])
    box_b = torch.tensor([16.0, 16, 48, 48])
    gts = torch.stack((box_a, box_b)).unsqueeze(0)
    # anchors in column x=20 predict box A, every other anchor predicts box B
    pd_boxes = torch.where((anchors[:, :1] == 20), box_a, box_b).unsqueeze(0)
    scores = torch.full((1, n, 2), 0.5)

    out = TaskAlignedAssigner(topk=16, num_classes=2)(
        scores, pd_boxes, anchors, torch.tensor([[[0.0], [1.0]]]), gts, torch.ones(1, 2, 1, dtype=torch.bool)
    )

    inside = anchors_inside_boxes(anchors, gts)[0]  # (2, N)
    both = inside[0] & inside[1]
    assert int(both.sum()) == 4
    assert torch.equal(out.fg_mask[0], inside.any(0))
    x_is_20 = anchors[:, 0] == 20
    expected_idx = torch.where(inside[0] & ~inside[1], 0, 1)
    expected_idx = torch.where(both & x_is_20, 0, expected_idx)
    fg = out.fg_mask[0]
    assert torch.equal(out.gt_idx[0][fg], expected_idx[fg])
    assert torch.equal(out.labels[0][fg], expected_idx[fg])
    # one positive class per anchor, and a box's best anchor gets that box's best IoU (1.0)
    assert torch.all((out.scores[0] > 0).sum(-1) <= 1)
    torch.testing.assert_close(out.scores[0].amax(0), torch.ones(2))


def test_no_boxes_is_all_background() -> None:
    anchors = grid_anchors(4)
    n = anchors.shape[0]
    assigner = TaskAlignedAssigner(topk=10, num_classes=5)
    scores, pd_boxes = torch.rand(2, n, 5), torch.rand(2, n, 4) * 16
    empty = assigner(scores, pd_boxes, anchors, torch.zeros(2, 0, 1), torch.zeros(2, 0, 4), torch.zeros(2, 0, 1))
    padded = assigner(
        scores, pd_boxes, anchors, torch.zeros(2, 3, 1), torch.rand(2, 3, 4), torch.zeros(2, 3, 1, dtype=torch.bool)
    )
    for out in (empty, padded):
        assert not out.fg_mask.any()
        assert torch.all(out.scores == 0)
        assert torch.all(out.labels == 5)
        assert out.bboxes_xyxy.shape == (2, n, 4)


def test_image_without_boxes_beside_one_with_boxes() -> None:
    anchors = grid_anchors(4)
    n = anchors.shape[0]
    gts = torch.tensor([[[0.0, 0, 20, 20]], [[0.0, 0, 0, 0]]])
    mask = torch.tensor([[[True]], [[False]]])
    out = TaskAlignedAssigner(topk=3, num_classes=1)(
        torch.full((2, n, 1), 0.5), gts[:, :1].expand(2, n, 4).clone(), anchors, torch.zeros(2, 1, 1), gts, mask
    )
    assert int(out.fg_mask[0].sum()) == 3
    assert not out.fg_mask[1].any()


def reference_assign(scores, pd_boxes, anchors, labels, gts, mask_gt, topk, alpha, beta, min_side=0.0):
    """Slow, loop-based restatement of the rule, for comparison. Returns (fg (B, N), gt_idx, target scores).

    Overlap: CIoU clamped at 0; candidates: anchor centres inside the box with sides widened to ``min_side``;
    positives: each box's ``topk`` candidates by alignment (those with alignment > 0); an anchor several boxes
    pick goes to the box of highest overlap among all boxes it is a candidate of (lowest index on ties)."""
    b, n, nc = scores.shape
    m = gts.shape[1]
    metric = torch.zeros(b, m, n)
    ious = torch.zeros(b, m, n)
    pos = torch.zeros(b, m, n, dtype=torch.bool)
    cand = torch.zeros(b, m, n, dtype=torch.bool)
    for i in range(b):
        for j in range(m):
            if not mask_gt[i, j]:
                continue
            x1, y1, x2, y2 = gts[i, j].tolist()
            cx, cy, hw, hh = (x1 + x2) / 2, (y1 + y2) / 2, max(x2 - x1, min_side) / 2, max(y2 - y1, min_side) / 2
            for a in range(n):
                ax, ay = anchors[a].tolist()
                if cx - hw < ax < cx + hw and cy - hh < ay < cy + hh:
                    cand[i, j, a] = True
                    ious[i, j, a] = ciou(gts[i, j], pd_boxes[i, a])
                    metric[i, j, a] = scores[i, a, int(labels[i, j])] ** alpha * ious[i, j, a] ** beta
            order = sorted(range(n), key=lambda a: -float(metric[i, j, a]))[:topk]
            for a in order:
                if metric[i, j, a] > 0:
                    pos[i, j, a] = True
    fg = torch.zeros(b, n, dtype=torch.bool)
    gt_idx = torch.zeros(b, n, dtype=torch.long)
    target = torch.zeros(b, n, nc)
    for i in range(b):
        for a in range(n):
            owners = [j for j in range(m) if pos[i, j, a]]
            if len(owners) > 1:  # contested: every box the anchor lies in competes, not only the claimants
                owners = [j for j in range(m) if cand[i, j, a]]
            if owners:
                fg[i, a] = True
                gt_idx[i, a] = max(owners, key=lambda j: (float(ious[i, j, a]), -j))
        for j in range(m):
            mine = [a for a in range(n) if fg[i, a] and gt_idx[i, a] == j]
            if not mine:
                continue
            max_metric = max(float(metric[i, j, a]) for a in mine)
            max_iou = max(float(ious[i, j, a]) for a in mine)
            for a in mine:
                target[i, a, int(labels[i, j])] = float(metric[i, j, a]) * max_iou / (max_metric + 1e-9)
    return fg, gt_idx, target


def _random_problem(
    gen: torch.Generator, b: int, m: int, nc: int, gt_size: tuple[float, float]
) -> tuple[torch.Tensor, ...]:
    """Anchors of a 64 px image at stride 8, ``m`` random boxes per image with sides in ``gt_size`` (min,
    span), their labels, and predicted boxes jittered around every anchor so that many IoUs are non-zero."""
    anchors = grid_anchors(8)
    n = anchors.shape[0]
    centres = torch.rand(b, m, 2, generator=gen) * 48 + 8
    sizes = torch.rand(b, m, 2, generator=gen) * gt_size[1] + gt_size[0]
    gts = torch.cat((centres - sizes / 2, centres + sizes / 2), -1)
    labels = torch.randint(0, nc, (b, m, 1), generator=gen).float()
    pd_centres = anchors.expand(b, n, 2) + torch.randn(b, n, 2, generator=gen) * 4
    pd_sizes = torch.rand(b, n, 2, generator=gen) * 24 + 12
    pd_boxes = torch.cat((pd_centres - pd_sizes / 2, pd_centres + pd_sizes / 2), -1)
    return anchors, gts, labels, pd_boxes


def test_matches_slow_reference_on_random_boxes() -> None:
    gen = torch.Generator().manual_seed(3)
    b, m, nc = 2, 3, 4
    anchors, gts, labels, pd_boxes = _random_problem(gen, b, m, nc, gt_size=(16, 24))
    n = anchors.shape[0]
    mask_gt = torch.tensor([[True, True, True], [True, True, False]]).unsqueeze(-1)
    scores = torch.rand(b, n, nc, generator=gen) * 0.9 + 0.05

    out = TaskAlignedAssigner(topk=5, num_classes=nc)(scores, pd_boxes, anchors, labels, gts, mask_gt)
    fg, gt_idx, target = reference_assign(scores, pd_boxes, anchors, labels, gts, mask_gt, 5, 0.5, 6.0)

    assert fg.sum() > 10
    assert torch.equal(out.fg_mask, fg)
    assert torch.equal(out.gt_idx[fg], gt_idx[fg])
    torch.testing.assert_close(out.scores, target, rtol=1e-4, atol=1e-6)


def test_sparse_assignment_from_logits_and_a_box_function_matches_dense() -> None:
    """``assign_sparse`` reads logits and boxes only at candidate pairs; the targets are the dense ones."""
    gen = torch.Generator().manual_seed(7)
    b, m, nc = 3, 4, 5
    anchors, gts, labels, pd_boxes = _random_problem(gen, b, m, nc, gt_size=(10, 30))
    n = anchors.shape[0]
    mask_gt = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool).unsqueeze(-1)
    logits = torch.randn(b, n, nc, generator=gen) * 2
    asked = []

    def boxes_at(img: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        asked.append(img.numel())
        return pd_boxes[img, anchor]

    assigner = TaskAlignedAssigner(topk=6, num_classes=nc)
    dense = assigner(logits.sigmoid(), pd_boxes, anchors, labels, gts, mask_gt)
    sparse = assigner.assign_sparse(logits, boxes_at, anchors, labels, gts, mask_gt, logits=True)
    inside = anchors_inside_boxes(anchors, gts) & mask_gt
    assert asked == [int(inside.sum())] and asked[0] < b * n  # only the candidate pairs were decoded
    assert dense.fg_mask.sum() > 10 and not dense.fg_mask[1].any()
    for name in ("labels", "bboxes_xyxy", "fg_mask", "gt_idx"):
        assert torch.equal(getattr(sparse, name), getattr(dense, name)), name
    torch.testing.assert_close(sparse.score, dense.scores.sum(-1))
    assert torch.all((dense.scores > 0).sum(-1) <= 1)


def test_small_boxes_get_candidates_from_the_widened_box() -> None:
    """Boxes smaller than ``min_side`` find candidates inside the box widened to it; targets keep the real box."""
    gen = torch.Generator().manual_seed(11)
    b, m, nc = 2, 4, 3
    anchors, gts, labels, pd_boxes = _random_problem(gen, b, m, nc, gt_size=(3, 6))
    n = anchors.shape[0]
    mask_gt = torch.ones(b, m, 1, dtype=torch.bool)
    scores = torch.rand(b, n, nc, generator=gen) * 0.9 + 0.05

    plain = TaskAlignedAssigner(topk=5, num_classes=nc)(scores, pd_boxes, anchors, labels, gts, mask_gt)
    out = TaskAlignedAssigner(topk=5, num_classes=nc, min_side=16.0)(scores, pd_boxes, anchors, labels, gts, mask_gt)
    fg, gt_idx, target = reference_assign(scores, pd_boxes, anchors, labels, gts, mask_gt, 5, 0.5, 6.0, min_side=16.0)

    assert int(out.fg_mask.sum()) > 2 * int(plain.fg_mask.sum())  # 3-9 px boxes hold at most one 8 px anchor
    assert torch.equal(out.fg_mask, fg)
    assert torch.equal(out.gt_idx[fg], gt_idx[fg])
    torch.testing.assert_close(out.scores, target, rtol=1e-4, atol=1e-6)
    assert torch.equal(out.bboxes_xyxy[fg], gts[torch.nonzero(fg)[:, 0], out.gt_idx[fg]])
