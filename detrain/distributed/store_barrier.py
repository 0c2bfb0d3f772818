"""A barrier through the rendezvous store, for gloo: every rank marks its arrival under the barrier's sequence
number and waits, at most the timeout, for every rank's mark. gloo's own monitored barrier bounds only rank 0's
wait (the other ranks wait for rank 0 without end); here every rank's wait is bounded, and a timeout names the
ranks whose mark is missing.

Usage, on every rank of a world of two (so not run as a test): ``barrier = StoreBarrier.connect("127.0.0.1",
29500, restarts=0, timeout=timedelta(seconds=5))``, then ``barrier.wait(rank=0, world=2, timeout_s=120)``.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch.distributed as tdist

from detrain.distributed.launch.master_store import sealed


class Absent(Exception):
    """Ranks that did not come to a barrier in time."""

    def __init__(self, ranks: list[int]):
        super().__init__(", ".join(map(str, ranks)))


class StoreBarrier:
    """Barriers over ``store``; every rank passes the same barriers in the same order, so a running count
    names each one."""

    def __init__(self, store: Any):
        self.store = store
        self.count = 0

    @classmethod
    def connect(cls, addr: str, port: int, restarts: int, timeout: timedelta, secret: str = "") -> StoreBarrier | None:
        """A client of the rendezvous store at ``addr:port`` (the elastic agent's, or rank 0's under env://),
        with keys of its own per restart attempt, their values sealed with ``secret`` where there is one
        (:mod:`detrain.distributed.launch.master_store`); None where no such store can be reached."""
        try:
            client = tdist.TCPStore(addr, port, is_master=False, timeout=timeout)
        except Exception:  # noqa: BLE001 - e.g. a store that is not a TCPStore: the caller keeps torch's barrier
            return None
        return cls(sealed(tdist.PrefixStore(f"detrain/barriers/attempt_{restarts}", client), secret))

    def wait(self, rank: int, world: int, timeout_s: float) -> None:
        """Mark this rank's arrival at the next barrier and wait, at most ``timeout_s``, for every rank's mark;
        :class:`Absent` names the ranks that did not come."""
        self.count += 1
        keys = [f"{self.count}/{r}" for r in range(world)]
        self.store.set(keys[rank], "1")
        try:
            self.store.wait(keys, timedelta(seconds=timeout_s))
        except Exception as e:
            try:
                missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
            except Exception:  # noqa: BLE001 - the store itself is gone (its host died): the original error stands
                raise e from None
            if not missing:
                raise
            raise Absent(missing) from None
        if self.count > 1:  # everyone has left the previous barrier: its mark is no longer needed
            with contextlib.suppress(Exception):
                self.store.delete_key(f"{self.count - 1}/{rank}")
