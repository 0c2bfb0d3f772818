"""Preemption: SIGTERM or SIGUSR1 saves the run where it stands and ends it as "preempted, resumable".

Clusters take machines back with a warning signal and a grace period: SLURM sends SIGTERM (or, with
``--signal=USR1@90``, SIGUSR1 that long before its time limit) and SIGKILL after ``KillWait``; Kubernetes and spot
reclaims send SIGTERM and SIGKILL after ``terminationGracePeriodSeconds``. With ``grace`` > 0 a training process
catches both signals (:meth:`Preemption.install`; a worker under an elastic agent SIGUSR1 only, as the agent stops
workers with SIGTERM to restart them, and detrain's launcher passes either signal on as SIGUSR1): the handler only
raises a flag. The flag travels with the
all-reduce every step already makes (the batch's loss items, :meth:`Preemption.attach` / :meth:`Preemption.read`),
so all ranks learn of it at the same step however many of them got the signal: a signal to one worker, to one
node's launcher (torch's elastic agent passes it on to that node's workers, :mod:`detrain.distributed.launch`) or to
every process of the job is the same agreed stop. At that step every rank saves ``mid.pt`` together
(:mod:`detrain.engine.train.state.mid_epoch`; at an epoch's last batch the epoch finishes and ``last.pt`` is the place)
and raises :class:`detrain.errors.Preempted`. A resumed run starts at the next batch and ends bitwise equal to an
uninterrupted one (tests/integration/test_preemption.py; with gradients waiting on several ranks, to float
rounding: they are averaged when mid.pt is saved).

How the process ends: the CLI prints one line and exits :data:`detrain.errors.EXIT_PREEMPTED` (75, EX_TEMPFAIL:
"try again"); workers spawned by detrain's launcher leave a note in the node's launch folder
(:mod:`detrain.distributed.preempt_mark`) and return normally, so that torch's agent does not count a restart, and
the launcher exits 75 with the note's line.

What is not covered: a signal during validation or before the first step acts at the next training step, so a
long validation can outlast a short grace; ``grace=0`` keeps the old behaviour (the signal ends the process).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch

from detrain.distributed.preempt_mark import SIGNALS, relayed_signal


class Preemption:
    """The preemption flag of one training process (see the module); inert with ``grace_s`` = 0."""

    def __init__(self, grace_s: float, launcher: str = "none") -> None:
        self.enabled = grace_s > 0
        # under an elastic agent (detrain's launcher, torchrun) SIGTERM is also how the agent stops its workers to
        # restart them: there the workers leave SIGTERM alone and take SIGUSR1, which detrain's launcher sends them
        # for either signal it gets itself
        self.catches = ("SIGUSR1",) if launcher in ("detrain", "torchrun") else SIGNALS
        self.signal: str | None = None  # the first signal that arrived here, or (once agreed) at another rank
        self.agreed = False  # some rank got one: the same on every rank after the step's all-reduce
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Catch SIGTERM and SIGUSR1 in this process (main thread only; a no-op elsewhere or when disabled)."""
        if not self.enabled or threading.current_thread() is not threading.main_thread():
            return
        for name in self.catches:
            sig = getattr(signal, name, None)
            if sig is not None and sig not in self._previous:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        """Put back the handlers :meth:`install` replaced (where nobody replaced ours since)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in list(self._previous.items()):
            if signal.getsignal(sig) == self._on_signal and handler is not None:
                signal.signal(sig, handler)
            del self._previous[sig]

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """:meth:`install` for the ``with`` block, :meth:`uninstall` after it however it ends."""
        self.install()
        try:
            yield
        finally:
            self.uninstall()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is None:  # a second signal (the grace period's SIGTERM after SIGUSR1) changes nothing
            self.signal = relayed_signal() or signal.Signals(signum).name  # the launcher's, where it passed it on

    def attach(self, items: torch.Tensor) -> torch.Tensor:
        """``items`` with one flag per signal appended (1 where this process got it), for the step's all-reduce;
        ``items`` itself when disabled. An all-reduce sums element by element: the items' values do not change."""
        if not self.enabled:
            return items
        return torch.cat((items, items.new_tensor([1.0 if self.signal == name else 0.0 for name in SIGNALS])))

    def read(self, reduced: torch.Tensor) -> torch.Tensor:
        """The items back from :meth:`attach`'s reduced tensor; whether any rank was signalled, and with what, is
        now known to every rank (:attr:`agreed`, :attr:`signal`)."""
        if not self.enabled:
            return reduced
        got = [name for name, n in zip(SIGNALS, reduced[-len(SIGNALS) :].tolist()) if n > 0]
        if got and not self.agreed:
            self.agreed = True
            self.signal = self.signal or got[0]  # the group's word: every rank names the same signal
        return reduced[: -len(SIGNALS)]
