"""One rank of a group whose ranks each play a node with a disk of its own (their own working folder): it runs
:func:`detrain.engine.train.state.resume_state.agree` once per case and writes what it agreed on to ``agreed.json``
there.

Run as ``python _agree_node.py CASES_JSON`` with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, LOCAL_RANK 0
and LOCAL_WORLD_SIZE 1 (every rank is the first process of its node). A case: ``{"save_dir": str | None,
"cfg": {...}}``; every rank gets the same cases, and the launch id ``L``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from detrain.config.cfg import make_cfg
from detrain.distributed import dist
from detrain.distributed.world import World
from detrain.engine.train.state import resume_state
from detrain.errors import DetrainError


def main(cases: list[dict]) -> None:
    world = World.from_env().on("cpu")  # this process's place, read once; every rank on the CPU (gloo)
    dist.setup(world, timeout_s=30.0)
    out = []
    try:
        for case in cases:
            launch = resume_state.Launch("L", None, 0, 1, False)
            try:
                start = resume_state.agree(make_cfg(case["cfg"]), case["save_dir"], launch, world)
            except DetrainError as e:
                out.append({"error": str(e)})
                continue
            out.append(
                {
                    "epoch": None if start.ckpt is None else start.ckpt["epoch"],
                    "resume": start.cfg.train.resume,
                    "save_dir": None if start.save_dir is None else str(start.save_dir),
                }
            )
    finally:
        dist.cleanup()
    Path("agreed.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
