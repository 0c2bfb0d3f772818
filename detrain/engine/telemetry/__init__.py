"""What a run records about itself: ``events.jsonl`` and ``manifest.json`` (``events``,
``manifest``, kept by ``run_trace``), each rank's epoch measurements and their summary (``epoch_monitor``,
``epoch_stats``, ``step_clock``, ``proc_usage``, ``gpu_usage``). Rank 0 writes; every rank measures.
"""
