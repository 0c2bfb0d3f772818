"""Evaluation: the validator every rank runs on its shard (``validator``, used by training too),
``detrain val`` as a worker (``val_worker``) and scoring an existing predictions file (``score_file``).
"""
