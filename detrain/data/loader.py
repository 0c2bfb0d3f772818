"""Samplers (seeded, rank-sharded) and ``build_dataloader``.

Training, :class:`GlobalBatchSampler`: one permutation per epoch drawn from (seed, epoch), cut into *global*
batches of ``batch_size * world_size``; rank r takes its contiguous slice of every global batch. So 1 rank x 16
and 2 ranks x 8 see exactly the same images at every step, and together with the dataset's per-sample generator
(seed, epoch, index) exactly the same augmented pixels. Every rank gets the same number of batches: the last
global batch is padded by wrapping around the permutation (its first images again) up to a multiple of
``world_size`` (nothing is padded on one rank); with ``drop_last`` the incomplete global batch is dropped instead.

Each key carries its *pool*: the images of its group of ``pool_size`` consecutive positions in the epoch's order.
The dataset draws mosaic partners from it, so the images a batch needs are mostly its own and each is decoded
once per batch. Groups are fixed by the permutation, not by the batch size or the number of ranks, so the
result does not change with them (it is cheapest when the per-rank batch is a multiple of ``pool_size``).

Evaluation, :class:`ShardSampler`: the single-process batches (so rectangular batch shapes are unchanged) split
into contiguous, disjoint runs, one per rank, without padded duplicates; ranks may get different counts.
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing
import os
import random
import sys
from functools import partial
from typing import Iterator, Sized

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler, default_collate

from detrain.data.dataset import Pick

POOL_SIZE = 8
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


class GlobalBatchSampler(Sampler[list[Pick]]):
    """Rank ``rank``'s slice of each global batch of an epoch's permutation (see the module docstring).

    >>> one = [[p.index for p in b] for b in GlobalBatchSampler(32, 16, seed=1)]
    >>> two = [[[p.index for p in b] for b in GlobalBatchSampler(32, 8, r, 2, seed=1)] for r in (0, 1)]
    >>> all(one[i] == two[0][i] + two[1][i] for i in range(2))
    True
    """

    def __init__(self, n: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False, pool_size: int = POOL_SIZE):
        if n <= 0 or batch_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"bad sampler arguments: n={n}, batch_size={batch_size}, rank={rank}/{world_size}")
        self.n, self.batch_size, self.rank, self.world_size = n, batch_size, rank, world_size
        self.seed, self.shuffle, self.drop_last, self.pool_size = int(seed) % 2**32, shuffle, drop_last, pool_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s permutation for the next iteration."""
        self.epoch = int(epoch)

    def order(self) -> np.ndarray:
        """This epoch's sequence of indices (all ranks), padded or cut as described in the module docstring."""
        n, g, w = self.n, self.batch_size * self.world_size, self.world_size
        perm = np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle else np.arange(n)
        if self.drop_last and n >= g:
            return perm[: n // g * g]
        full = (n // g) * g
        last = n - full
        length = full + math.ceil(last / w) * w
        return np.resize(perm, length)  # np.resize repeats the permutation from its start to fill

    def __iter__(self) -> Iterator[list[Pick]]:
        order = self.order()
        g = self.batch_size * self.world_size
        for start in range(0, len(order), g):
            chunk = len(order[start: start + g]) // self.world_size  # the per-rank size (smaller for the last)
            lo = start + self.rank * chunk
            yield [Pick(int(order[p]), self._pool(order, p)) for p in range(lo, lo + chunk)]

    def _pool(self, order: np.ndarray, position: int) -> tuple[int, ...]:
        first = position // self.pool_size * self.pool_size
        return tuple(int(i) for i in order[first: first + self.pool_size])

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
    the workers are the parallelism. Freed buffers stay in the worker for the next image."""
    s = int(np.random.SeedSequence([int(seed) % 2**32, rank, worker_id]).generate_state(1)[0])
    np.random.seed(s)
    random.seed(s)
    torch.manual_seed(s)
    cv2.setNumThreads(0)
    _keep_freed_memory()


def worker_start_method() -> str | None:
    """``fork`` on Linux, else the platform's default (macOS's system frameworks are not fork-safe).

    The ranks that :func:`detrain.launch.launch` starts are spawned, and a spawned process inherits ``spawn`` as
    its default start method; its loader workers would then each import torch again (about 300 MB of private
    memory and seconds of start-up per worker) instead of sharing the rank's pages copy-on-write. The workers
    never touch CUDA (pinning happens in the rank's own thread), so forking a rank that holds a CUDA context is
    safe for them."""
    return "fork" if sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods() else None


def build_dataloader(dataset: Sized, batch_size: int, shuffle: bool, workers: int, rank: int = 0,
                     world_size: int = 1, seed: int = 0, drop_last: bool = False) -> DataLoader:
    """A DataLoader over ``dataset`` for rank ``rank`` of ``world_size``; ``batch_size`` is per rank.

    Training (``shuffle`` or an augmenting dataset) uses :class:`GlobalBatchSampler`, evaluation
    :class:`ShardSampler`. Batches are collated by ``dataset.collate`` when it has one; memory is pinned when CUDA
    is available; workers persist across epochs (the dataset's ``set_epoch`` reaches them through shared memory).
    Workers are forked on Linux (:func:`worker_start_method`); OpenCV in the calling process is then set to one
    thread (see the comment in the code: fork safety).
    Call ``loader.batch_sampler.set_epoch(epoch)`` (and ``dataset.set_epoch``) before each epoch.

    >>> loader = build_dataloader(dataset, 8, shuffle=True, workers=2, rank=0, world_size=2)  # doctest: +SKIP
    """
    if shuffle or getattr(dataset, "augment", False):
        sampler: Sampler = GlobalBatchSampler(len(dataset), batch_size, rank, world_size, seed, shuffle, drop_last)
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
