"""Samplers (seeded, rank-sharded) and ``build_dataloader``.

Training, :class:`GlobalBatchSampler`: one permutation per epoch drawn from (seed, epoch), cut into *global*
batches of ``batch_size * world_size``; rank r takes its contiguous slice of every global batch. So 1 rank x 16
and 2 ranks x 8 see exactly the same images at every step, and together with the dataset's per-sample generator
(seed, epoch, index) exactly the same augmented pixels. Every rank gets the same number of batches: the last
global batch is padded by wrapping around the permutation (its first images again) up to a multiple of
``world_size`` (nothing is padded on one rank); with ``drop_last`` the incomplete global batch is dropped instead.

Each key carries its *pool*, the images its mosaic partners are drawn from. A pool mixes like Ultralytics'
buffer of recently loaded images, yet costs no extra decode: it holds the key's slot group (``pool_size``
consecutive slots of the global batch) in this batch and in the ``pool_window - 1`` batches before it on the
same *lane* (every ``pool_lanes``-th batch, reaching back into earlier epochs). The DataLoader hands batch b of
every epoch to worker b mod workers, so when the worker count divides ``pool_lanes`` a lane's batches all go to
one worker, whose decoded images (``DetectionDataset``'s per-process decode cache) serve the later batches of
the lane. Partners therefore spread each image over ``pool_window`` batches (with ``pool_window=1`` a batch's
mosaics use only its own images, as before), and the pools do not depend on the batch split over ranks or
on the worker count: those change only how often the decode cache hits.

Pools are cut from the batches of the *planned* world (``planned_world``, default ``world_size``): under elastic
membership a smaller world takes several steps for one planned batch (``engine/batch_plan.py``), and its pools are
still those of the planned batches, so the pixels of an update do not depend on how many nodes are there.

Evaluation, :class:`ShardSampler`: the single-process batches (so rectangular batch shapes are unchanged) split
into contiguous, disjoint runs, one per rank, without padded duplicates; ranks may get different counts.
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing
import os
import random
import signal
import sys
from collections.abc import Iterator, Sized
from functools import partial

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler, default_collate

from detrain.data.dataset import Pick
from detrain.data.memory.decode_cache import LANES

POOL_SIZE = 8  # slots per pool group: a group lies within one rank's slice when the per-rank batch is a multiple
POOL_WINDOW = 4  # batches of a lane in one pool (4 x 8 = 32 partner candidates per image)
POOL_LANES = LANES  # lane stride in batches: worker counts 1, 2, 4 and 8 keep a lane on one worker
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


class GlobalBatchSampler(Sampler[list[Pick]]):
    """Rank ``rank``'s slice of each global batch of an epoch's permutation (see the module docstring).

    >>> one = [[p.index for p in b] for b in GlobalBatchSampler(32, 16, seed=1)]
    >>> two = [[[p.index for p in b] for b in GlobalBatchSampler(32, 8, r, 2, seed=1)] for r in (0, 1)]
    >>> all(one[i] == two[0][i] + two[1][i] for i in range(2))
    True
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        pool_size: int = POOL_SIZE,
        pool_window: int = POOL_WINDOW,
        pool_lanes: int = POOL_LANES,
        planned_world: int | None = None,
    ):
        planned_world = world_size if planned_world is None else planned_world
        if (
            n <= 0
            or batch_size <= 0
            or not 0 <= rank < world_size
            or min(pool_size, pool_window, pool_lanes) < 1
            or planned_world < world_size
        ):
            raise ValueError(
                f"bad sampler arguments: n={n}, batch_size={batch_size}, rank={rank}/{world_size} "
                f"(planned {planned_world}), pool {pool_size} x {pool_window} on {pool_lanes} lanes"
            )
        self.n, self.batch_size, self.rank, self.world_size = n, batch_size, rank, world_size
        self.pool_batch = batch_size * planned_world  # images of a planned global batch: what pools are cut from
        self.seed, self.shuffle, self.drop_last, self.pool_size = int(seed) % 2**32, shuffle, drop_last, pool_size
        self.pool_window, self.pool_lanes = pool_window, pool_lanes
        self.epoch = 0
        self._start: tuple[int, int] | None = None  # (epoch, batch) where a run resumed mid-epoch goes on
        self._orders: dict[int, np.ndarray] = {}
        self._run_to: int | None = None  # run_to(): an iteration goes on into the next epochs up to this one

    def run_to(self, epochs: int | None) -> None:
        """Let an iteration go on past this epoch's last batch into the next epochs, up to (not including)
        ``epochs`` (None: one epoch per iteration). The trainer then takes each epoch's batches from one iterator,
        and the loader's workers prepare the next epoch's first batches while it validates and saves, as they do
        within an epoch: nothing waits at an epoch's start. Every key carries its epoch (:class:`Pick`), so the
        draws are those of a pass per epoch.

        >>> s = GlobalBatchSampler(32, 16, seed=1)
        >>> s.run_to(2); run = [[(p.epoch, p.index) for p in b] for b in s]
        >>> s.run_to(None); s.set_epoch(1); run[2:] == [[(p.epoch, p.index) for p in b] for b in s]
        True
        """
        self._run_to = epochs

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s permutation for the next iteration."""
        self.epoch = int(epoch)

    def start_at(self, batch: int) -> None:
        """Begin this epoch at batch ``batch`` (0-based), with exactly the picks an uninterrupted iteration yields
        there (a run resumed mid-epoch). It holds for iterations of this epoch until one has run to its end (the
        DataLoader may call ``iter`` more than once per pass); ``len`` stays the epoch's.

        >>> s = GlobalBatchSampler(32, 8, seed=1); whole = [[p.index for p in b] for b in s]
        >>> s.start_at(3); [[p.index for p in b] for b in s] == whole[3:]
        True
        >>> len(s), len(list(s))
        (4, 4)
        """
        if isinstance(batch, bool) or not isinstance(batch, int) or not 0 <= batch <= len(self):
            raise ValueError(f"start_at({batch!r}): a batch index from 0 to {len(self)}")
        self._start = (self.epoch, batch)

    def order(self, epoch: int | None = None) -> np.ndarray:
        """Epoch ``epoch``'s (default: this epoch's) sequence of indices (all ranks), padded or cut as described in
        the module docstring."""
        epoch = self.epoch if epoch is None else epoch
        if epoch not in self._orders:
            if len(self._orders) > self.pool_window + 1:  # pools reach back at most pool_window epochs
                self._orders.pop(min(self._orders))
            self._orders[epoch] = self._make_order(epoch)
        return self._orders[epoch]

    def _make_order(self, epoch: int) -> np.ndarray:
        n, g, w = self.n, self.batch_size * self.world_size, self.world_size
        perm = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        if self.drop_last and n >= g:
            return perm[: n // g * g]
        full = (n // g) * g
        last = n - full
        length = full + math.ceil(last / w) * w
        return np.resize(perm, length)  # np.resize repeats the permutation from its start to fill

    def __iter__(self) -> Iterator[list[Pick]]:
        resumed = self._start if self._start is not None and self._start[0] == self.epoch else None
        first = resumed[1] if resumed is not None else 0
        start = self.epoch  # set_epoch may move on while this iteration runs into the next epochs
        last = max(self._run_to, start + 1) if self._run_to is not None else start + 1
        for epoch in range(start, last):
            yield from self._epoch_batches(epoch, first if epoch == start else 0)
            if epoch == start and resumed is not None and self._start == resumed:
                self._start = None  # this epoch's resumed pass is over: the next starts at batch 0

    def _epoch_batches(self, epoch: int, first: int) -> Iterator[list[Pick]]:
        """This rank's batches of ``epoch`` from batch ``first`` on."""
        order = self.order(epoch)
        g = self.batch_size * self.world_size
        pools: dict[tuple[int, int], tuple[int, ...]] = {}
        groups = math.ceil(self.pool_batch / self.pool_size)
        for start in range(first * g, len(order), g):
            chunk = len(order[start : start + g]) // self.world_size  # the per-rank size (smaller for the last)
            positions = range(start + self.rank * chunk, start + (self.rank + 1) * chunk)
            picks = []
            for p in positions:
                b, slot = divmod(p, self.pool_batch)  # the planned batch and slot of this position
                key = (b, slot // self.pool_size)
                if key not in pools:
                    pools[key] = self.pool(epoch, b, slot)
                lane = b % self.pool_lanes * groups + slot // self.pool_size  # the pool's lane: its slot group
                picks.append(Pick(int(order[p]), pools[key], lane, epoch))
            yield picks

    def pool(self, epoch: int, batch: int, slot: int) -> tuple[int, ...]:
        """The mosaic pool of ``slot`` of planned global batch ``batch`` of ``epoch``: its slot group in the lane's
        planned batches.

        >>> sampler = GlobalBatchSampler(64, 16, seed=0, pool_size=4, pool_window=2, pool_lanes=2)
        >>> here, before = sampler.order(1)[16 * 2:][:4], sampler.order(1)[:4]
        >>> sampler.pool(1, 2, 1) == tuple(int(i) for i in (*here, *before))
        True
        """
        group = slot // self.pool_size * self.pool_size
        out: list[int] = []
        for e, j in self._lane(epoch, batch):
            order = self.order(e)
            start = j * self.pool_batch
            end = min(start + self.pool_batch, len(order))
            out.extend(int(i) for i in order[min(start + group, end) : min(start + group + self.pool_size, end)])
        return tuple(out)

    def _lane(self, epoch: int, batch: int) -> list[tuple[int, int]]:
        """(epoch, batch) of ``batch`` and the ``pool_window - 1`` batches before it on its lane, newest first;
        a lane goes on into the previous epoch at its last batch of the same residue (epoch 0 starts it)."""
        nb, lanes = math.ceil(len(self.order(epoch)) / self.pool_batch), self.pool_lanes
        out: list[tuple[int, int]] = []
        e, j = epoch, batch
        while len(out) < self.pool_window:
            if j < 0:
                e -= 1
                if e < 0:
                    break
                j = batch + (nb - 1 - batch) // lanes * lanes
            out.append((e, j))
            j -= lanes
        return out

    def __len__(self) -> int:
        g = self.batch_size * self.world_size
        if self.drop_last and self.n >= g:
            return self.n // g
        return math.ceil(self.n / g)


class ShardSampler(Sampler[list[int]]):
    """Rank ``rank``'s contiguous run of the single-process batches of ``0 .. n-1`` (evaluation; no duplicates).

    >>> [list(ShardSampler(10, 3, r, 2)) for r in (0, 1)]
    [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9]]]
    """

    def __init__(self, n: int, batch_size: int, rank: int = 0, world_size: int = 1):
        if n < 0 or batch_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"bad sampler arguments: n={n}, batch_size={batch_size}, rank={rank}/{world_size}")
        nb = math.ceil(n / batch_size)
        first, last = rank * nb // world_size, (rank + 1) * nb // world_size
        self.batches = [list(range(b * batch_size, min((b + 1) * batch_size, n))) for b in range(first, last)]

    def set_epoch(self, epoch: int) -> None:
        """Evaluation order does not change with the epoch (kept for a uniform interface)."""

    def __iter__(self) -> Iterator[list[int]]:
        return iter([list(b) for b in self.batches])

    def __len__(self) -> int:
        return len(self.batches)


