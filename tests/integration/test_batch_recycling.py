"""Recycled batch segments (``batch_memory.py``): a training worker fills a segment again only after the
consumer released it, so what the trainer holds never changes under it, and released memory is reused."""

from __future__ import annotations

import collections.abc
import copy
import os
from collections.abc import Callable
from typing import Any

import cv2
import numpy as np
import pytest
import torch
from torch.utils.data._utils import pin_memory as torch_pinning

from detrain.config.keys import Augment
from detrain.data.dataset import DetectionDataset
from detrain.data.labels.verify import LabelRecord as Rec
from detrain.data.loader import build_dataloader
from detrain.data.memory import batch_memory
from detrain.data.memory.batch_memory import Batch, release_batch


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[Rec]:
    """24 small images with one box each, in varied colours (so every batch differs)."""
    folder = tmp_path_factory.mktemp("recycle")
    recs = []
    for k in range(24):
        img = np.full((48, 64, 3), (k * 10 % 256, k * 37 % 256, 200 - k * 5), np.uint8)
        img[8:28, 12:40] = 255
        path = folder / f"{k:02d}.png"
        cv2.imwrite(str(path), img)
        recs.append(
            Rec(str(path), (48, 64), np.array([k % 3]), np.array([[26 / 64, 18 / 48, 28 / 64, 20 / 48]], np.float32))
        )
    return recs


def _segment(t: torch.Tensor) -> int:
    """The shared-memory object under ``t`` (its inode), whichever address this process maps it at."""
    fd, _ = t.untyped_storage()._share_fd_cpu_()
    return os.fstat(fd).st_ino


def _epochs(ds: DetectionDataset, workers: int, release: bool, hold: int = 0) -> tuple[list[dict], list, set[int]]:
    """Two epochs of batches: copies taken on arrival, the first ``hold`` batches kept unreleased, the segments."""
    loader = build_dataloader(ds, 4, shuffle=True, workers=workers, seed=2)
    copies, held, segments = [], [], set()
    for epoch in (0, 1):
        loader.batch_sampler.set_epoch(epoch)
        ds.set_epoch(epoch)
        for batch in loader:
            assert isinstance(batch, Batch)
            copies.append({k: batch[k].clone() for k in ("img", "cls", "bboxes", "batch_idx")})
            if workers:
                segments.add(_segment(batch["img"]))
            if len(held) < hold:
                held.append((batch, copies[-1]))
            elif release:
                release_batch(batch)
    del loader
    return copies, held, segments


def test_what_the_consumer_holds_never_changes_and_released_segments_are_reused(records: list[Rec]) -> None:
    ds = DetectionDataset(records * 2, imgsz=64, augment=True, hyp=Augment(mosaic=1.0), seed=2)  # 12 batches/epoch
    reference, _, _ = _epochs(ds, 0, release=False)
    copies, held, segments = _epochs(ds, 1, release=True, hold=3)
    assert len(copies) == len(reference) == 24
    for got, want in zip(copies, reference):
        assert all(torch.equal(got[k], want[k]) for k in want)  # the same batches as in one process
    for batch, at_arrival in held:  # 21 batches later, the unreleased ones are untouched
        assert all(torch.equal(batch[k], at_arrival[k]) for k in at_arrival)
    assert len(segments) <= 3 + 4  # the held ones and a few in flight, not one per batch
    _, _, fresh = _epochs(ds, 1, release=False)
    assert len(fresh) == 24  # never released: never refilled


def test_pinning_copies_then_releases(records: list[Rec], monkeypatch: pytest.MonkeyPatch) -> None:
    """What the DataLoader's pinning thread does with CUDA: copy the batch out, then free its segment, which the
    next batch reuses. (Run in this process as if it were a worker; the pinned copy is a plain clone here.)"""
    monkeypatch.setattr(batch_memory, "get_worker_info", lambda: object())
    monkeypatch.setattr(batch_memory, "_pool", [])
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, device=None: self.clone())
    ds = DetectionDataset(records, imgsz=64, augment=True, seed=1)
    batch = ds.collate(ds.__getitems__(list(range(4))))
    again = ds.collate(ds.__getitems__(list(range(4))))  # the first is not released yet: a second segment
    assert _segment(again["img"]) != _segment(batch["img"])
    first = _segment(batch["img"])
    pinned = batch.pin_memory()
    assert isinstance(pinned, Batch) and set(pinned) == set(batch)
    assert all(torch.equal(pinned[k], again[k]) for k in ("img", "cls", "bboxes", "batch_idx"))
    third = ds.collate(ds.__getitems__(list(range(4, 8))))
    assert _segment(third["img"]) == first and len(batch_memory._pool) == 2  # the freed one, filled again
    assert torch.equal(pinned["img"], again["img"])  # the copy is the pinned batch's own


def _mapping_first(data: Any, device: Any = None) -> Any:
    """The pinning order of older torch (2.4): tensors, then any mapping as a mapping (a copy of it updated with each
    value pinned), then sequences, and an object's own ``pin_memory`` only after all of them."""
    if isinstance(data, torch.Tensor):
        return data.pin_memory()
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, collections.abc.MutableMapping):
        clone = copy.copy(data)
        clone.update({k: _mapping_first(v, device) for k, v in data.items()})
        return clone
    if isinstance(data, collections.abc.Sequence):
        return [_mapping_first(v, device) for v in data]
    return data.pin_memory() if hasattr(data, "pin_memory") else data


_INSTALLED_ORDER = torch_pinning.pin_memory  # 2.14: an object's own pin_memory before the mapping branch


@pytest.mark.parametrize("order", [_INSTALLED_ORDER, _mapping_first], ids=["own_method_first", "mapping_first"])
def test_pinned_batches_free_their_segment_whichever_order_torch_pins_in(
    records: list[Rec], monkeypatch: pytest.MonkeyPatch, order: Callable[..., Any]
) -> None:
    """The DataLoader's pinning thread calls torch's ``pin_memory(batch, device)``; whether that calls
    ``Batch.pin_memory`` or copies the batch as a mapping, the worker's segment is free again once the trainer is
    done with the pinned batch (``release_batch`` after the step), and the next batch reuses it."""
    monkeypatch.setattr(torch_pinning, "pin_memory", order)
    monkeypatch.setattr(batch_memory, "get_worker_info", lambda: object())
    monkeypatch.setattr(batch_memory, "_pool", [])
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, device=None: self.clone())
    ds = DetectionDataset(records, imgsz=64, augment=True, seed=1)
    for start in (0, 4, 8):
        batch = ds.collate(ds.__getitems__(list(range(start, start + 4))))
        segment = _segment(batch["img"])
        pinned = torch_pinning.pin_memory(batch, None)  # what _pin_memory_loop does with each batch
        assert isinstance(pinned, Batch) and pinned["img"] is not batch["img"]
        assert torch.equal(pinned["img"], batch["img"]) and pinned["im_file"] == batch["im_file"]
        release_batch(pinned)  # the trainer, once the step is done
        again = ds.collate(ds.__getitems__(list(range(start, start + 4))))
        assert _segment(again["img"]) == segment  # the freed segment, filled again
        release_batch(again)
    assert len(batch_memory._pool) == 1  # one segment served every batch, not one per batch up to the pool's 8
