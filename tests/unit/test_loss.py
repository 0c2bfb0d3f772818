"""DetectionLoss: components, edge cases, learning signal and the distributed normalisation math."""

from __future__ import annotations

import math

import pytest
import torch
from _gains import DEFAULT_GAINS
from torch import nn

from detrain.nn.assigner import TaskAlignedAssigner
from detrain.nn.loss import (
    DetectionLoss,
    bce_with_logits_sum_sparse,
    distribution_focal_loss,
    pad_targets,
    split_head_maps,
)

NC, REG_MAX = 3, 8
STRIDES = [8.0, 16.0]  # two levels of 8x8 and 4x4 cells: a 64x64 image
CHANNELS = 4 * REG_MAX + NC


def random_labels(gen: torch.Generator, per_image: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat (batch_idx, cls, bboxes_xywhn) with ``per_image[i]`` boxes in image i."""
    batch_idx = torch.cat([torch.full((k,), float(i)) for i, k in enumerate(per_image)])
    m = batch_idx.numel()
    cls = torch.randint(0, NC, (m, 1), generator=gen).float()
    wh = torch.rand(m, 2, generator=gen) * 0.4 + 0.15
    xy = wh / 2 + torch.rand(m, 2, generator=gen) * (1 - wh)
    return batch_idx, cls, torch.cat((xy, wh), 1)


class TinyHead(nn.Module):
    """One conv shared by two pyramid levels: enough to produce head maps with a common producer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, CHANNELS, 3, padding=1)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [self.conv(x), self.conv(nn.functional.avg_pool2d(x, 2))]


def test_pad_targets_scatters_boxes_by_image() -> None:
    batch_idx = torch.tensor([2.0, 0, 2, 2])
    cls = torch.tensor([[1.0], [2], [3], [4]])
    boxes = torch.arange(16.0).reshape(4, 4)
    out_cls, out_boxes, mask = pad_targets(batch_idx, cls, boxes, batch_size=4)
    assert out_cls.shape == (4, 3, 1) and out_boxes.shape == (4, 3, 4)
    assert mask[..., 0].tolist() == [[True, False, False], [False] * 3, [True] * 3, [False] * 3]
    assert out_cls[2, :, 0].tolist() == [1.0, 3.0, 4.0]  # order within an image is kept
    assert out_cls[0, 0, 0] == 2.0
    assert torch.equal(out_boxes[2, 1], boxes[2])
    empty = pad_targets(torch.zeros(0), torch.zeros(0, 1), torch.zeros(0, 4), batch_size=2)
    assert empty[1].shape == (2, 0, 4)


def test_loss_finite_and_positive_on_random_inputs() -> None:
    gen = torch.Generator().manual_seed(0)
    maps = [torch.randn(2, CHANNELS, 8, 8, generator=gen), torch.randn(2, CHANNELS, 4, 4, generator=gen)]
    maps = [m.requires_grad_() for m in maps]
    criterion = DetectionLoss(NC, STRIDES, reg_max=REG_MAX, gains=DEFAULT_GAINS)
    loss, items = criterion(maps, *random_labels(gen, [3, 2]))
    assert torch.isfinite(loss) and loss > 0
    assert items.shape == (3,) and not items.requires_grad
    assert torch.all(items > 0)
    torch.testing.assert_close(loss.detach(), items.sum() * 2)
    loss.backward()
    assert all(torch.isfinite(m.grad).all() for m in maps)


def test_images_without_boxes_give_only_cls_loss() -> None:
    maps = [torch.randn(2, CHANNELS, 8, 8, requires_grad=True), torch.randn(2, CHANNELS, 4, 4, requires_grad=True)]
    criterion = DetectionLoss(NC, torch.tensor(STRIDES), reg_max=REG_MAX, gains=DEFAULT_GAINS)
    loss, items = criterion(maps, torch.zeros(0), torch.zeros(0, 1), torch.zeros(0, 4))
    assert items[0] == 0 and items[2] == 0 and items[1] > 0
    loss.backward()
    # the box channels still receive a (zero) gradient, so DDP sees them used
    assert maps[0].grad is not None and torch.all(maps[0].grad[:, : 4 * REG_MAX] == 0)
    assert torch.any(maps[0].grad[:, 4 * REG_MAX :] != 0)


