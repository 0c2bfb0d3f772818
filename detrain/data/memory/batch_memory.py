"""One block of memory per batch: the images and labels of a batch in one buffer, written in place.

Inside a dataloader worker every tensor of a batch travels to the main process through shared memory, and each
separate tensor costs a fresh shared-memory segment (milliseconds: create, map, fault every page in). So the
dataset renders a whole batch into ONE segment laid out as

    [ images (n, 3, h, w) uint8 | pad to 8 bytes | batch_idx (M,) f32 | cls (M,) f32 | bboxes (M, 4) f32 ]

(the images optionally channels-last: each image's bytes are then h x w x 3, viewed as (3, h, w)),

hands each sample views of its parts, and ``collate`` recognises a complete block and returns views of it: no
stacking, no concatenation, one segment per batch. Pages are faulted in with one ``madvise`` call where Linux
offers it (MADV_POPULATE_WRITE, 5.14+), which is much cheaper than faulting them one by one.

A fresh segment still costs its pages (the kernel zeroes and maps each one: about a quarter of a worker's time
at 640 on a small VM), so a training worker *recycles* its segments (``recycle=True``): a recycled block ends in
a trailer (magic, state, bytes in use), and the worker takes a block again only after the process that
consumed the batch has marked it free with :func:`release` (the trainer, once the step is done with the batch;
the pinning thread, once it has copied the batch to pinned memory: :class:`Batch`). A batch that is never
released is never overwritten: the worker then makes new segments, as without recycling.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import get_worker_info

_MADV_POPULATE_WRITE = 23
_LIBC: ctypes.CDLL | None
try:
    _LIBC = ctypes.CDLL(None, use_errno=True)  # the C library already loaded
    _LIBC.madvise  # noqa: B018 (present on POSIX systems)
except (OSError, AttributeError, TypeError):  # no madvise here: no pre-faulting
    _LIBC = None


def _populate(t: torch.Tensor) -> None:
    """Fault in the pages of ``t`` in one system call (best effort; silently nothing where unsupported)."""
    if _LIBC is not None and t.numel():
        _LIBC.madvise(
            ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(t.numel() * t.element_size()), _MADV_POPULATE_WRITE
        )


_MAGIC = 0x6B6C6264  # "dblk": a recycled block's trailer
_FREE, _IN_USE = 0, 1
_TRAILER = 16  # int32 magic, int32 state, int64 bytes in use
_POOL_BLOCKS = 8  # recycled segments a worker keeps (its batches in flight: prefetch, pinning, the step)
_ROUND = 1 << 20  # capacity granularity: label counts vary from batch to batch
_pool: list[torch.Tensor] = []  # this worker's recycled segments (whole, trailer included)


def _shared_bytes(nbytes: int) -> torch.Tensor | None:
    """A fresh, pre-faulted shared-memory segment of ``nbytes``, or None where this torch cannot make one."""
    try:
        proto = torch.empty(0, dtype=torch.uint8)
        storage = proto._typed_storage()._new_shared(max(nbytes, 1), device=proto.device)
    except (AttributeError, RuntimeError):  # a torch without this private helper: plain memory
        return None
    t = proto.new(storage)[:nbytes]
    _populate(t)
    return t


def _over(storage: torch.UntypedStorage, dtype: torch.dtype, offset: int, size: tuple[int, ...]) -> torch.Tensor:
    """A contiguous ``dtype`` tensor of ``size`` over ``storage`` from element ``offset`` (stride () = contiguous)."""
    return torch.empty(0, dtype=dtype).set_(storage, offset, size, ())


def _trailer(whole: torch.Tensor) -> torch.Tensor:
    """The int32 [magic, state, used lo, used hi] view of a recycled segment's last 16 bytes."""
    return whole[-_TRAILER:].view(torch.int32)


