"""What the launching process decides once for a run and hands to every worker in its arguments: :class:`RunPlan`.

``detrain train`` / ``detrain val`` make it in :func:`detrain.run.task.run_task`, before any worker starts; every
worker (spawned here, on another node by its own launcher, or restarted) receives it as it is and computes none
of it again. The devices themselves go to the launcher (:class:`detrain.distributed.devices.DevicePlan`), which
gives each worker its own device through its :class:`detrain.distributed.world.World`.
It lives in the engine, which receives it, so that no worker reaches up into :mod:`detrain.run`, which makes it.

>>> RunPlan(nodes=(1, 4)).nodes
(1, 4)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunPlan:
    """The node count, the run folder and the launch's id, as decided by the launching process.

    ``nodes``: ``nnodes=`` parsed, (MIN, MAX); the batch is planned for MAX nodes (``engine.batch_plan``).
    ``save_dir``: the run folder, picked on node 0 before its workers start so that restarted workers write to the
    same one; None where rank 0 picks it itself (one process, torchrun, srun) or a resumed run names it.
    ``launch_id``: this launch's id, stamped into its checkpoints so that a restart resumes from them and not from
    an older run's in the same folder (``engine.resume_state``); None outside detrain's launcher on node 0.
    """

    nodes: tuple[int, int] = (1, 1)
    save_dir: str | None = None
    launch_id: str | None = None
