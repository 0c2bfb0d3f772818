"""Preemption: SIGTERM or SIGUSR1 saves the run where it stands and ends it as "preempted, resumable".

Clusters take machines back with a warning signal and a grace period: SLURM sends SIGTERM (or, with
``--signal=USR1@90``, SIGUSR1 that long before its time limit) and SIGKILL after ``KillWait``; Kubernetes and spot
reclaims send SIGTERM and SIGKILL after ``terminationGracePeriodSeconds``. With ``grace`` > 0 a training process
catches both signals (:meth:`Preemption.install`): the handler only raises a flag.

SIGTERM under an elastic agent is two things: the cluster's warning (SLURM's ``scancel`` or time limit, ``kill --
-PGID`` and a container runtime signal every process of the job, the agent and its workers at once) and the way the
agent stops healthy workers to restart them. Under detrain's launcher the two are told apart by the launcher's word:
a launcher that got the signal itself writes it in its launch folder at once (:func:`preempt_mark.relayed_signal`),
so a worker's SIGTERM is a preemption when that word is there within :data:`LAUNCHER_WORD_S`, and otherwise the
agent's stop, which ends the worker as SIGTERM always did. Under torchrun (whose agent says nothing to its workers)
SIGTERM is always a preemption: an agent stopping healthy workers to restart them finds them saving ``mid.pt``
first, and its restart resumes from there; a worker blocked in a collective with a lost peer ends at the agent's
kill, ``shutdown_timeout`` later (30 s by default). Under srun every process is a worker and catches both.

The flag travels with the all-reduce every step already makes (the batch's loss items, :meth:`Preemption.attach` /
:meth:`Preemption.read`), so all ranks learn of it at the same step however many of them got the signal: a signal to
one worker, to one node's launcher (torch's elastic agent passes it on to that node's workers,
:mod:`detrain.distributed.launch.launcher`) or to every process of the job is the same agreed stop. At that step every
rank saves ``mid.pt`` together
(:mod:`detrain.engine.train.state.mid_epoch`; at an epoch's last batch the epoch finishes and ``last.pt`` is the place)
and raises :class:`detrain.errors.Preempted`. A resumed run starts at the next batch and ends bitwise equal to an
uninterrupted one (tests/integration/test_preemption.py; with gradients waiting on several ranks, to float
rounding: they are averaged when mid.pt is saved).

How the process ends: the CLI prints one line and exits :data:`detrain.errors.EXIT_PREEMPTED` (75, EX_TEMPFAIL:
"try again"); workers spawned by detrain's launcher leave a note in the node's launch folder
(:mod:`detrain.distributed.launch.preempt_mark`) and return normally, so that torch's agent does not count a restart,
and the launcher exits 75 with the note's line.

What is not covered: a signal during validation or before the first step acts at the next training step, so a
long validation can outlast a short grace; ``grace=0`` keeps the old behaviour (the signal ends the process).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch

from detrain.distributed.launch.preempt_mark import SIGNALS, relayed_signal

# how long a worker of detrain's launcher waits for the launcher's word after a SIGTERM: a signal to the whole
# process group reaches the launcher at the same instant, and its handler writes the word within milliseconds
LAUNCHER_WORD_S = 2.0


def _launcher_word(wait_s: float) -> str | None:
    """The signal this worker's launcher says it got, waiting up to ``wait_s`` for it; None when it says nothing."""
    deadline = time.monotonic() + wait_s
    while True:
        said = relayed_signal()
        if said is not None or time.monotonic() >= deadline:
            return said
        time.sleep(0.02)


class Preemption:
    """The preemption flag of one training process (see the module); inert with ``grace_s`` = 0."""

    def __init__(self, grace_s: float, launcher: str = "none") -> None:
        self.enabled = grace_s > 0
        self.catches = SIGNALS
        # detrain's launcher stops its workers with SIGTERM to restart them: a SIGTERM counts only with its word
        self.term_needs_launcher = launcher == "detrain"
        self.signal: str | None = None  # the first signal that arrived here, or (once agreed) at another rank
        self.agreed = False  # some rank got one: the same on every rank after the step's all-reduce
        self._previous: dict[int, Any] = {}
        self._flags: dict[tuple[str | None, torch.device, torch.dtype], torch.Tensor] = {}  # attach's, on the device

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
        if self.signal is not None:  # a second signal (the grace period's SIGTERM after SIGUSR1) changes nothing
            return
        relayed = relayed_signal()
        if signum == signal.SIGTERM and self.term_needs_launcher and relayed is None:
            relayed = _launcher_word(LAUNCHER_WORD_S)
            if relayed is None:  # the agent stopping this worker to restart the group: end as SIGTERM ends it
                self._end_as_before(signum, frame)
                return
        self.signal = relayed or signal.Signals(signum).name  # the launcher's, where it passed it on

    def _end_as_before(self, signum: int, frame: FrameType | None) -> None:
        """What this signal did before :meth:`install`: the handler that was there, or the default action."""
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
            return
        if previous == signal.SIG_IGN:
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def attach(self, items: torch.Tensor) -> torch.Tensor:
        """``items`` with one flag per signal appended (1 where this process got it), for the step's all-reduce;
        ``items`` itself when disabled. An all-reduce sums element by element: the items' values do not change.
        The flags are made once per signal on the items' device (no copy from the host at every step)."""
        if not self.enabled:
            return items
        key = (self.signal, items.device, items.dtype)
        flags = self._flags.get(key)
        if flags is None:
            flags = self._flags[key] = items.new_zeros(len(SIGNALS))
            if self.signal in SIGNALS:
                flags[SIGNALS.index(self.signal)] = 1.0
        return torch.cat((items, flags))

    def read(self, reduced: list[float]) -> list[float]:
        """The values before :meth:`attach`'s flags, from the reduced tensor as the step read it to the host; whether
        any rank was signalled, and with what, is now known to every rank (:attr:`agreed`, :attr:`signal`)."""
        if not self.enabled:
            return reduced
        got = [name for name, n in zip(SIGNALS, reduced[-len(SIGNALS) :]) if n > 0]
        if got and not self.agreed:
            self.agreed = True
            self.signal = self.signal or got[0]  # the group's word: every rank names the same signal
        return reduced[: -len(SIGNALS)]