def _recycled(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of a free recycled segment of this worker (a new one while the pool has room), marked in use."""
    fit = [b for b in _pool if nbytes + _TRAILER <= b.numel() <= 2 * (nbytes + _TRAILER) + _ROUND]
    whole = next((b for b in fit if int(_trailer(b)[1]) == _FREE), None)
    if whole is None:
        if len(_pool) >= _POOL_BLOCKS:
            return None
        whole = _shared_bytes(-(-(nbytes + _TRAILER) // _ROUND) * _ROUND)
        if whole is None:
            return None
        _pool.append(whole)
    trailer = _trailer(whole)
    trailer[0], trailer[1] = _MAGIC, _IN_USE
    trailer[2:].view(torch.int64)[0] = nbytes
    return whole[:nbytes]


def _recycled_trailer(t: torch.Tensor) -> torch.Tensor | None:
    """The trailer of the recycled segment under ``t``, or None when ``t`` lies in any other memory."""
    storage = t.untyped_storage()
    if storage.nbytes() < _TRAILER or storage.device.type != "cpu":
        return None
    trailer = _trailer(_over(storage, torch.uint8, 0, (storage.nbytes(),)))
    return trailer if int(trailer[0]) == _MAGIC else None


def release(t: torch.Tensor) -> None:
    """Mark the recycled segment under ``t`` free for its worker to fill again (nothing for any other tensor).
    Call only when nothing will read the batch's tensors any more."""
    trailer = _recycled_trailer(t)
    if trailer is not None:
        trailer[1] = _FREE


def release_batch(batch: Mapping[str, Any]) -> None:
    """:func:`release` the block of a collated batch (its ``img``, or for a pinned copy made by copying the batch
    the block it came from): the trainer calls this once a step is done."""
    for img in (batch.get("img"), getattr(batch, "source", None)):
        if isinstance(img, torch.Tensor):
            release(img)


class Batch(dict):
    """A collated batch: a plain dict to its users. Pinning it (the DataLoader's pinning thread, with CUDA)
    copies its tensors to pinned memory and then releases the worker's segment, whichever order torch checks a
    batch in: a torch that calls an object's own ``pin_memory`` before treating it as a mapping (2.14) pins it here
    and releases at once; an older one (2.4, which pyproject allows) takes any mapping as a mapping first
    (``copy.copy`` of it, then each value pinned into the copy), and the copy remembers its block (``source``),
    which :func:`release_batch` frees once the step is done. Otherwise recycling would silently stop there, and
    every worker keep its whole pool of segments."""

    source: torch.Tensor | None = None  # a copy's: the ``img`` of the batch it was copied from

    def pin_memory(self, device: Any = None) -> Batch:
        pinned = Batch({k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in self.items()})
        release_batch(self)  # the copies are done (pin_memory copies synchronously)
        return pinned

    def __copy__(self) -> Batch:
        clone = Batch(self)
        img = self.get("img")
        clone.source = img if isinstance(img, torch.Tensor) else self.source
        return clone


def block_bytes(t: torch.Tensor) -> int:
    """The bytes of a block that ``t``'s storage holds: all of it, or a recycled segment's bytes in use."""
    trailer = _recycled_trailer(t)
    return int(trailer[2:].view(torch.int64)[0]) if trailer is not None else t.untyped_storage().nbytes()


def new_bytes(nbytes: int, recycle: bool = False) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes``: in shared memory inside a dataloader worker (as
    ``default_collate`` allocates there; from a recycled segment with ``recycle``), plain memory elsewhere."""
    if get_worker_info() is not None:
        t = _recycled(nbytes) if recycle else None
        if t is None:
            t = _shared_bytes(nbytes)
        if t is not None:
            return t
    return torch.empty(nbytes, dtype=torch.uint8)


def _label_offset(image_bytes: int) -> int:
    return (image_bytes + 7) // 8 * 8


def _label_views(storage: torch.UntypedStorage, offset: int, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``batch_idx`` (M,), ``cls`` (M, 1) and ``bboxes`` (M, 4) float32 views of a block's label part."""
    labels = _over(storage, torch.float32, offset // 4, (6 * m,))
    return labels[:m], labels[m : 2 * m].view(m, 1), labels[2 * m :].view(m, 4)


def _starts(counts: Sequence[int]) -> list[int]:
    """The first label row of each image, and the total at the end."""
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + int(c))
    return starts


@dataclass
class BatchBlock:
    """Views of one batch's block: ``img`` (n, 3, h, w) uint8, ``batch_idx`` (M,), ``cls`` (M, 1),
    ``bboxes`` (M, 4) float32, and the first label row of each image (``starts``, n + 1 entries)."""

    img: torch.Tensor
    batch_idx: torch.Tensor
    cls: torch.Tensor
    bboxes: torch.Tensor
    starts: list[int]

    @classmethod
    def allocate(
        cls, n: int, h: int, w: int, counts: Sequence[int], channels_last: bool = False, recycle: bool = False
    ) -> BatchBlock:
        """A block for ``n`` images of h x w with ``counts[i]`` labels each (``batch_idx`` filled in); in a
        recycled segment with ``recycle`` (see the module docstring: the consumer must :func:`release` it).

        >>> block = BatchBlock.allocate(2, 4, 4, [1, 2])
        >>> block.img.shape, block.batch_idx.tolist(), block.sample(1)[2].shape
        (torch.Size([2, 3, 4, 4]), [0.0, 1.0, 1.0], torch.Size([2, 4]))
        """
        m = int(sum(counts))
        offset = _label_offset(n * 3 * h * w)
        raw = new_bytes(offset + 24 * m, recycle)
        pixels = raw[: n * 3 * h * w]
        img = pixels.view(n, h, w, 3).permute(0, 3, 1, 2) if channels_last else pixels.view(n, 3, h, w)
        block = cls(img, *_label_views(raw.untyped_storage(), offset, m), _starts(counts))
        starts = block.starts
        for i in range(n):
            block.batch_idx[starts[i] : starts[i + 1]] = i
        return block

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(img, cls, bboxes) views of image ``i``."""
        a, b = self.starts[i], self.starts[i + 1]
        return self.img[i], self.cls[a:b], self.bboxes[a:b]


def whole_block(imgs: Sequence[torch.Tensor], cls: Sequence[torch.Tensor]) -> BatchBlock | None:
    """The block that ``imgs`` and ``cls`` (in order) exactly make up, or None if they are anything else (a
    subset, a reordering, separately made samples); then the caller stacks and concatenates as usual."""
    first = imgs[0]
    storage = first.untyped_storage()
    n, numel = len(imgs), first.numel()
    m = sum(len(c) for c in cls)
    offset = _label_offset(n * numel)
    if first.dtype != torch.uint8 or first.storage_offset() != 0 or block_bytes(first) != offset + 24 * m:
        return None  # not a block of exactly this many images and labels
    if not (first.is_contiguous() or first.permute(1, 2, 0).is_contiguous()):
        return None
    ptr, row = storage.data_ptr(), offset // 4 + m
    for i, (t, c) in enumerate(zip(imgs, cls)):
        if t.untyped_storage().data_ptr() != ptr or t.storage_offset() != i * numel or t.stride() != first.stride():
            return None
        if len(c) and (c.untyped_storage().data_ptr() != ptr or c.storage_offset() != row):
            return None
        row += len(c)
    ch, h, w = first.shape
    if first.is_contiguous():
        img = _over(storage, torch.uint8, 0, (n, ch, h, w))
    else:  # channels-last images
        img = _over(storage, torch.uint8, 0, (n, h, w, ch)).permute(0, 3, 1, 2)
    return BatchBlock(img, *_label_views(storage, offset, m), _starts([len(t) for t in cls]))