def _keep_freed_memory() -> None:
    """Let glibc keep freed memory for reuse instead of handing every image-sized buffer back to the kernel and
    faulting it in again, page by page, for the next image (about a tenth of a worker's time otherwise). A worker
    then holds on to its peak use, a few tens of MB. No-op where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(None)  # the C library already loaded (no ldconfig lookup in a worker)
        libc.mallopt(_M_TRIM_THRESHOLD, 512 << 20)
        libc.mallopt(_M_MMAP_THRESHOLD, 256 << 20)
    except (OSError, AttributeError, TypeError):
        pass


def _worker_init(seed: int, rank: int, worker_id: int) -> None:
    """Seed the global generators per (seed, rank, worker); augmentations do not use them (they draw from
    (seed, epoch, index)), this only keeps anything else in a worker repeatable. One OpenCV thread per worker:
    the workers are the parallelism. Freed buffers stay in the worker for the next image. SIGTERM and SIGUSR1 are
    the rank's to act on (a preemption saves at an agreed step, :mod:`detrain.engine.train.state.preemption`):
    a signal to every process of the job must not kill the workers the rank still reads from, and a worker
    whose rank is gone ends by itself (torch's loader watches its parent)."""
    for name in ("SIGTERM", "SIGUSR1"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    s = int(np.random.SeedSequence([int(seed) % 2**32, rank, worker_id]).generate_state(1)[0])
    np.random.seed(s)
    random.seed(s)
    torch.manual_seed(s)
    cv2.setNumThreads(0)
    _keep_freed_memory()


def worker_start_method() -> str | None:
    """``fork`` on Linux, else the platform's default (macOS's system frameworks are not fork-safe).

    The ranks that :func:`detrain.distributed.launch.launcher.launch` starts are spawned, and a spawned process inherits
    ``spawn`` as its default start method; its loader workers would then each import torch again (about 300 MB of
    private memory and seconds of start-up per worker) instead of sharing the rank's pages copy-on-write. The workers
    never touch CUDA (pinning happens in the rank's own thread), so forking a rank that holds a CUDA context is
    safe for them."""
    return "fork" if sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods() else None


def build_dataloader(
    dataset: Sized,
    batch_size: int,
    shuffle: bool,
    workers: int,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    drop_last: bool = False,
    planned_world: int | None = None,
) -> DataLoader:
    """A DataLoader over ``dataset`` for rank ``rank`` of ``world_size``; ``batch_size`` is per rank;
    ``planned_world``: the world the batch was planned for (elastic membership, see :class:`GlobalBatchSampler`).

    Training (``shuffle`` or an augmenting dataset) uses :class:`GlobalBatchSampler`, evaluation
    :class:`ShardSampler`. Batches are collated by ``dataset.collate`` when it has one; memory is pinned when CUDA
    is available; workers persist across epochs (the dataset's ``set_epoch`` reaches them through shared memory).
    Workers are forked on Linux (:func:`worker_start_method`); OpenCV in the calling process is then set to one
    thread (see the comment in the code: fork safety).
    Call ``loader.batch_sampler.set_epoch(epoch)`` (and ``dataset.set_epoch``) before each epoch.

    >>> data = [torch.tensor(i) for i in range(10)]
    >>> [b.tolist() for b in build_dataloader(data, 4, shuffle=False, workers=0, rank=1, world_size=2)]
    [[4, 5, 6, 7], [8, 9]]
    """
    if shuffle or getattr(dataset, "augment", False):
        sampler: Sampler = GlobalBatchSampler(
            len(dataset), batch_size, rank, world_size, seed, shuffle, drop_last, planned_world=planned_world
        )
    else:
        sampler = ShardSampler(len(dataset), batch_size, rank, world_size)
    workers = max(0, min(int(workers), os.cpu_count() or 1))
    if workers > 0:
        # Workers are forked from this process. Forking while OpenCV's thread pool is running (e.g. right after
        # the labels were verified with threads) can copy one of its mutexes locked into a worker, which then
        # hangs in its first cv2 call. One thread here stops that pool; the workers are the parallelism anyway.
        cv2.setNumThreads(1)
    generator = torch.Generator()
    generator.manual_seed(int(np.random.SeedSequence([int(seed) % 2**32, rank]).generate_state(1)[0]))
    return DataLoader(
        dataset,  # type: ignore[arg-type]
        batch_sampler=sampler,
        num_workers=workers,
        collate_fn=getattr(dataset, "collate", default_collate),
        pin_memory=torch.cuda.is_available(),
        persistent_workers=workers > 0,
        multiprocessing_context=worker_start_method() if workers > 0 else None,
        worker_init_fn=partial(_worker_init, seed, rank),
        generator=generator,
    )
