"""Evaluation: the validator every rank runs on its shard (``validator``, used by training too),
``detrain val`` as a worker (``val_worker``), scoring an existing predictions file (``score_file``) and what a
validation shows besides its numbers: its table and pictures, training's last one kept until the run ends
(``val_outputs``).
"""
