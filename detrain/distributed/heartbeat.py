"""Each rank's sign of life in the rendezvous store, so that a rank whose collective timed out (or lost a peer) can
name the rank that stopped: a process that is stopped (SIGSTOP), dead, or frozen with the interpreter lock held
stops counting, while a rank merely waiting inside a collective keeps counting.

A daemon thread adds 1 to this rank's counter every ``every_s`` seconds through its own store client (the
collectives' client is never shared between threads). :func:`silent_ranks` reads every counter twice, a few beats
apart, and returns the ranks whose counter did not move. The keys are per restart attempt, like the barriers'.

A store that cannot be reached for a while (a network drop, node 0's machine busy) does not end the heartbeat: the
thread makes a new client and goes on beating once the store answers again, so a blip shorter than the collectives'
timeout leaves every counter moving afterwards and nobody is named. While the store cannot be read, nobody is
named either (:meth:`Heartbeat.silent` returns [] without two readings).

>>> silent_ranks()  # no group, no heartbeat: nobody to name
[]
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as tdist

EVERY_S = 1.0
_PREFIX = "detrain/heartbeat"

_beat: Heartbeat | None = None


class Heartbeat:
    """This rank's counter, advanced by a daemon thread, and a reader of every rank's counter."""

    def __init__(
        self, store: Any, rank: int, world: int, every_s: float = EVERY_S, reconnect: Callable[[], Any] | None = None
    ) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self.every_s = every_s
        self.reconnect = reconnect  # a fresh client after a store error (None: the heartbeat stops there)
        self.failures = 0  # store errors met so far (each followed by a new client)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="detrain-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop counting (the counters of the others can still be read)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.every_s + 5)

    def _run(self) -> None:
        store = self.store
        while not self._stop.is_set():
            try:
                if store is None:
                    store = self.store = self.reconnect() if self.reconnect is not None else None
                if store is None:
                    return
                store.add(str(self.rank), 1)
            except Exception:  # noqa: BLE001 - the store cannot be reached now: a new client at the next beat
                self.failures += 1
                if self.reconnect is None:
                    return
                store = None
            self._stop.wait(self.every_s)

    def counts(self) -> list[int] | None:
        """Every rank's counter (``add`` of 0 reads without a wait for a missing key), or None without a store."""
        store = self.store  # the beating thread may be replacing it
        if store is None:
            return None
        try:
            return [int(store.add(str(r), 0)) for r in range(self.world)]
        except Exception:  # noqa: BLE001 - no store, no answer: nobody can be named
            return None

    def silent(self, watch_s: float | None = None) -> list[int]:
        """The other ranks whose counter did not move in ``watch_s`` seconds (three beats by default); [] when the
        store cannot tell."""
        before = self.counts()
        time.sleep(3 * self.every_s if watch_s is None else watch_s)
        after = self.counts()
        if before is None or after is None:
            return []
        return [r for r in range(self.world) if r != self.rank and after[r] == before[r]]


def start(addr: str, port: int, restarts: int, rank: int, world: int, every_s: float = EVERY_S) -> None:
    """Start this process's heartbeat in the store at ``addr:port`` (quietly none where it cannot be reached)."""
    global _beat
    stop()

    def connect() -> Any:
        client = tdist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=10))
        return tdist.PrefixStore(f"{_PREFIX}/attempt_{restarts}", client)

    try:
        store = connect()
    except Exception:  # noqa: BLE001 - e.g. a store that is not a TCPStore: run without a heartbeat
        _beat = None
        return
    _beat = Heartbeat(store, rank, world, every_s, reconnect=connect).start()


def stop() -> None:
    """Stop counting; :func:`silent_ranks` still reads the others (a rank reports after leaving the group)."""
    if _beat is not None:
        _beat.stop()


def silent_ranks(watch_s: float | None = None) -> list[int]:
    """The ranks that gave no sign of life for ``watch_s`` seconds, as this process's heartbeat sees them."""
    beat = _beat
    if beat is None:
        return []
    with contextlib.suppress(Exception):
        return beat.silent(watch_s)
    return []


def stopped_early(store: Any, max_attempt: int, min_lag_beats: int = 5) -> dict[int, float]:
    """After the workers of a launch have ended, read from ``store`` (the rendezvous store they beat into, which the
    launcher of node 0 holds): the ranks whose counter, in the latest attempt (0 to ``max_attempt``) that has any,
    stopped at least ``min_lag_beats`` beats before the highest one, each with that lead in seconds: ranks that
    froze or died well before the others ended. {} when the store holds no counters (another node's launcher, a
    c10d round's own store) or cannot be read.

    Example:
        >>> stopped_early(None, 0)
        {}
    """
    with contextlib.suppress(Exception):
        attempt = next(a for a in range(max_attempt, -1, -1) if store.check([f"{_PREFIX}/attempt_{a}/0"]))
        counts: list[int] = []
        while store.check([f"{_PREFIX}/attempt_{attempt}/{len(counts)}"]):
            counts.append(int(store.add(f"{_PREFIX}/attempt_{attempt}/{len(counts)}", 0)))
        top = max(counts)
        return {r: (top - c) * EVERY_S for r, c in enumerate(counts) if top - c >= min_lag_beats}
    return {}
