"""How a global ``batch`` is split over the ranks, and how many steps accumulate into one optimizer update.

``batch`` is the number of images per step of the *planned* world: every rank takes ``batch / planned_world``
images per step, and ``round(nbs / batch)`` steps (at least 1) make one update of ``batch * that`` images.
The planned world is the world the run was started for: the current one, except under elastic membership
(``nnodes=MIN:MAX``), where it is the full ``MAX`` nodes. When fewer nodes are there (one has left, or has not
joined yet), each rank keeps its per-rank batch (so its memory use does not grow) and more steps accumulate
into each update, so an update still sees the same number of images; where the smaller world does not divide
it evenly, the nearest whole number of steps is taken.

Because the training sampler cuts one permutation into global batches of ``local_batch * world``, two steps
of a 2-rank world are exactly the images of one step of the 4-rank world it stands in for.

>>> batch_plan(batch=64, nbs=64, world=2, planned_world=4)
BatchPlan(local_batch=16, step_images=32, accumulate=2, update_images=64, planned_world=4)
"""

from __future__ import annotations

from dataclasses import dataclass

from detrain.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    """Per-rank batch, images per step over all ranks, steps per update (after warmup), and the update size the
    run was planned with (``step_images * accumulate`` equals it when the world divides it)."""

    local_batch: int
    step_images: int
    accumulate: int
    update_images: int
    planned_world: int


def planned_world_size(nodes: tuple[int, int], world: int, local_world: int) -> int:
    """The world the batch is planned for: ``MAX * local_world`` for ``nnodes=MIN:MAX`` (``nodes``: (MIN, MAX), as
    parsed from it), else ``world``.

    >>> planned_world_size((1, 4), world=2, local_world=2), planned_world_size((2, 2), world=4, local_world=2)
    (8, 4)
    """
    lo, hi = nodes
    return world if lo == hi else max(world, hi * local_world)


def check_split(batch: int, planned_world: int) -> int:
    """The per-rank batch; ``ConfigError`` if ``batch`` does not split evenly over the ``planned_world`` ranks.

    Called where the run is planned (before any process starts) and by each training worker once its world has
    formed (under torchrun, or resuming a checkpoint's batch, only the worker knows the planned world).

    >>> check_split(16, 4)
    4
    """
    if batch < 1 or batch % planned_world:
        up = max(planned_world, -(-batch // planned_world) * planned_world)
        raise ConfigError(
            f"batch={batch} does not split evenly over the {planned_world} workers this run is planned "
            f"for; use a multiple of {planned_world}, e.g. {up}"
        )
    return batch // planned_world


def batch_plan(batch: int, nbs: int, world: int, planned_world: int) -> BatchPlan:
    """The plan for ``world`` ranks of a run planned for ``planned_world``, whose ranks split ``batch`` evenly
    (:func:`check_split` said so before anything loaded).

    >>> batch_plan(batch=16, nbs=64, world=2, planned_world=2)
    BatchPlan(local_batch=8, step_images=16, accumulate=4, update_images=64, planned_world=2)
    """
    local = batch // planned_world
    update_images = batch * max(round(nbs / batch), 1)
    step_images = local * world
    return BatchPlan(local, step_images, max(round(update_images / step_images), 1), update_images, planned_world)
