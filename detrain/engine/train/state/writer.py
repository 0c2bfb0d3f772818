"""Checkpoint writes off the training loop's critical path: :func:`snapshot` and :class:`Writer`.

A save stops the loop only for as long as it takes to copy the checkpoint's tensors to host memory at the step's
end (:func:`snapshot`: a real copy, so the next step may change the weights at once; from a GPU into pinned
memory, non-blocking, with an event the writer waits on before it reads them). Rank 0's :class:`Writer` then
writes the files in a thread of its own while training goes on: temporary file, fsync, rename, the previous
``last.pt`` kept as ``last.prev.pt`` (:func:`detrain.weights.checkpoint.save_checkpoint`, unchanged). The rules:

* one write at a time, in order: a save first waits for the one before it (:meth:`Writer.snapshot`,
  :meth:`Writer.submit`), so that no generation overtakes another; host memory holds one snapshot (model, EMA,
  optimizer state: about 3 x the weights with SGD), kept for the run and copied into again at the next save;
* a write's error is raised in the loop, the very exception a synchronous save raised (a full disk: the one-line
  CheckpointError, the previous generation intact), at the first step's end after the write failed
  (:meth:`Writer.check`), or at the next save or the run's end if those come first (:meth:`Writer.wait`); as a
  synchronous save's error did, it ends rank 0 while the other ranks wait in a collective, and the launcher stops
  them;
* before a run ends, however it ends (its last epoch, an early stop, a preemption, an exception), the write in
  flight finishes: the final ``last.pt``, ``best.pt`` and ``mid.pt`` are on disk before the process leaves and
  before the run's end event records their sha256 (:meth:`Writer.finish` on an exception, which reports a write's
  own error as a line and leaves the run's error the one raised);
* a crash mid-write (a kill, a power loss) loses only the write in flight: a file is replaced by a rename, so the
  previous generation is whole and a resume finds the latest completed one (the temporary file goes at the next
  start).

Why a thread and not a process: the snapshot is already in this process's memory; a thread shares it for nothing,
and serialising, writing and fsync release the GIL for most of their time. Why the copies on other nodes
(:mod:`.replicas`) stay on the loop's thread: they are collectives, which must run in the same order on every rank
and never interleave with the loop's own; a thread of their own would need a process group of their own on every
rank, and a target node would need a thread waiting for them. The checkpointer sends a save's copies instead when
the next save waits for this one, or at the run's end or a preemption: the same point of the loop on every rank,
once rank 0's file is whole (the copies on other nodes lag one save behind node 0's files).

>>> w = Writer(); done = []; w.submit(lambda: done.append(1)); w.wait(); done
[1]
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from detrain.log import console


def snapshot(state: Any, pool: dict[tuple[Any, ...], list[torch.Tensor]] | None = None) -> tuple[Any, Any]:
    """A copy of ``state`` that no later step changes: every tensor copied to host memory (on the CPU a copy; from a
    GPU into pinned memory, non-blocking), dicts, lists and tuples rebuilt, other values (numbers, strings, bytes)
    shared; and the CUDA event after which the copies from a GPU are complete (None: nothing came from one).

    ``pool``: host tensors of an earlier snapshot, whose write has finished, to copy into again instead of new ones
    (a fresh allocation of hundreds of MB costs its page faults at every save; pinned memory costs more); it is
    updated to this snapshot's tensors.

    >>> w = torch.zeros(2); copy, ready = snapshot({"w": w, "n": [1, w]}); w += 1; copy, ready
    ({'w': tensor([0., 0.]), 'n': [1, tensor([0., 0.])]}, None)
    """
    from_gpu = False
    free = {key: list(tensors) for key, tensors in (pool or {}).items()}
    used: dict[tuple[Any, ...], list[torch.Tensor]] = {}

    def host(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal from_gpu
        gpu = tensor.device.type == "cuda"
        from_gpu = from_gpu or gpu
        if not tensor.is_contiguous():  # not worth a pool: a plain copy (state tensors are contiguous)
            return tensor.to("cpu", copy=True)
        key = (tensor.dtype, tuple(tensor.shape), gpu)
        spare = free.get(key)
        out = spare.pop() if spare else torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=gpu)
        used.setdefault(key, []).append(out)
        return out.copy_(tensor, non_blocking=gpu)

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return host(value.detach())
        if isinstance(value, OrderedDict):
            return OrderedDict((k, copy(v)) for k, v in value.items())
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, list):
            return [copy(v) for v in value]
        if isinstance(value, tuple):
            items = [copy(v) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)  # a named tuple stays one
        return value

    copied = copy(state)
    if pool is not None:
        pool.clear()
        pool.update(used)  # what this snapshot holds; the next one reuses it once this one is written
    ready = None
    if from_gpu:  # after the copies on the current stream: the next step's kernels come after them too
        ready = torch.cuda.Event()
        ready.record()
    return copied, ready


class Writer:
    """Rank 0's checkpoint writes, one at a time, in a thread beside the loop (see the module). ``background``
    False: each write runs at once in the caller's thread (how saves went before; the benchmark's baseline)."""

    def __init__(self, background: bool = True) -> None:
        self.background = background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.blocked_s = 0.0  # seconds the loop waited for writes in flight (submit and wait), for measurements
        self._pool: dict[tuple[Any, ...], list[torch.Tensor]] = {}  # the host tensors of the last snapshot

    def snapshot(self, state: dict[str, Any]) -> tuple[Any, Any]:
        """:func:`snapshot` of ``state`` into the host tensors of the snapshot before, once its write has finished
        (its error raised here): each save after the first copies into memory already in place."""
        self.wait()
        return snapshot(state, self._pool)

    def busy(self) -> bool:
        """Whether a write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, write: Callable[[], object], ready: Any = None) -> None:
        """Run ``write`` (it writes a snapshot's files) once the write before it has finished (whose error is raised
        here, and ``write`` then never runs); ``ready``: the snapshot's event (:func:`snapshot`), waited for in the
        writer's thread before ``write`` reads anything."""
        self.wait()

        def run() -> None:
            try:
                if ready is not None:
                    ready.synchronize()
                write()
            except BaseException as e:  # noqa: BLE001 - the loop's thread raises it (wait)
                self._error = e

        if not self.background:
            run()
            self.wait()
            return
        thread = threading.Thread(target=run, name="detrain-checkpoint-writer", daemon=True)
        thread.start()
        self._thread = thread

    def wait(self) -> None:
        """Block until the write in flight has finished; its error, if it failed, raised here (once)."""
        thread = self._thread
        if thread is not None:
            start = time.perf_counter()
            thread.join()
            self.blocked_s += time.perf_counter() - start
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def check(self) -> None:
        """A write that has finished with an error raises it now (never waits): the loop asks after every step, so
        that a failed save ends the run at the next step, not at the next save."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def finish(self) -> None:
        """The run ends on an error of its own: the write in flight finishes (its files whole on disk), and a
        failure of it is one line, not raised (the run's own error is the one to report)."""
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001 - said, not raised: the run's error is already on its way
            console.print(f"warning: the last checkpoint write failed too: {e}")
