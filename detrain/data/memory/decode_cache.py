"""A per-process, byte-bounded LRU of decoded training images, keyed by (index, reduce).

Mosaic partners come from the images of the same sampler *lane* (``loader.py``): batches that the DataLoader
gives to the same worker. This cache keeps that worker's recent decodes, so a partner shown again a few batches
later costs no second decode. It only ever returns what ``read_image(file, reduce)`` returned for the same key,
so the samples do not depend on whether it hit: worker count and order change the speed, never the pixels.

An entry lives as long as a pool may still draw on it. Pools of the same *pool lane* (a slot group of a sampler
lane) slide over that lane's batches, each one window reaching back no further than the previous one, so when a
batch of the lane arrives, an image of the lane that its pool no longer holds is never needed again
(:meth:`DecodeCache.retire`). An image shared by several lanes (pools reach into the previous epoch) stays until
every lane holding it has let it go. A byte budget, set per batch from the size of the batch's pools, bounds the
rest (lanes that a worker serves only now and then), evicting the least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import numpy as np

Key = tuple[int, int]

LANES = 8
"""Sampler lanes: batch b is on lane b mod LANES, and its mosaic pool reaches back along its lane only. A
DataLoader deals batch b to worker b mod workers, so 1, 2, 4 or 8 workers keep each lane on one worker."""


class DecodeCache:
    """``get(key, load)``: the cached array for ``key``, or ``load(key)`` stored (None results are not kept).

    >>> cache = DecodeCache(budget_bytes=8)
    >>> calls = []
    >>> def load(key): calls.append(key); return np.zeros(4, np.uint8)
    >>> _ = cache.get((0, 1), load); _ = cache.get((1, 1), load); _ = cache.get((0, 1), load)
    >>> _ = cache.get((2, 1), load)  # over budget: the least recently used, (1, 1), goes
    >>> calls, sorted(cache.keys())
    ([(0, 1), (1, 1), (2, 1)], [(0, 1), (2, 1)])
    >>> _ = cache.get((0, 1), load, lane=3); cache.retire(3, live=[2]); sorted(cache.keys())  # 0 left lane 3
    [(2, 1)]
    """

    def __init__(self, budget_bytes: int = 0) -> None:
        self.budget_bytes = int(budget_bytes)
        self._items: OrderedDict[Key, np.ndarray] = OrderedDict()
        self._lanes: dict[Key, set[int]] = {}  # the pool lanes that may still draw on an entry
        self._bytes = 0
        self.hits = self.misses = 0

    def keys(self) -> list[Key]:
        return list(self._items)

    @property
    def nbytes(self) -> int:
        """Bytes of pixels held."""
        return self._bytes

    def get(self, key: Key, load: Callable[[Key], np.ndarray | None], lane: int = -1) -> np.ndarray | None:
        """The pixels of ``key``, loaded on a miss; ``lane``: the pool lane asking (-1: none, kept by LRU only)."""
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
            self.hits += 1
        else:
            self.misses += 1
            item = load(key)
            if item is None or item.nbytes > self.budget_bytes:
                return item
            self._items[key] = item
            self._bytes += item.nbytes
            self._evict()
        if lane >= 0 and key in self._lanes:
            self._lanes[key].add(lane)
        elif lane >= 0 and key in self._items:
            self._lanes[key] = {lane}
        return item

    def retire(self, lane: int, live: Iterable[int]) -> None:
        """Pool lane ``lane`` now draws only on the image indices ``live``: its other entries are let go, and
        dropped when no other lane holds them."""
        live = set(live)
        for key in [k for k, lanes in self._lanes.items() if lane in lanes and k[0] not in live]:
            lanes = self._lanes[key]
            lanes.discard(lane)
            if not lanes:
                self._drop(key)

    def set_budget(self, budget_bytes: int) -> None:
        self.budget_bytes = int(budget_bytes)
        self._evict()

    def _evict(self) -> None:
        while self._bytes > self.budget_bytes and self._items:
            self._drop(next(iter(self._items)))

    def _drop(self, key: Key) -> None:
        self._bytes -= self._items.pop(key).nbytes
        self._lanes.pop(key, None)
