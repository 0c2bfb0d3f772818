"""Settings every test process shares (tests/unit and tests/integration).

Torch threads per test process: the cores divided among pytest-xdist's workers. A training in a test's own process
sets torch's threads to every core (the share of a lone worker: ``detrain.engine.build.set_cpu_threads``); under
``pytest -n 2`` on two cores that is four busy threads on two cores, and OpenMP's threads spin while they wait for
each other. Oversubscribed like this, one check of a small model's weights took 30 times as long with two threads
as with one, and a forward pass 16 times (this VM, several processes busy). ``OMP_NUM_THREADS`` is what a user sets
for the same reason and what detrain's launcher and ``set_cpu_threads`` leave alone, and the processes a test starts
inherit it. A value set outside (CI, a person) is kept; without xdist nothing changes.
"""

from __future__ import annotations

import os


def _share_cores() -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if workers <= 1 or os.environ.get("OMP_NUM_THREADS"):
        return
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    threads = max(1, cores // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch  # after the variable: OpenMP reads it when torch loads, set_num_threads covers an earlier import

    torch.set_num_threads(threads)


_share_cores()
