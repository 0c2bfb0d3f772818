"""Worker functions for tests/integration/test_train_keys.py's two-rank tests (spawned workers import their
entry by name)."""

from __future__ import annotations

from typing import Any

from detrain.distributed import dist
from detrain.distributed.world import World


def time_estimates(args: dict[str, Any], world: World) -> list[list[int]]:
    """Each rank reads its own clock (``args["ticks"][rank]``: the seconds it reads at the start and after each
    epoch); returns, per epoch, what every rank got from ``epochs_that_fit`` (all-gathered)."""
    from detrain.engine.train import time_budget

    dist.setup(world, timeout_s=30.0)
    ticks = iter(args["ticks"][world.rank])
    time_budget.clock = lambda: float(next(ticks))
    budget = time_budget.TimeBudget(args["hours"])
    out = [dist.all_gather_object(budget.epochs_that_fit(done)) for done in range(1, len(args["ticks"][0]))]
    dist.barrier("end")
    return out
