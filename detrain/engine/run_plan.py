"""What the launching process decides once for a run and hands to every worker in its arguments: :class:`RunPlan`.

``detrain train`` / ``detrain val`` make it in :func:`detrain.run.task.run_task`, before any worker starts; every
worker (spawned here, on another node by its own launcher, or restarted) receives it as it is and computes none
of it again. The devices themselves go to the launcher (:class:`detrain.distributed.launch.devices.DevicePlan`), which
gives each worker its own device through its :class:`detrain.distributed.world.World`.
It lives in the engine, which receives it, so that no worker reaches up into :mod:`detrain.run`, which makes it.

>>> RunPlan(nodes=(1, 4)).nodes
(1, 4)
"""

from __future__ import annotations

from dataclasses import dataclass

from detrain.nn.head import register_head, registered_heads


def user_heads() -> tuple[tuple[str, type], ...]:
    """The heads registered in this process beyond detrain's own, as (name, class): what a spawned worker, which
    imported none of their modules, must register too (:meth:`RunPlan.register_heads`).

    >>> all(not cls.__module__.startswith("detrain.") for _, cls in user_heads())
    True
    """
    return tuple(
        (name, cls) for name, cls in sorted(registered_heads().items()) if not cls.__module__.startswith("detrain.")
    )


@dataclass(frozen=True)
class RunPlan:
    """The node count, the run folder and the launch's id, as decided by the launching process.

    ``nodes``: ``nnodes=`` parsed, (MIN, MAX); the batch is planned for MAX nodes (``engine.batch_plan``).
    ``save_dir``: the run folder, picked on node 0 before its workers start so that restarted workers write to the
    same one; None where rank 0 picks it itself (one process, torchrun, srun) or a resumed run names it.
    ``launch_id``: this launch's id, stamped into its checkpoints so that a restart resumes from them and not from
    an older run's in the same folder (``engine.resume_state``); None outside detrain's launcher on node 0.
    ``heads``: the heads a user registered in the launching process (:func:`user_heads`), their classes pickled by
    reference into spawned workers, which register them before building the model (:meth:`register_heads`).
    """

    nodes: tuple[int, int] = (1, 1)
    save_dir: str | None = None
    launch_id: str | None = None
    heads: tuple[tuple[str, type], ...] = ()

    def register_heads(self) -> None:
        """Register :attr:`heads` in this process (a no-op where they are already: the launching process)."""
        for name, cls in self.heads:
            register_head(cls, name)
