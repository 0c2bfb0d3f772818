"""Every node of a multi-node run ends when the run ends, with one line saying why.

torch's elastic agent watches only its own node's workers. When a node gives up (its workers failed with no
restarts left, or its launcher was stopped), the other nodes are not told: a node whose worker is stopped or hung
inside a collective (no timeout fires in a process that does not run) would wait for ever. So each launcher of a
run with several nodes keeps a :class:`JobWatch`: a daemon thread that reads the rendezvous store on node 0
(``master_addr:master_port``, kept by node 0's launcher for the whole launch) every ``poll_s`` seconds.

* A launcher that gives up writes its one-line reason there (:meth:`JobWatch.publish`) and waits a moment for the
  other launchers to read it (:func:`ended_together` does both sides around the launch). With a fixed node
  count any node's end ends the run; with ``nnodes=MIN:MAX`` only node 0's does (the others may leave: the
  group re-forms without them).
* A launcher that reads a reason, or cannot reach node 0's store for ``lost_after_s`` seconds (node 0's launcher
  ended, or its machine or the network is gone; the run's ``dist_timeout``, so that a network drop the collectives
  would ride out does not end a node either), interrupts its own main thread (the agent then stops its workers,
  as on Ctrl-C) and, ``kill_after_s`` later, SIGKILLs the workers still alive: a stopped process never acts on
  SIGTERM.
  The launcher then ends with :attr:`JobWatch.reason`.

What the store holds came over the network: a reason is read as at most 300 bytes of UTF-8 (bad bytes replaced)
and printed as one line by the CLI.

>>> JobWatch("127.0.0.1", 1, node_rank=1).reason is None
True
"""

from __future__ import annotations

import _thread
import contextlib
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as tdist
from torch.distributed.elastic.multiprocessing.api import SignalException

from detrain.distributed.launch.failures import signal_stop
from detrain.distributed.launch.master_store import sealed
from detrain.distributed.launch.restart_policy import AgreedStop
from detrain.errors import DistributedError, Preempted

END_KEY = "detrain/job/end"  # the reason the run ended with ("" when it completed)
SEEN_KEY = "detrain/job/seen"  # how many launchers read it
MAX_REASON = 300
PREEMPTED = "preempted"  # node 0 stopped on a preemption signal: every node saved and is ending by itself


def _client(addr: str, port: int, timeout_s: float, secret: str = "") -> Any:
    client = tdist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return sealed(client, secret)  # the reason is sealed like every value there (master_store.SealedStore)


