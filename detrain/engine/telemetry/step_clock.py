"""Where one rank's step time goes: waiting for its data loader, and its model's own forward computation.

In synchronous data-parallel training every rank's iteration lasts as long as the slowest rank's: a fast rank
spends the difference blocked in the gradient all-reduce (or DDP's buffer broadcast at the next forward), so
its measured step time grows too and step times alone cannot tell the straggler from the ranks it holds up.
Two parts of a step are the rank's own and can: the time ``next()`` on its loader blocks (data wait) and the
time its bare model's forward takes, measured by hooks on the module DDP wraps (inside DDP's synchronisation;
with ``sync_bn`` the forward holds collectives of its own, so it then includes their waits). On CUDA the
forward is timed with CUDA events on the stream (read once, at the end of the epoch; no extra synchronisation
per step), elsewhere with the host clock.

>>> clock = StepClock(torch.nn.Linear(2, 1), torch.device("cpu"))
>>> for x in clock.timed([torch.zeros(1, 2)] * 3):
...     _ = clock.model(x)
>>> wait_s, forward_s = clock.epoch_means()
>>> wait_s >= 0 and forward_s > 0
True
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

T = TypeVar("T")


class StepClock:
    """Per epoch: the mean data wait and the mean forward time of this rank's steps."""

    def __init__(self, model: nn.Module, device: torch.device, on_step: Callable[[], None] | None = None) -> None:
        self.model = model
        self.cuda = device.type == "cuda"
        self.on_step = on_step  # called once per batch (e.g. a utilisation poll), outside the timed parts
        self.waits: list[float] = []
        self.forwards: list[float] = []
        self.events: list[tuple[Any, Any]] = []
        self._t0 = 0.0
        self._event0: Any = None
        self.handles = [
            model.register_forward_pre_hook(self._forward_start),
            model.register_forward_hook(self._forward_end),
        ]

    def _forward_start(self, *_: Any) -> None:
        if self.cuda:
            self._event0 = torch.cuda.Event(enable_timing=True)
            self._event0.record()
        else:
            self._t0 = time.perf_counter()

    def _forward_end(self, *_: Any) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((self._event0, end))
        else:
            self.forwards.append(time.perf_counter() - self._t0)

    def timed(self, loader: Iterable[T]) -> Iterator[T]:
        """``loader``'s batches, timing how long each one is waited for (the first includes starting its workers)."""
        self.waits, self.forwards, self.events = [], [], []
        t = time.perf_counter()
        it = iter(loader)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            self.waits.append(time.perf_counter() - t)
            if self.on_step is not None:
                self.on_step()
            yield batch
            t = time.perf_counter()

    def epoch_means(self) -> tuple[float, float]:
        """(mean data wait, mean forward time) in seconds over the epoch's steps so far; 0.0 for none."""
        forwards = self.forwards
        if self.events:
            torch.cuda.synchronize()
            forwards = forwards + [a.elapsed_time(b) / 1000 for a, b in self.events]
        return _mean(self.waits), _mean(forwards)

    def close(self) -> None:
        """Take the hooks off the model."""
        for h in self.handles:
            h.remove()
        self.handles = []


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
