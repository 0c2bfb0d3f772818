"""A training run's state on disk and across restarts: the Checkpointer (``checkpointer``) and what it owns: where a
run starts, agreed by every rank (``resume_state``), the run record sent with a checkpoint (``run_record``), the run
folder's lock (``run_lock``), mid-epoch saves (``mid_epoch``), preemption (``preemption``) and copies on other nodes
(``replicas``). It imports the training recipe below it (``ema``, ``accumulation``, ``optim``, ``reproduce``), never
the trainer.
"""