def test_loss_decreases_when_training_a_tiny_head() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    head = TinyHead()
    x = torch.randn(2, 4, 8, 8, generator=gen)
    labels = random_labels(gen, [2, 1])
    criterion = DetectionLoss(NC, STRIDES, reg_max=REG_MAX, gains=DEFAULT_GAINS)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    history = []
    for _ in range(50):
        loss, items = criterion(head(x), *labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(items)
    first, last = history[0], history[-1]
    assert last.sum() < 0.5 * first.sum()
    assert last[0] < first[0]  # the box loss itself improves, not only the classification


def test_dfl_is_minimal_at_the_target_distribution() -> None:
    target = torch.tensor([2.3])
    best = torch.full((1, REG_MAX), -30.0)
    best[0, 2], best[0, 3] = math.log(0.7), math.log(0.3)
    best_loss = distribution_focal_loss(best, target)
    entropy = -(0.7 * math.log(0.7) + 0.3 * math.log(0.3))
    assert abs(float(best_loss) - entropy) < 1e-6
    gen = torch.Generator().manual_seed(0)
    others = best + torch.randn(64, REG_MAX, generator=gen) * 0.5
    assert torch.all(distribution_focal_loss(others, target.expand(64)) > best_loss)
    # and it is a stationary point
    logits = best.clone().requires_grad_()
    distribution_focal_loss(logits, target).sum().backward()
    assert logits.grad.abs().max() < 1e-6


def test_anchors_are_cached_per_feature_shape() -> None:
    criterion = DetectionLoss(NC, STRIDES, reg_max=REG_MAX, gains=DEFAULT_GAINS)
    maps = [torch.zeros(1, CHANNELS, 8, 8), torch.zeros(1, CHANNELS, 4, 4)]
    first = criterion._anchors(maps, torch.float32, torch.device("cpu"))
    again = criterion._anchors([m.clone() for m in maps], torch.float32, torch.device("cpu"))
    assert first[0] is again[0]
    other = criterion._anchors(
        [torch.zeros(1, CHANNELS, 4, 8), torch.zeros(1, CHANNELS, 2, 4)], torch.float32, torch.device("cpu")
    )
    assert other[0].shape == (4 * 8 + 2 * 4, 2)


def test_half_precision_maps_are_scored_in_float32() -> None:
    gen = torch.Generator().manual_seed(0)
    maps = [
        torch.randn(1, CHANNELS, 8, 8, generator=gen).bfloat16().requires_grad_(),
        torch.randn(1, CHANNELS, 4, 4, generator=gen).bfloat16().requires_grad_(),
    ]
    loss, _ = DetectionLoss(NC, STRIDES, reg_max=REG_MAX, gains=DEFAULT_GAINS)(maps, *random_labels(gen, [2]))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert maps[0].grad.dtype == torch.bfloat16


def test_two_half_batches_with_shared_normalizer_reproduce_the_full_batch_gradient() -> None:
    """The DDP math without processes: 2 'ranks' of 2 images average to one process of 4 images."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    head = TinyHead().double()
    x = torch.randn(4, 4, 8, 8, generator=gen, dtype=torch.float64)
    batch_idx, cls, boxes = random_labels(gen, [2, 0, 3, 1])  # one image without boxes

    def grads() -> list[torch.Tensor]:
        out = [p.grad.clone() for p in head.parameters()]
        head.zero_grad()
        return out

    full = DetectionLoss(NC, STRIDES, reg_max=REG_MAX, gains=DEFAULT_GAINS)
    loss_full, items_full = full(head(x), batch_idx, cls, boxes.double())
    loss_full.backward()
    grads_full = grads()

    def half(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        keep = (batch_idx >= 2 * rank) & (batch_idx < 2 * rank + 2)
        return x[2 * rank : 2 * rank + 2], batch_idx[keep] - 2 * rank, cls[keep], boxes[keep].double()

    # first pass: each rank's local normaliser, summed as the all-reduce would
    local_sums: list[torch.Tensor] = []
    for rank in range(2):
        recorder = DetectionLoss(
            NC, STRIDES, reg_max=REG_MAX, gains=DEFAULT_GAINS, normalizer_reduce=lambda t: local_sums.append(t) or t
        )
        with torch.no_grad():
            xr, *labels = half(rank)
            recorder(head(xr), *labels)
    global_sum = sum(local_sums)
    assert global_sum > 1  # the clamp at 1 must not hide a mistake

    half_grads, half_items = [], []
    for rank in range(2):
        criterion = DetectionLoss(
            NC,
            STRIDES,
            reg_max=REG_MAX,
            gains=DEFAULT_GAINS,
            normalizer_reduce=lambda t: global_sum.clone(),
            world_size=2,
        )
        xr, *labels = half(rank)
        loss, items = criterion(head(xr), *labels)  # global_batch defaults to 2 images * 2 ranks
        loss.backward()
        half_grads.append(grads())
        half_items.append(items)

    torch.testing.assert_close((half_items[0] + half_items[1]) / 2, items_full, rtol=1e-9, atol=1e-12)
    for g_full, g0, g1 in zip(grads_full, *half_grads):
        torch.testing.assert_close((g0 + g1) / 2, g_full, rtol=1e-6, atol=1e-9)
    assert any(g.abs().max() > 1e-3 for g in grads_full)  # a real gradient, not a trivially equal zero


def test_autocast_of_the_caller_does_not_lower_the_loss_precision() -> None:
    gen = torch.Generator().manual_seed(0)
    maps = [torch.randn(1, CHANNELS, 8, 8, generator=gen), torch.randn(1, CHANNELS, 4, 4, generator=gen)]
    labels = random_labels(gen, [2])
    criterion = DetectionLoss(NC, STRIDES, reg_max=REG_MAX, gains=DEFAULT_GAINS)
    _, plain = criterion(maps, *labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, autocast = criterion(maps, *labels)
    torch.testing.assert_close(autocast, plain)


def dense_reference_loss(maps: list[torch.Tensor], batch_idx, cls, bboxes_xywhn, strides) -> torch.Tensor:
    """The loss written plainly over every anchor: dense sigmoid and box decode, the assigner's dense
    targets, BCE against the (B, N, nc) target scores. Returns the (3,) items."""
    from detrain.nn.boxes import bbox2dist, bbox_iou_ciou, dist2bbox, make_anchors, xywh2xyxy

    b = maps[0].shape[0]
    pred = torch.cat([m.reshape(b, m.shape[1], -1) for m in maps], 2).permute(0, 2, 1)
    distri, logits = pred.split((4 * REG_MAX, NC), -1)
    anchors, stride = make_anchors(maps, torch.tensor(strides), 0.5)
    boxes = dist2bbox(
        distri.reshape(b, -1, 4, REG_MAX).softmax(-1) @ torch.arange(REG_MAX, dtype=pred.dtype), anchors, xywh=False
    )
    size = maps[0].shape[2] * strides[0]
    gt_cls, gt_boxes, mask = pad_targets(batch_idx, cls.to(pred), xywh2xyxy(bboxes_xywhn.to(pred) * size), b)
    target = TaskAlignedAssigner(10, NC, min_side=strides[1])(
        logits.detach().sigmoid(), boxes.detach() * stride, anchors * stride, gt_cls, gt_boxes, mask
    )
    norm = target.scores.sum().clamp(min=1)
    loss_cls = nn.functional.binary_cross_entropy_with_logits(logits, target.scores, reduction="sum")
    fg = target.fg_mask
    weight = target.scores.sum(-1)[fg]
    t_boxes = target.bboxes_xyxy / stride
    _, ciou = bbox_iou_ciou(boxes[fg], t_boxes[fg])
    loss_box = ((1 - ciou.squeeze(-1)) * weight).sum()
    ltrb = bbox2dist(anchors, t_boxes, REG_MAX)[fg]
    dfl = distribution_focal_loss(distri.reshape(b, -1, 4, REG_MAX)[fg].reshape(-1, REG_MAX), ltrb.reshape(-1))
    loss_dfl = (dfl.reshape(-1, 4).mean(-1) * weight).sum()
    return torch.stack((loss_box, loss_cls, loss_dfl)) / norm * torch.tensor([7.5, 0.5, 1.5], dtype=pred.dtype)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_matches_the_dense_reference_in_value_and_gradient(layout: torch.memory_format) -> None:
    """Sparse scoring (candidate pairs, foreground rows, sparse-target BCE) is only a faster way to the
    same loss and gradient."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(3, CHANNELS, 8, 8), (3, CHANNELS, 4, 4)]
    maps = [(torch.randn(*s, generator=gen, dtype=torch.float64) * 2).contiguous(memory_format=layout) for s in shapes]
    labels = random_labels(gen, [3, 0, 4])
    grads = []
    for fn in ("ours", "reference"):
        leaves = [m.clone().requires_grad_() for m in maps]
        if fn == "ours":
            loss, items = DetectionLoss(NC, STRIDES, reg_max=REG_MAX, gains=DEFAULT_GAINS)(leaves, *labels)
            torch.testing.assert_close(loss, items.sum() * 3)
        else:
            items = dense_reference_loss(leaves, *labels, STRIDES)
            loss = items.sum() * 3
        loss.backward()
        grads.append(([m.grad for m in leaves], items.detach()))
    (ours, ours_items), (ref, ref_items) = grads
    torch.testing.assert_close(ours_items, ref_items, rtol=1e-10, atol=1e-12)
    assert torch.all(ref_items > 0)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert ours[0].is_contiguous(memory_format=layout)  # gradients come back in the maps' own layout


def test_sparse_target_bce_matches_dense_bce() -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 7, 4, generator=gen, dtype=torch.float64) * 5).requires_grad_()
    img, anchor, label = torch.tensor([0, 1, 1]), torch.tensor([3, 0, 6]), torch.tensor([2, 0, 3])
    target = torch.tensor([0.3, 0.9, 0.05], dtype=torch.float64)
    dense = torch.zeros(2, 7, 4, dtype=torch.float64)
    dense[img, anchor, label] = target
    ours = bce_with_logits_sum_sparse(x, img, anchor, label, target)
    (ours * 2).backward()
    g = x.grad.clone()
    x.grad = None
    ref = nn.functional.binary_cross_entropy_with_logits(x, dense, reduction="sum")
    (ref * 2).backward()
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(g, x.grad)


def test_split_head_maps_is_the_anchor_major_concatenation() -> None:
    gen = torch.Generator().manual_seed(0)
    maps = [torch.randn(2, 5, 3, 4, generator=gen), torch.randn(2, 5, 2, 2, generator=gen)]
    maps[0] = maps[0].contiguous(memory_format=torch.channels_last)  # layouts may differ per map
    maps = [m.requires_grad_() for m in maps]
    box, cls = split_head_maps(maps, 2)
    assert box.is_contiguous() and cls.is_contiguous()
    full = torch.cat([m.flatten(2) for m in maps], 2).transpose(1, 2)
    torch.testing.assert_close(torch.cat((box, cls), -1), full)
    (box.pow(2).sum() + cls.sum()).backward()
    for m in maps:
        torch.testing.assert_close(m.grad, torch.cat((2 * m[:, :2], torch.ones_like(m[:, 2:])), 1).detach())
    assert maps[0].grad.is_contiguous(memory_format=torch.channels_last) and maps[1].grad.is_contiguous()
