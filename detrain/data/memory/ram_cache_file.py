"""The layout of a ``cache=ram`` file, and the checks a reader makes before it maps one.

One file holds one cache::

    header   magic, owner (pid, start ticks, pid namespace), image count, pixel offset, file size, cache key
    shapes   int32 (h, w) per image, at load size
    ok       uint8 per image: 1 if its pixels are there, 0 if the image was unreadable
    (zeros up to a page boundary)
    pixels   uint8 BGR, image after image

A reader never takes a size or an offset from the file: it computes the layout from the image shapes it expects
(:meth:`Layout.of`) and accepts the file only if everything the file says agrees with that layout and its size
on disk is exactly the layout's size. So a truncated, grown or forged file is refused as a whole, and every view
into an accepted one is in bounds.

>>> layout = Layout.of([(2, 3), (4, 5)])
>>> layout.pixels_at, layout.size, layout.offsets.tolist()
(4096, 4174, [0, 18])
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from detrain.data.memory.process_owner import Owner

MAGIC = b"DTRRAM02"
HEADER = struct.Struct("<8sqqqqqq16s")  # magic, pid, start ticks, pid ns, images, pixels offset, file size, key
PAGE = 4096


class BadCacheFile(ValueError):
    """The file is not the cache the reader expects; the message says how it differs."""


@dataclass(frozen=True)
class Layout:
    """Where everything of a cache of images with these load sizes lies."""

    shapes: np.ndarray  # (n, 2) int32 h, w
    offsets: np.ndarray  # (n,) int64, from pixels_at
    sizes: np.ndarray  # (n,) int64 bytes
    pixels_at: int
    size: int

    @classmethod
    def of(cls, shapes_hw: Sequence[tuple[int, int]]) -> Layout:
        """The layout for images of load sizes ``shapes_hw`` (h, w)."""
        shapes = np.asarray(shapes_hw, dtype=np.int64).reshape(-1, 2)
        if (shapes <= 0).any() or (shapes > np.iinfo(np.int32).max).any():
            raise ValueError("image load sizes must be positive and fit int32")
        sizes = shapes[:, 0] * shapes[:, 1] * 3
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64) if len(sizes) else sizes
        pixels_at = -(-(HEADER.size + 9 * len(shapes)) // PAGE) * PAGE
        return cls(shapes.astype(np.int32), offsets, sizes, pixels_at, pixels_at + int(sizes.sum()))

    @property
    def n(self) -> int:
        """Number of images."""
        return len(self.shapes)

    @property
    def ok_at(self) -> int:
        """Where the per-image ok flags lie (written last, once the pixels are)."""
        return HEADER.size + 8 * self.n

    def head(self, key: str, owner: Owner) -> bytes:
        """The header and shapes of a new file (its ok flags stay 0 until written)."""
        return (
            HEADER.pack(
                MAGIC, owner.pid, owner.start_ticks, owner.pid_ns, self.n, self.pixels_at, self.size, _key_bytes(key)
            )
            + self.shapes.astype("<i4").tobytes()
        )

    def pixels(self, buf: mmap.mmap | bytes) -> np.ndarray:
        """The pixel region of a file of this layout mapped as ``buf`` (read-only if the map is)."""
        return np.frombuffer(buf, dtype=np.uint8, count=self.size - self.pixels_at, offset=self.pixels_at)

    def check(self, buf: mmap.mmap | bytes, key: str) -> tuple[Owner, np.ndarray]:
        """The owner and ok flags of the file mapped as ``buf``; BadCacheFile if it is not this cache."""
        if len(buf) != self.size:
            raise BadCacheFile(f"its size is {len(buf)} bytes, not {self.size}")
        magic, pid, ticks, ns, n, pixels_at, size, file_key = HEADER.unpack_from(buf, 0)
        if magic != MAGIC:
            raise BadCacheFile("it does not start like a detrain RAM cache file")
        if file_key != _key_bytes(key):
            raise BadCacheFile("it holds another cache key")
        if (n, pixels_at, size) != (self.n, self.pixels_at, self.size):
            raise BadCacheFile(
                f"its header says {n} images, pixels at {pixels_at}, size {size}; expected "
                f"{self.n}, {self.pixels_at}, {self.size}"
            )
        shapes = np.frombuffer(buf, dtype="<i4", count=2 * self.n, offset=HEADER.size).reshape(-1, 2)
        if not np.array_equal(shapes, self.shapes):
            raise BadCacheFile("its image sizes are not the expected ones")
        ok = np.frombuffer(buf, dtype=np.uint8, count=self.n, offset=self.ok_at).copy()
        if (ok > 1).any():
            raise BadCacheFile("its per-image flags are not 0/1")
        return Owner(pid, ticks, ns), ok.astype(bool)


def _key_bytes(key: str) -> bytes:
    return key.encode("ascii")[:16].ljust(16, b"\0")
