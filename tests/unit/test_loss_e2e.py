"""EndToEndLoss without Ultralytics: the branch schedule, the one-to-one assignment, the L1 term by hand, the
branch weighting of loss and gradients, and the distributed normalisation math."""

from __future__ import annotations

import itertools

import pytest
import torch
from _gains import DEFAULT_GAINS
from torch import nn

from detrain.nn.assigner import pair_overlap
from detrain.nn.loss import LossGains
from detrain.nn.loss_e2e import (
    E2EHeadMaps,
    EndToEndLoss,
    RegMax1BranchLoss,
    branch_weights,
)

NC = 3
STRIDES = [8.0, 16.0]  # two levels of 8x8 and 4x4 cells: a 64x64 image
CHANNELS = 4 + NC


def random_labels(gen: torch.Generator, per_image: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat (batch_idx, cls, bboxes_xywhn) with ``per_image[i]`` boxes in image i."""
    batch_idx = torch.cat([torch.full((k,), float(i)) for i, k in enumerate(per_image)])
    m = batch_idx.numel()
    cls = torch.randint(0, NC, (m, 1), generator=gen).float()
    wh = torch.rand(m, 2, generator=gen) * 0.4 + 0.15
    xy = wh / 2 + torch.rand(m, 2, generator=gen) * (1 - wh)
    return batch_idx, cls, torch.cat((xy, wh), 1)


def random_maps(gen: torch.Generator, batch: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Raw maps of one branch: positive ltrb distances of 0.5..4.5 strides and class logits around -2."""
    maps = []
    for s in STRIDES:
        side = int(64 // s)
        box = torch.rand(batch, 4, side, side, generator=gen, dtype=dtype) * 4 + 0.5
        cls = torch.randn(batch, NC, side, side, generator=gen, dtype=dtype) * 2 - 2
        maps.append(torch.cat((box, cls), 1).requires_grad_())
    return maps


class TinyE2EHead(nn.Module):
    """One conv per branch, shared by the two levels; the one-to-one branch reads detached input."""

    def __init__(self) -> None:
        super().__init__()
        self.o2m = nn.Conv2d(4, CHANNELS, 3, padding=1)
        self.o2o = nn.Conv2d(4, CHANNELS, 3, padding=1)
        with torch.no_grad():  # boxes of about 2 strides a side to start with, as a real head's bias gives
            for conv in (self.o2m, self.o2o):
                conv.weight.mul_(0.1)
                conv.bias[:4] = 2.0

    def forward(self, x: torch.Tensor) -> E2EHeadMaps:
        levels = [x, nn.functional.avg_pool2d(x, 2)]
        return E2EHeadMaps([self.o2m(v) for v in levels], [self.o2o(v.detach()) for v in levels])


def test_branch_weights_run_from_08_02_in_the_first_epoch_to_01_09_in_the_last() -> None:
    epochs = 11
    weights = [branch_weights(e, epochs) for e in range(epochs + 3)]
    assert weights[0] == (0.8, 1.0 - 0.8)
    assert weights[epochs - 1] == pytest.approx((0.1, 0.9))
    assert all(w == pytest.approx((0.1, 0.9)) for w in weights[epochs - 1 :])  # held after the last epoch
    o2m = [w[0] for w in weights[:epochs]]
    assert all(a > b for a, b in itertools.pairwise(o2m))  # falls every epoch
    assert o2m[5] == pytest.approx(0.1 + 0.7 * 0.5)  # linearly
    assert all(a + b == pytest.approx(1.0) for a, b in weights)
    assert branch_weights(0, 1) == (0.8, 1.0 - 0.8) and branch_weights(1, 1) == pytest.approx((0.1, 0.9))


def test_one_to_one_branch_keeps_the_best_aligned_of_its_candidates_per_box() -> None:
    gen = torch.Generator().manual_seed(0)
    maps = random_maps(gen, 3)
    labels = random_labels(gen, [4, 0, 9])
    candidates = RegMax1BranchLoss(NC, STRIDES, topk=7, gains=DEFAULT_GAINS).assign(maps, *labels).target
    best = RegMax1BranchLoss(NC, STRIDES, topk=7, keep=1, gains=DEFAULT_GAINS).assign(maps, *labels)
    target = best.target

    # every box with a candidate keeps exactly one anchor, one of its candidates
    boxes = candidates.fg_mask.nonzero().tolist()
    kept = target.fg_mask.nonzero().tolist()
    assert set(map(tuple, kept)) <= set(map(tuple, boxes)) and len(kept) < len(boxes)
    per_box_candidates = {(i, int(candidates.gt_idx[i, a])) for i, a in boxes}
    per_box_kept = [(i, int(target.gt_idx[i, a])) for i, a in kept]
    assert sorted(per_box_kept) == sorted(per_box_candidates)  # one each, none lost

    # the kept one has the largest alignment score**0.5 * ciou**6 among its box's candidates
    img, anchor = candidates.fg_mask.nonzero(as_tuple=True)
    pred_px = torch.cat(
        (
            best.anchors[anchor] - best.pred_box[img, anchor, :2].detach(),
            best.anchors[anchor] + best.pred_box[img, anchor, 2:].detach(),
        ),
        -1,
    )
    pred_px = pred_px * best.stride_per_anchor[anchor]
    iou = pair_overlap(candidates.bboxes_xyxy[img, anchor], pred_px)
    score = best.pred_logits.detach()[img, anchor, candidates.labels[img, anchor]].sigmoid()
    align = score.sqrt() * iou.pow(6)
    for i, box in per_box_candidates:
        mine = (img == i) & (candidates.gt_idx[img, anchor] == box)
        winner = anchor[mine][align[mine].argmax()]
        assert bool(target.fg_mask[i, winner])
        # its soft target: its alignment normalised so that it equals its own overlap (up to the 1e-9 guard)
        a, o = align[mine].max(), iou[mine][align[mine].argmax()]
        assert float(target.score[i, winner]) == pytest.approx(float(a * o / (a + 1e-9)), rel=1e-5)
    assert int(target.labels[~target.fg_mask].min()) == NC  # background everywhere else
    assert float(target.bboxes_xyxy[~target.fg_mask].abs().sum()) == 0.0


def test_l1_term_by_hand_for_one_box_and_one_positive() -> None:
    """One level (stride 8, 4x4 cells, a 32 px image) and one box: the single kept anchor's L1 term is the mean
    |pred - target| ltrb distance in image units, times its soft target, times the gain."""
    maps = torch.full((1, 4 + NC, 4, 4), -4.0)
    maps[:, :4] = 1.0  # every anchor predicts a 2x2-stride box around itself
    maps[0, :4, 1, 1] = torch.tensor([0.5, 1.0, 1.5, 2.0])  # the anchor at (1.5, 1.5) strides does better
    maps[0, 4 + 2, 1, 1] = 1.0  # and is confident in class 2
    maps.requires_grad_()
    box_xyxy = torch.tensor([4.0, 4.0, 24.0, 28.0])  # pixels
    xywhn = torch.cat(((box_xyxy[:2] + box_xyxy[2:]) / 2, box_xyxy[2:] - box_xyxy[:2])) / 32
    branch = RegMax1BranchLoss(NC, [8.0], topk=7, keep=1, gains=LossGains(box=0.0, cls=0.0, dfl=2.0))
    t = branch.assign([maps], torch.zeros(1), torch.tensor([[2.0]]), xywhn[None])
    assert t.target.fg_mask.nonzero().tolist() == [[0, 5]]  # row 1, column 1
    weight = float(t.target.score[0, 5])
    pred = torch.tensor([0.5, 1.0, 1.5, 2.0]) * 8 / 32
    target = torch.tensor([12.0 - 4, 12 - 4, 24 - 12, 28 - 12]) / 32  # anchor at 12 px
    expected = 2.0 * float((pred - target).abs().mean()) * weight  # normaliser clamp(weight, min=1) = 1
    items = branch.items(t, t.score_sum.clamp(min=1))
    assert items[2].item() == pytest.approx(expected, rel=1e-6)
    assert items[0].item() == 0.0 and items[1].item() == 0.0
    items[2].backward()
    grad = maps.grad
    assert grad is not None and grad[0, :4].abs().sum() == grad[0, :4, 1, 1].abs().sum() > 0  # only that anchor


def test_loss_weighs_the_branches_and_logs_the_one_to_one_terms() -> None:
    gen = torch.Generator().manual_seed(1)
    o2m, o2o = random_maps(gen, 2), random_maps(gen, 2)
    labels = random_labels(gen, [3, 5])
    criterion = EndToEndLoss(NC, STRIDES, epochs=10, gains=DEFAULT_GAINS)
    grads = {}
    for epoch in (0, 4, 9):
        criterion.set_epoch(epoch)
        for m in o2m + o2o:
            m.grad = None
        loss, items = criterion(E2EHeadMaps(o2m, o2o), *labels)
        loss.backward()
        targets = criterion.assign(E2EHeadMaps(o2m, o2o), *labels)
        norm = targets.score_sum.clamp(min=1)
        many = criterion.one2many.items(targets.one2many, norm[0]).detach()
        one = criterion.one2one.items(targets.one2one, norm[1]).detach()
        w_many, w_one = branch_weights(epoch, 10)
        assert criterion.weights == (w_many, w_one)
        torch.testing.assert_close(loss.detach(), (many.sum() * w_many + one.sum() * w_one) * 2)
        torch.testing.assert_close(items, one)
        assert not items.requires_grad
        grads[epoch] = ([m.grad.clone() for m in o2m], [m.grad.clone() for m in o2o])
    # each branch's gradient scales with its weight: the one-to-one branch learns more as the run goes on
    for epoch in (4, 9):
        w_many, w_one = branch_weights(epoch, 10)
        for g, g0 in zip(grads[epoch][0], grads[0][0]):
            torch.testing.assert_close(g, g0 * (w_many / 0.8), rtol=1e-5, atol=1e-9)
        for g, g0 in zip(grads[epoch][1], grads[0][1]):
            torch.testing.assert_close(g, g0 * (w_one / (1.0 - 0.8)), rtol=1e-5, atol=1e-9)


def test_images_without_boxes_give_only_cls_loss_and_keep_every_map_in_the_graph() -> None:
    gen = torch.Generator().manual_seed(2)
    maps = E2EHeadMaps(random_maps(gen, 2), random_maps(gen, 2))
    loss, items = EndToEndLoss(NC, STRIDES, epochs=3, gains=DEFAULT_GAINS)(
        maps, torch.zeros(0), torch.zeros(0, 1), torch.zeros(0, 4)
    )
    assert torch.isfinite(loss) and items[0] == 0 and items[2] == 0 and items[1] > 0
    loss.backward()
    assert all(m.grad is not None for m in maps.one2many + maps.one2one)


def test_half_precision_maps_are_scored_in_float32() -> None:
    gen = torch.Generator().manual_seed(3)
    maps32 = E2EHeadMaps(random_maps(gen, 2), random_maps(gen, 2))
    maps16 = E2EHeadMaps(*([m.detach().half().requires_grad_() for m in branch] for branch in maps32))
    labels = random_labels(gen, [2, 2])
    loss16, items16 = EndToEndLoss(NC, STRIDES, epochs=3, gains=DEFAULT_GAINS)(maps16, *labels)
    loss32, _ = EndToEndLoss(NC, STRIDES, epochs=3, gains=DEFAULT_GAINS)(
        E2EHeadMaps(*([m.detach().half().float() for m in branch] for branch in maps32)), *labels
    )
    assert loss16.dtype == items16.dtype == torch.float32
    torch.testing.assert_close(loss16, loss32)
    loss16.backward()
    assert all(m.grad is not None and m.grad.dtype == torch.float16 for m in maps16.one2many + maps16.one2one)


def test_two_half_batches_with_shared_normalizers_reproduce_the_full_batch_gradient() -> None:
    """The DDP math without processes: 2 'ranks' of 2 images average to one process of 4 images, with both
    branches' normalisers all-reduced in one (2,) call."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    head = TinyE2EHead().double()
    x = torch.randn(4, 4, 8, 8, generator=gen, dtype=torch.float64) + 1.0
    batch_idx, cls, boxes = random_labels(gen, [2, 0, 3, 1])
    boxes = boxes.double()

    def grads() -> list[torch.Tensor]:
        out = [p.grad.clone() for p in head.parameters()]
        head.zero_grad()
        return out

    full = EndToEndLoss(NC, STRIDES, epochs=5, gains=DEFAULT_GAINS)
    full.set_epoch(2)
    loss_full, items_full = full(head(x), batch_idx, cls, boxes)
    loss_full.backward()
    grads_full = grads()

    def half(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        keep = (batch_idx >= 2 * rank) & (batch_idx < 2 * rank + 2)
        return x[2 * rank : 2 * rank + 2], batch_idx[keep] - 2 * rank, cls[keep], boxes[keep]

    local_sums: list[torch.Tensor] = []
    for rank in range(2):
        recorder = EndToEndLoss(
            NC, STRIDES, epochs=5, gains=DEFAULT_GAINS, normalizer_reduce=lambda t: local_sums.append(t) or t
        )
        with torch.no_grad():
            xr, *labels = half(rank)
            recorder(head(xr), *labels)
    global_sum = local_sums[0] + local_sums[1]
    assert global_sum.shape == (2,) and bool((global_sum > 1).all())  # the clamp at 1 must not hide a mistake

    half_grads, half_items = [], []
    for rank in range(2):
        criterion = EndToEndLoss(
            NC,
            STRIDES,
            epochs=5,
            gains=DEFAULT_GAINS,
            normalizer_reduce=lambda t: global_sum.clone(),
            world_size=2,
        )
        criterion.set_epoch(2)
        xr, *labels = half(rank)
        loss, items = criterion(head(xr), *labels)
        loss.backward()
        half_grads.append(grads())
        half_items.append(items)

    torch.testing.assert_close((half_items[0] + half_items[1]) / 2, items_full, rtol=1e-9, atol=1e-12)
    for g_full, g0, g1 in zip(grads_full, *half_grads):
        torch.testing.assert_close((g0 + g1) / 2, g_full, rtol=1e-6, atol=1e-9)
    assert all(float(g.abs().sum()) > 0 for g in grads_full)  # both branches learned


def test_loss_decreases_when_training_a_tiny_head() -> None:
    gen = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    head = TinyE2EHead()
    x = torch.randn(2, 4, 8, 8, generator=gen)
    labels = random_labels(gen, [2, 3])
    criterion = EndToEndLoss(NC, STRIDES, epochs=2, gains=DEFAULT_GAINS)
    opt = torch.optim.SGD(head.parameters(), lr=0.01, momentum=0.9)
    first = last = 0.0
    for step in range(40):
        loss, _ = criterion(head(x), *labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = float(loss.detach()) if step == 0 else first
        last = float(loss.detach())
    assert last < 0.5 * first
