"""Training on one rank: the trainer's named steps (``trainer``), the recipe (``optim``, ``ema``,
``accumulation``, ``batch_plan``, ``freeze``, ``pretrained``, ``time_budget``), seeds and generator states
(``reproduce``), the user's callbacks, and in ``state/`` the Checkpointer: where a run starts and how it survives
restarts, preemption and the loss of a node.
"""
