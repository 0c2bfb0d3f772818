"""What every rank's epoch numbers (:mod:`detrain.engine.telemetry.epoch_monitor`, gathered once) say about the
world: the
results.csv / TensorBoard columns, and which ranks straggle and why.

Columns, appended after the losses, metrics and learning rates, in this order:

* ``images_per_s``: training images of every rank over the slowest rank's epoch time;
* ``step_ms_mean``, ``step_ms_slowest_rank``: the mean step time over ranks, and the largest rank's mean (a
  step runs from its batch's arrival to the end of its update, waiting for slower ranks included);
* ``slowest_rank``: the rank the others wait for - the largest own time per step, data wait + forward;
* ``data_wait_share_slowest_rank``: the share (0-1) of that rank's time per step spent waiting for its data loader
  (near 1: the loader is the bottleneck; raise ``workers`` or use ``cache``);
* per node N (0, 1, ... as in ``events.jsonl``'s world layout): ``nodeN/cpu_pct`` (CPU time of the node's workers
  and their loader processes over the training loop, % of one core), ``nodeN/rss_gb`` (their resident memory at
  the epoch's end, GB), and on CUDA ``nodeN/gpu_mem_gb`` (the largest peak allocated on one of the node's GPUs
  this epoch, GB) and ``nodeN/gpu_util_pct`` (the mean over its GPUs, where NVML is available).

>>> rank = {"images": 4, "epoch_s": 1.0, "step_s": 0.1, "wait_s": 0.0, "forward_s": 0.05, "cpu_pct": 90.0,
...         "rss_bytes": 2e9, "gpu_mem_bytes": None, "gpu_util_pct": None, "node": 0}
>>> slow = dict(rank, rank=1, wait_s=0.3, node=1)
>>> cols = columns([dict(rank, rank=0), slow])
>>> cols["slowest_rank"], round(cols["data_wait_share_slowest_rank"], 2), cols["node1/rss_gb"]
(1, 0.75, 2.0)
>>> [(s["rank"], s["cause"]) for s in stragglers([dict(rank, rank=0), slow])]
[(1, 'data_wait')]
"""

from __future__ import annotations

import statistics
from typing import Any

STRAGGLER_FACTOR = 2.0  # a rank's own time per step above this many times the other ranks' median ...
STRAGGLER_SHARE = 0.1  # ... and by at least this share of the median iteration (it costs every rank that much)
CAUSES = {"data_wait": "wait_s", "compute": "forward_s"}


def columns(stats: list[dict[str, Any]]) -> dict[str, float]:
    """The epoch's columns (see the module's docstring) from every rank's numbers (in rank order, with ``node``)."""
    steps = [s["step_s"] for s in stats]
    slowest = max(stats, key=lambda s: s["wait_s"] + s["forward_s"])  # the first of equals: the lowest rank
    per_step = slowest["wait_s"] + slowest["step_s"]
    out: dict[str, float] = {
        "images_per_s": sum(s["images"] for s in stats) / max(max(s["epoch_s"] for s in stats), 1e-9),
        "step_ms_mean": 1000 * statistics.fmean(steps),
        "step_ms_slowest_rank": 1000 * max(steps),
        "slowest_rank": int(slowest["rank"]),
        "data_wait_share_slowest_rank": slowest["wait_s"] / per_step if per_step > 0 else 0.0,
    }
    cuda = any(s.get("gpu_mem_bytes") is not None for s in stats)
    for node in sorted({s["node"] for s in stats}):
        mine = [s for s in stats if s["node"] == node]
        out[f"node{node}/cpu_pct"] = sum(s["cpu_pct"] for s in mine)
        out[f"node{node}/rss_gb"] = sum(s["rss_bytes"] for s in mine) / 1e9
        if cuda:
            out[f"node{node}/gpu_mem_gb"] = max(s.get("gpu_mem_bytes") or 0 for s in mine) / 1e9
            utils = [s["gpu_util_pct"] for s in mine if s.get("gpu_util_pct") is not None]
            if utils:
                out[f"node{node}/gpu_util_pct"] = statistics.fmean(utils)
    return out


def stragglers(stats: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ranks whose data wait or forward time per step is far above the other ranks' median (both
    :data:`STRAGGLER_FACTOR` times it and :data:`STRAGGLER_SHARE` of the median iteration above it): one dict each
    with ``rank``, ``node``, ``host``, ``cause`` (data_wait or compute), ``ms_per_step`` and ``others_median_ms``."""
    if len(stats) < 2:
        return []
    iteration = statistics.median(s["wait_s"] + s["step_s"] for s in stats)
    found = []
    for i, s in enumerate(stats):
        for cause, key in CAUSES.items():
            others = statistics.median(o[key] for j, o in enumerate(stats) if j != i)
            if s[key] > STRAGGLER_FACTOR * others and s[key] - others >= STRAGGLER_SHARE * iteration:
                found.append(
                    {
                        "rank": int(s["rank"]),
                        "node": s.get("node"),
                        "host": s.get("host"),
                        "cause": cause,
                        "ms_per_step": round(1000 * s[key], 3),
                        "others_median_ms": round(1000 * others, 3),
                    }
                )
    return found
