"""The work of one rank: training (``train``), evaluation (``evaluate``), prediction (``predict``) and what a
run records about itself (``telemetry``); ``build`` turns arguments into the model and run folder all three use,
``run_plan`` holds what the launching process decided for every worker, ``export`` writes inference files.
Reaches other ranks only through :mod:`detrain.distributed`, receives its :class:`~detrain.distributed.world.World`
and never reads the environment.
"""
