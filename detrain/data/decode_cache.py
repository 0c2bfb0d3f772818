"""A per-process, byte-bounded LRU of decoded training images, keyed by (index, reduce).

Mosaic partners come from the images of the same sampler *lane* (``loader.py``): batches that the DataLoader
gives to the same worker. This cache keeps that worker's recent decodes, so a partner shown again a few batches
later costs no second decode. It only ever returns what ``read_image(file, reduce)`` returned for the same key,
so the samples do not depend on whether it hit: worker count and order change the speed, never the pixels.
Its budget is set per batch from the size of the batch's pools (as many load-size images as the pools hold,
half as many again for decodes at other reductions), close to what Ultralytics' mosaic buffer keeps.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

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
    """

    def __init__(self, budget_bytes: int = 0) -> None:
        self.budget_bytes = int(budget_bytes)
        self._items: OrderedDict[Key, np.ndarray] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0

    def keys(self) -> list[Key]:
        return list(self._items)

    def get(self, key: Key, load: Callable[[Key], np.ndarray | None]) -> np.ndarray | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
            self.hits += 1
            return item
        self.misses += 1
        item = load(key)
        if item is not None and item.nbytes <= self.budget_bytes:
            self._items[key] = item
            self._bytes += item.nbytes
            self._evict()
        return item

    def set_budget(self, budget_bytes: int) -> None:
        self.budget_bytes = int(budget_bytes)
        self._evict()

    def _evict(self) -> None:
        while self._bytes > self.budget_bytes and self._items:
            _, old = self._items.popitem(last=False)
            self._bytes -= old.nbytes
