"""One command, from checked arguments to the processes that run it: the files the arguments name are checked
(``preflight``), the run is planned once (devices, node range, run folder, launch id: the engine's
:class:`~detrain.engine.run_plan.RunPlan`, which every worker receives) and ``task`` hands it to the distributed
launcher or runs it here. The front doors (``cli``, ``api``) call it; the engine never does.
"""
