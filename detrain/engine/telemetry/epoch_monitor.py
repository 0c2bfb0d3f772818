"""What one rank measures about itself during an epoch, as one small picklable dict for the epoch's all_gather.

>>> monitor = EpochMonitor(torch.nn.Linear(2, 1), torch.device("cpu"))
>>> monitor.begin_epoch()
>>> for x in monitor.timed([torch.zeros(1, 2)] * 2):
...     _ = monitor.clock.model(x)
>>> sorted(monitor.sample(n_images=2, epoch_s=0.5, step_times=[0.1, 0.2]))[:4]
['cpu_pct', 'epoch_s', 'forward_s', 'gpu_mem_bytes']
>>> monitor.close()
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from detrain.distributed.world import World
from detrain.engine.telemetry.gpu_usage import GpuUsage
from detrain.engine.telemetry.proc_usage import ProcessUsage
from detrain.engine.telemetry.step_clock import StepClock

T = TypeVar("T")


class EpochMonitor:
    """This rank's data wait and forward time per step (:class:`StepClock`), its process's CPU and memory
    (:class:`ProcessUsage`) and its GPU's memory peak and utilisation (:class:`GpuUsage`), per epoch."""

    def __init__(self, model: nn.Module, device: torch.device, world: World | None = None) -> None:
        world = World() if world is None else world  # None: a plain process, rank 0 of 1
        self.rank = world.rank
        self.node_key = world.node_rank  # this rank's node as its launcher numbers it
        self.usage = ProcessUsage()
        self.gpu = GpuUsage(device)
        self.clock = StepClock(model, device, on_step=self.gpu.poll)
        self.host = socket.gethostname()

    def begin_epoch(self) -> None:
        """Start counting: CPU time, the GPU's peak and the utilisation samples cover this epoch from here."""
        self.gpu.begin_epoch()
        self.usage.sample()

    def timed(self, loader: Iterable[T]) -> Iterator[T]:
        """The epoch's batches, with the wait for each one timed."""
        return self.clock.timed(loader)

    def sample(self, n_images: int, epoch_s: float, step_times: list[float]) -> dict[str, Any]:
        """This rank's numbers for the epoch so far (seconds, bytes, percent; GPU fields None off CUDA)."""
        wait_s, forward_s = self.clock.epoch_means()
        usage = self.usage.sample()
        gpu_mem, gpu_util = self.gpu.sample()
        return {
            "rank": self.rank,
            "node_key": self.node_key,
            "host": self.host,
            "pid": os.getpid(),
            "images": int(n_images),
            "epoch_s": float(epoch_s),
            "step_s": sum(step_times) / len(step_times) if step_times else 0.0,
            "wait_s": wait_s,
            "forward_s": forward_s,
            "cpu_pct": usage.cpu_pct,
            "rss_bytes": usage.rss_bytes,
            "gpu_mem_bytes": gpu_mem,
            "gpu_util_pct": gpu_util,
        }

    def close(self) -> None:
        self.clock.close()
