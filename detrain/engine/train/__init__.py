"""Training on one rank: the trainer's named steps (``trainer``), the recipe (``optim``, ``ema``,
``accumulation``, ``batch_plan``, ``freeze``, ``pretrained``, ``time_budget``), where a run starts and how it
survives restarts (``resume_state``, ``reproduce``, ``mid_epoch``, ``run_record``) and the user's callbacks.
"""