class JobWatch:
    """Watches node 0's store for the end of the run; see the module's docstring."""

    def __init__(
        self,
        addr: str,
        port: int,
        node_rank: int,
        nnodes: int = 2,
        poll_s: float = 0.5,
        lost_after_s: float = 10.0,
        kill_after_s: float = 2.0,
        exit_after_s: float = 15.0,
        secret: str = "",
    ) -> None:
        self.addr, self.port, self.node_rank, self.nnodes = addr, port, node_rank, nnodes
        self.secret = secret
        self.poll_s, self.lost_after_s, self.kill_after_s = poll_s, lost_after_s, kill_after_s
        self.exit_after_s = exit_after_s
        self.reason: str | None = None
        self._store: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="detrain-job-watch", daemon=True)

    def start(self) -> JobWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll_s + 10)

    # ------------------------------------------------------------------ reading

    def _connect(self) -> Any:
        if self._store is None:
            self._store = _client(self.addr, self.port, min(5.0, self.lost_after_s), self.secret)
        return self._store

    def _read_end(self) -> str | None:
        """The reason in the store (None while the run goes on); raises when the store cannot be reached."""
        store = self._connect()
        if not store.check([END_KEY]):
            return None
        raw = bytes(store.get(END_KEY))[:MAX_REASON]
        with contextlib.suppress(Exception):
            store.add(SEEN_KEY, 1)
        return raw.decode("utf-8", "replace")

    def _read_into(self, box: list[tuple[str, str | None]]) -> None:
        """One read of the store, its outcome put in ``box``: ("end", reason or None) or ("error", None)."""
        try:
            box.append(("end", self._read_end()))
        except Exception:  # noqa: BLE001 - any failure to read is no answer from node 0's store
            box.append(("error", None))

    def _run(self) -> None:
        """Poll node 0's store. A read runs in a thread of its own: over a network that drops packets silently a
        TCPStore call neither answers nor fails (it waits for TCP's next retransmission, whatever its timeout), so
        "no answer for ``lost_after_s``" is measured here, from the last answer, not from a failure."""
        answered = time.monotonic()
        box: list[tuple[str, str | None]] = []
        reader: threading.Thread | None = None
        while not self._stop.wait(self.poll_s):
            if reader is None:
                reader = threading.Thread(target=self._read_into, args=(box,), name="detrain-job-read", daemon=True)
                reader.start()
            reader.join(self.poll_s)
            outcome = box.pop() if not reader.is_alive() and box else None
            if outcome is None or outcome[0] == "error":
                if outcome is not None:  # a failed read: a new client next time
                    reader, self._store = None, None
                if time.monotonic() - answered >= self.lost_after_s:
                    self._end(
                        f"lost node 0's launcher at {self.addr}:{self.port} for {self.lost_after_s:g}s (it "
                        "ended, or its machine or the network is gone)"
                    )
                    return
                continue
            reader, answered = None, time.monotonic()
            text = outcome[1]
            if text is not None:
                if text and text != PREEMPTED:  # "" is a run that completed: nothing to stop; so is a preemption
                    self._end(f"the run ended on {text}")
                return

    def _end(self, reason: str) -> None:
        """Stop this launcher: its main thread gets an interrupt (the agent stops the workers, as on Ctrl-C); the
        workers still alive after ``kill_after_s`` (stopped ones never act on a signal) are SIGKILLed. A main thread
        that still has not come out ``exit_after_s`` later is stuck inside a network call that will not return (the
        agent's rendezvous over a link that drops every packet): the launcher then says why and ends itself."""
        self.reason = " ".join(reason.split())
        _thread.interrupt_main()
        if self._stop.wait(self.kill_after_s):
            return
        for child in multiprocessing.active_children():
            with contextlib.suppress(Exception):
                child.kill()
        if self._stop.wait(self.exit_after_s):
            return
        with contextlib.suppress(Exception):
            sys.stderr.write(f"error: {self.reason}\n")
            sys.stderr.flush()
        os._exit(2)  # as the CLI's exit for a DistributedError

    # ------------------------------------------------------------------ writing

    def publish(self, reason: str, wait_s: float = 3.0) -> None:
        """Tell the other launchers the run ended (``reason``; "" when it completed), and give them up to
        ``wait_s`` to read it before this launcher (node 0: with the store) goes."""
        try:
            store = self._connect()
            store.set(END_KEY, " ".join(reason.split())[:MAX_REASON].encode())
        except Exception:  # noqa: BLE001 - node 0's store is gone: the others find that out themselves
            return
        deadline = time.monotonic() + wait_s
        while reason and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if int(store.add(SEEN_KEY, 0)) >= self.nnodes - 1:
                    return
            time.sleep(0.1)


@contextlib.contextmanager
def ended_together(
    addr: str, port: int, node_rank: int, lo: int, hi: int, lost_after_s: float = 10.0, secret: str = ""
) -> Iterator[JobWatch | None]:
    """Around a launch of ``lo:hi`` nodes (nothing to do for one): watch for the run's end; when this launch ends
    with a ``DistributedError`` or an interrupt, raise the other node's reason instead if that is what stopped it,
    else publish this node's (with ``nnodes=MIN:MAX``, node 0's only); a completed run says so for the others."""
    watch = JobWatch(addr, port, node_rank, hi, lost_after_s=lost_after_s, secret=secret).start() if hi > 1 else None
    try:
        yield watch
    except Preempted:
        # every rank saved at the same step and every launcher ends with it: the others must not take node 0's
        # going for a failure (nor wait for it: its agent skips the exit barrier)
        if watch is not None and node_rank == 0:
            watch.stop()  # this node's own watch must not count as a node that read it
            watch.publish(PREEMPTED)
        raise
    except (DistributedError, KeyboardInterrupt, SignalException) as e:
        # SignalException: the watch's interrupt reached torch's SIGINT handler outside the launch's own handling
        # (while this node was already reporting another failure)
        if watch is not None:
            watch.stop()
            # another node ended the run: this node's own error only follows from that, unless every node reached
            # that end alike by itself (restart_policy.AgreedStop: its own line is the story)
            if watch.reason and not isinstance(e, AgreedStop):
                raise DistributedError(watch.reason) from None
        if watch is not None and (lo == hi or node_rank == 0):  # with nnodes=MIN:MAX the others may leave
            what = "interrupted" if isinstance(e, SignalException) else (str(e) or "interrupted")
            watch.publish(f"node {node_rank}: {what}")
        if isinstance(e, SignalException):  # as the launch reports one it catches itself
            raise signal_stop(e) from None
        raise
    finally:
        if watch is not None:
            watch.stop()
    if watch is not None and node_rank == 0:
        watch.publish("")
