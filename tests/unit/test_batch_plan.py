"""How the global batch splits over ranks and accumulates into updates, on the planned and on a smaller world."""

from __future__ import annotations

import pytest

from detrain.data.loader import GlobalBatchSampler
from detrain.engine.train.batch_plan import BatchPlan, batch_plan, check_split, planned_world_size
from detrain.errors import ConfigError


@pytest.mark.parametrize("batch", [1, 2, 8, 16, 24, 32, 64, 96, 128, 256])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_the_planned_world_splits_the_batch_and_accumulates_to_nbs(batch: int, world: int) -> None:
    if batch % world:
        with pytest.raises(ConfigError):
            check_split(batch, world)
        return
    plan = batch_plan(batch, 64, world, world)
    assert plan.local_batch == check_split(batch, world)
    assert plan.local_batch * world == plan.step_images == batch
    assert plan.accumulate == max(round(64 / batch), 1)  # YOLOv8's rule
    assert plan.update_images == plan.step_images * plan.accumulate


@pytest.mark.parametrize(
    ("world", "expected"),
    [
        (4, BatchPlan(16, 64, 1, 64, 4)),
        (2, BatchPlan(16, 32, 2, 64, 4)),  # half the ranks: twice the steps, the same 64 images per update
        (1, BatchPlan(16, 16, 4, 64, 4)),
        (3, BatchPlan(16, 48, 1, 64, 4)),  # 64 / 48 images: the nearest whole number of steps
    ],
)
def test_a_smaller_world_keeps_the_per_rank_batch_and_accumulates_more(world: int, expected: BatchPlan) -> None:
    assert batch_plan(64, 64, world, planned_world=4) == expected


def test_accumulation_below_nbs_scales_with_the_missing_ranks() -> None:
    assert batch_plan(16, 64, 2, planned_world=8) == BatchPlan(2, 4, 16, 64, 8)


def test_the_error_names_the_planned_world_and_a_valid_batch() -> None:
    with pytest.raises(ConfigError, match=r"batch=6 does not split evenly over the 4 workers .* e\.g\. 8"):
        check_split(6, 4)
    with pytest.raises(ConfigError, match=r"multiple of 4, e\.g\. 12"):
        check_split(10, 4)
    with pytest.raises(ConfigError, match=r"batch=1 .* e\.g\. 2"):
        check_split(1, 2)  # fewer images than workers


def test_planned_world_size() -> None:
    assert planned_world_size((1, 1), world=2, local_world=2) == 2
    assert planned_world_size((2, 2), world=4, local_world=2) == 4
    assert planned_world_size((1, 4), world=2, local_world=2) == 8  # all 4 nodes of 2 workers
    assert planned_world_size((2, 3), world=6, local_world=2) == 6


def test_steps_of_a_smaller_world_hold_exactly_the_images_of_the_planned_worlds_steps() -> None:
    """2 ranks x 2 images, 2 steps per update == 4 ranks x 2 images, 1 step per update: the same images in the
    same order, with the same mosaic partner pools (so the same pixels)."""
    n, local = 40, 2
    for epoch in range(3):
        full, half = _steps(local, 4, epoch, n), _steps(local, 2, epoch, n)
        assert len(full) == 5 and len(half) == 10
        for k, step in enumerate(full):
            assert step == half[2 * k] + half[2 * k + 1]


def _steps(local: int, world: int, epoch: int, n: int) -> list[list[tuple[int, tuple[int, ...]]]]:
    """(image index, mosaic pool) of every step of an epoch, ranks in order."""
    per_rank = []
    for rank in range(world):
        sampler = GlobalBatchSampler(n, local, rank=rank, world_size=world, seed=0, shuffle=True, planned_world=4)
        sampler.set_epoch(epoch)
        per_rank.append([[(p.index, p.pool) for p in step] for step in sampler])
    return [[pick for r in range(world) for pick in per_rank[r][s]] for s in range(len(per_rank[0]))]
