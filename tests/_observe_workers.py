"""A training worker with a slow data loader on one rank, for tests/integration/test_monitoring.py.

Spawned workers import their entry by name, so it lives at the top level of an importable module. The slowness is
injected here, by wrapping the trainer's ``build_train_loader`` in the worker: nothing in detrain knows about it.

``python tests/_observe_workers.py node NODE_RANK PORT ARGS_JSON`` runs one of two "nodes" on 127.0.0.1 (one CPU
worker each) of ``slow_loader_train(ARGS)``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from detrain.distributed.world import World


def slow_loader_train(args: dict[str, Any], world: World) -> dict[str, Any]:
    """``train_worker(args, world)``, with rank ``args["slow_rank"]``'s loader sleeping ``args["sleep_s"]`` a batch."""
    from detrain.config.cfg import make_cfg
    from detrain.engine.run_plan import RunPlan
    from detrain.engine.train import trainer

    real = trainer.build_train_loader

    def build(data: Any, cfg: Any, local_batch: int, here: World, planned_world: int | None = None) -> Any:
        loader = real(data, cfg, local_batch, here, planned_world)
        if here.rank == args["slow_rank"]:
            collate = loader.collate_fn

            def slow_collate(samples: Any) -> Any:  # runs inside next(loader) (workers=0): the rank waits for data
                time.sleep(args["sleep_s"])
                return collate(samples)

            loader.collate_fn = slow_collate
        return loader

    trainer.build_train_loader = build
    # the JSON's keys, checked as a command would; what detrain's runner would have planned: two nodes, the run folder
    # the test names
    return trainer.train_worker(
        {**args, "cfg": make_cfg(args["cfg"]), "plan": RunPlan(nodes=(2, 2), save_dir=args["save_dir"])}, world
    )


def _main(argv: list[str]) -> int:
    import _observe_workers as mod  # by module name, so spawned workers can import the entry

    from detrain.distributed.launch.launcher import launch, parse_device

    if argv[0] != "node":
        raise SystemExit(f"unknown mode {argv[0]!r}")
    node_rank, port, args = int(argv[1]), int(argv[2]), json.loads(argv[3])
    launch(mod.slow_loader_train, args, parse_device("cpu"), nnodes="2", node_rank=node_rank, master_port=port)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
