"""Samplers and build_dataloader: rank slicing, equal batch counts, disjoint validation shards, worker-count
independence and close_mosaic reaching persistent workers."""

from __future__ import annotations

import itertools

import cv2
import numpy as np
import pytest
import torch

from detrain.config.keys import Augment
from detrain.data.dataset import DetectionDataset
from detrain.data.labels.verify import LabelRecord as Rec
from detrain.data.loader import GlobalBatchSampler, ShardSampler, build_dataloader

BACKGROUND_BGR = [(60, 20, 20), (20, 60, 20), (20, 20, 60), (60, 60, 20), (20, 60, 60), (60, 20, 60)]
NO_HSV = Augment(hsv_h=0.0, hsv_s=0.0, hsv_v=0.0)


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[Rec]:
    """20 small images, each a flat colour with one square object."""
    folder = tmp_path_factory.mktemp("loader")
    recs = []
    for k in range(20):
        h, w = (48, 64) if k % 3 else (64, 48)
        img = np.full((h, w, 3), BACKGROUND_BGR[k % 6], np.uint8)
        img[10:30, 10:30] = (255, 255, 255)
        path = folder / f"{k:02d}.png"
        cv2.imwrite(str(path), img)
        box = np.array([[20 / w, 20 / h, 20 / w, 20 / h]], np.float32)
        recs.append(Rec(str(path), (h, w), np.array([k % 4]), box))
    return recs


def indices(batches) -> list[list[int]]:
    return [[p.index if hasattr(p, "index") else int(p) for p in b] for b in batches]


@pytest.mark.parametrize(("n", "drop_last"), [(64, False), (50, False), (50, True), (5, False)])
def test_one_rank_of_16_equals_two_ranks_of_8(n: int, drop_last: bool) -> None:
    for epoch in (0, 3):
        one = GlobalBatchSampler(n, 16, seed=5, drop_last=drop_last)
        two = [GlobalBatchSampler(n, 8, r, 2, seed=5, drop_last=drop_last) for r in (0, 1)]
        for s in (one, *two):
            s.set_epoch(epoch)
        a, b0, b1 = indices(one), indices(two[0]), indices(two[1])
        assert len(a) == len(b0) == len(b1) == len(one) == len(two[0])
        for step, batch in enumerate(a):
            joint = b0[step] + b1[step]
            if len(batch) == 16 or drop_last:
                assert joint == batch  # exactly the same images at every full step
            else:  # the last, incomplete step: the same images, padded to an even split by wrapping
                assert joint[: len(batch)] == batch and len(b0[step]) == len(b1[step])
        if not drop_last:
            assert set(itertools.chain(*a)) == set(range(n))
    assert indices(GlobalBatchSampler(n, 16, seed=5)) != indices(_at_epoch(GlobalBatchSampler(n, 16, seed=5), 1))


def _at_epoch(sampler: GlobalBatchSampler, epoch: int) -> GlobalBatchSampler:
    sampler.set_epoch(epoch)
    return sampler


def test_every_rank_gets_the_same_number_of_batches() -> None:
    for n, world in ((50, 3), (7, 4), (100, 8)):
        counts = [len(list(GlobalBatchSampler(n, 4, r, world))) for r in range(world)]
        sizes = [[len(b) for b in GlobalBatchSampler(n, 4, r, world)] for r in range(world)]
        assert len(set(counts)) == 1 and all(s == sizes[0] for s in sizes)


def test_pools_are_slot_groups_of_the_lane_reaching_into_earlier_epochs() -> None:
    """Pool of slot s in batch b: slot group s // 8 of batches b, b-2, b-4 (lanes 2, window 3), newest first; a
    lane that runs out goes on at the previous epoch's last batch of the same parity."""
    sampler = GlobalBatchSampler(80, 16, seed=1, pool_size=8, pool_window=3, pool_lanes=2)  # 5 batches
    orders = {e: sampler.order(e).tolist() for e in (2, 3)}

    def group(epoch: int, batch: int, slot: int) -> list[int]:
        start = batch * 16 + slot // 8 * 8
        return orders[epoch][start : start + 8]

    sampler.set_epoch(3)
    lanes = {0: [(3, 0), (2, 4), (2, 2)], 1: [(3, 1), (2, 3), (2, 1)], 4: [(3, 4), (3, 2), (3, 0)]}
    for b, batch in enumerate(sampler):
        for s, pick in enumerate(batch):
            assert pick.index == orders[3][b * 16 + s] and pick.index in pick.pool
            if b in lanes:
                assert list(pick.pool) == [i for e, j in lanes[b] for i in group(e, j, s)]


@pytest.mark.parametrize("n", [64, 50])
def test_pools_do_not_depend_on_the_split_over_ranks(n: int) -> None:
    for epoch in (0, 4):
        one = _at_epoch(GlobalBatchSampler(n, 16, seed=3), epoch)
        two = [_at_epoch(GlobalBatchSampler(n, 8, r, 2, seed=3), epoch) for r in (0, 1)]
        for a, b0, b1 in zip(one, *two):
            if len(a) == 16:
                assert [p.pool for p in a] == [p.pool for p in b0 + b1]
                assert epoch == 0 or len(set(a[0].pool)) > 16  # past the first epoch the pools span batches


def test_decode_cache_holds_only_what_a_pool_can_still_draw(records: list[Rec]) -> None:
    """After every batch the cache holds only images that some lane's latest pool still holds (a lane's pools
    slide forward, so anything else is never drawn again), and letting the rest go costs no extra decode: each
    image is decoded at most once per epoch. (An LRU as large as this tiny dataset keeps it all: no decode after
    the first epoch, which a real dataset never fits.)"""

    def run(retire: bool) -> tuple[int, int]:
        ds = DetectionDataset(records * 4, imgsz=64, augment=True, hyp=Augment(mosaic=1.0), seed=3)  # 80 images
        sampler = GlobalBatchSampler(len(ds), 4, seed=3, pool_window=3, pool_lanes=2, pool_size=2)
        latest: dict[int, set[int]] = {}
        peak = 0
        for epoch in (0, 1, 2):
            ds.set_epoch(epoch)
            sampler.set_epoch(epoch)
            for picks in sampler:
                if not retire:
                    picks = [p._replace(lane=-1) for p in picks]
                ds.__getitems__(picks)
                latest.update({p.lane: set(p.pool) for p in picks})
                held = {k[0] for k in ds._decode_cache.keys()}  # noqa: SIM118 - DecodeCache has keys() but no __iter__
                if retire:
                    assert held <= set().union(*latest.values())
                peak = max(peak, len(held))
        return ds._decode_cache.misses, peak

    (misses, peak), (lru_misses, lru_peak) = run(True), run(False)
    assert lru_misses == 80 and lru_peak == 80
    assert misses <= 3 * 80  # nothing let go is needed again within an epoch
    assert peak <= 2 * 2 * 3 * 2  # lanes x groups x window x group size


def test_partners_come_from_earlier_batches_without_decoding_them_again(records: list[Rec]) -> None:
    """A whole epoch on one process: mosaics mix images of several batches, yet each image is decoded about once
    (the decode cache keeps the lane's images), and a cold cache gives the very same pixels as a warm one."""
    ds = DetectionDataset(records * 4, imgsz=64, augment=True, hyp=Augment(mosaic=1.0), seed=6)  # 80 images
    sampler = GlobalBatchSampler(len(ds), 4, seed=6, pool_window=4, pool_lanes=2)
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        sampler.set_epoch(epoch)
        batches = list(sampler)
        warm = [ds.__getitems__(b) for b in batches]
    plans = [ds._plan(p, 1, 0, True, None) for b in batches for p in b]
    partners = [
        {t.index for t in plan.layers[0].tiles[1:]} - {p.index for p in b}
        for plan, b in zip(plans, [b for b in batches for _ in b])
    ]
    assert sum(len(x) for x in partners) > len(plans)  # most partners come from other batches
    assert ds._decode_cache.misses <= 1.2 * 2 * len(ds)  # about one decode per image and epoch
    cold = DetectionDataset(records * 4, imgsz=64, augment=True, hyp=Augment(mosaic=1.0), seed=6)
    cold.set_epoch(1)
    for b in (batches[5], batches[-1]):
        assert all(torch.equal(x["img"], y["img"]) for x, y in zip(cold.__getitems__(b), warm[batches.index(b)]))


def test_val_shards_are_disjoint_complete_and_keep_the_batches() -> None:
    for n, bs, world in ((10, 3, 2), (17, 4, 3), (3, 2, 4)):
        single = list(ShardSampler(n, bs))
        shards = [list(ShardSampler(n, bs, r, world)) for r in range(world)]
        flat = [i for s in shards for b in s for i in b]
        assert sorted(flat) == list(range(n)) and len(flat) == n  # no duplicates, nothing missing
        assert [b for s in shards for b in s] == single  # contiguous runs of the single-process batches


def test_two_ranks_see_the_same_pixels_as_one(records: list[Rec]) -> None:
    ds = DetectionDataset(records, imgsz=64, augment=True, seed=2)
    one = build_dataloader(ds, 8, shuffle=True, workers=0, seed=2)
    two = [build_dataloader(ds, 4, shuffle=True, workers=0, rank=r, world_size=2, seed=2) for r in (0, 1)]
    for a, b0, b1 in zip(one, *two):
        assert torch.equal(a["img"], torch.cat((b0["img"], b1["img"])))
        assert torch.equal(a["bboxes"], torch.cat((b0["bboxes"], b1["bboxes"])))


def test_samples_do_not_depend_on_the_number_of_workers(records: list[Rec]) -> None:
    """With every augmentation that draws partners from the pools: mosaic, and cutmix pasting from another one."""
    ds = DetectionDataset(records, imgsz=64, augment=True, hyp=Augment(cutmix=1.0), seed=4)
    runs = []
    for workers in (0, 2):
        loader = build_dataloader(ds, 4, shuffle=True, workers=workers, seed=4)
        loader.batch_sampler.set_epoch(1)
        ds.set_epoch(1)
        runs.append([(b["img"], b["bboxes"]) for b in loader])
        del loader
    assert len(runs[0]) == len(runs[1])
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(*runs))
    plain = DetectionDataset(records, imgsz=64, augment=True, seed=4)  # the same draws before cutmix's
    loader = build_dataloader(plain, 4, shuffle=True, workers=0, seed=4)
    loader.batch_sampler.set_epoch(1)
    plain.set_epoch(1)
    assert any(not torch.equal(a[0], b["img"]) for a, b in zip(runs[0], loader))  # cutmix pasted somewhere


def _background_count(img: torch.Tensor) -> int:
    hwc = img.permute(1, 2, 0).numpy().astype(np.int16)
    return sum((np.abs(hwc - np.array(c[::-1], np.int16)) <= 8).all(-1).mean() > 0.02 for c in BACKGROUND_BGR)


def test_close_mosaic_reaches_persistent_workers(records: list[Rec]) -> None:
    ds = DetectionDataset(records, imgsz=64, augment=True, hyp=NO_HSV, close_mosaic_epoch=1)
    loader = build_dataloader(ds, 10, shuffle=True, workers=1, seed=0)
    assert loader.persistent_workers
    seen = {}
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        loader.batch_sampler.set_epoch(epoch)
        seen[epoch] = [_background_count(img) for b in loader for img in b["img"]]
    assert max(seen[0]) >= 2  # mosaics show several images
    assert set(seen[1]) == {1}  # the same worker process now renders single images


def test_val_loader_shards_rect_batches(records: list[Rec]) -> None:
    ds = DetectionDataset(records, imgsz=64, augment=False, rect=True, batch_size=4)
    single = list(build_dataloader(ds, 4, shuffle=False, workers=0))
    shards = [list(build_dataloader(ds, 4, shuffle=False, workers=0, rank=r, world_size=3)) for r in range(3)]
    merged = [b for s in shards for b in s]
    assert [b["img"].shape for b in merged] == [b["img"].shape for b in single]
    assert [f for b in merged for f in b["im_file"]] == [f for b in single for f in b["im_file"]]
    assert len({b["img"].shape for b in single}) > 1  # wide and tall batches have their own shapes


def test_rect_training_batches_keep_one_shape_even_when_padded(records: list[Rec]) -> None:
    # 20 images, 3 ranks x 4: the last global batch (8 images) is padded by wrapping to the first image, whose
    # rectangular batch has another shape; rank 2's last batch (18, 19, 0) still takes one shape (its first's).
    ds = DetectionDataset(records, imgsz=64, augment=True, rect=True, batch_size=4)
    assert ds.batch_shape(0) != ds.batch_shape(19)
    for rank in (0, 1, 2):
        loader = build_dataloader(ds, 4, shuffle=False, workers=0, rank=rank, world_size=3)
        sampler_batches = list(loader.batch_sampler)
        for keys, batch in zip(sampler_batches, loader):
            assert tuple(batch["img"].shape[2:]) == ds.batch_shape(keys[0].index)


def test_a_loader_run_on_across_epochs_gives_each_epochs_batches_and_close_mosaic(records: list[Rec]) -> None:
    """run_to: one iteration, the trainer taking each epoch's batches in turn, gives exactly what a pass per epoch
    gives (the keys carry their epoch: the shared epoch is never set here), close_mosaic included."""
    per_epoch_ds = DetectionDataset(records, imgsz=64, augment=True, hyp=NO_HSV, close_mosaic_epoch=2, seed=3)
    loader = build_dataloader(per_epoch_ds, 4, shuffle=True, workers=0, seed=3)
    expected = []
    for epoch in range(3):
        per_epoch_ds.set_epoch(epoch)
        loader.batch_sampler.set_epoch(epoch)
        expected.append([b["img"] for b in loader])
    ds = DetectionDataset(records, imgsz=64, augment=True, hyp=NO_HSV, close_mosaic_epoch=2, seed=3)
    run_on = build_dataloader(ds, 4, shuffle=True, workers=1, seed=3)
    run_on.batch_sampler.run_to(3)
    batches = iter(run_on)
    for epoch in range(3):
        got = [b["img"] for b in itertools.islice(batches, len(run_on))]
        assert len(got) == len(expected[epoch]) and all(map(torch.equal, got, expected[epoch])), epoch
    assert next(batches, None) is None  # the iteration ends with the run's last epoch
    assert max(_background_count(img) for b in expected[1] for img in b) >= 2  # mosaics before close_mosaic
    assert {_background_count(img) for b in expected[2] for img in b} == {1}  # none after


class _Requests(torch.utils.data.Dataset):
    """Logs the epoch of every batch a loader worker is asked for (a line in ``log``)."""

    def __init__(self, log) -> None:
        self.log = log

    def __len__(self) -> int:
        return 16

    def __getitems__(self, keys):
        with open(self.log, "a") as f:
            f.write(f"{keys[0].epoch}\n")
        return [torch.tensor(k.index) for k in keys]


def test_the_workers_prepare_the_next_epoch_before_it_begins(tmp_path) -> None:
    """What run_to is for: while the trainer is still at the end of an epoch (validating, saving), the workers are
    already at work on the next epoch's first batches, instead of standing idle until it begins."""
    log = tmp_path / "requests"
    loader = build_dataloader(_Requests(log), 4, shuffle=True, workers=1, seed=0)
    loader.batch_sampler.run_to(2)
    batches = iter(loader)
    first = list(itertools.islice(batches, len(loader)))  # epoch 0 taken; epoch 1 not asked for yet
    assert len(first) == 4
    asked = wait_for_lines(log, 4 + 1)  # the worker goes on (prefetch) into epoch 1 by itself
    assert asked[:4] == ["0"] * 4 and "1" in asked[4:]
    assert len(list(itertools.islice(batches, len(loader)))) == 4 and next(batches, None) is None


def wait_for_lines(path, n: int, limit_s: float = 60.0) -> list[str]:
    """The lines of ``path`` once it has at least ``n`` (a bounded wait for an event, not a timing)."""
    import time

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        lines = path.read_text().split() if path.exists() else []
        if len(lines) >= n:
            return lines
        time.sleep(0.02)
    return path.read_text().split() if path.exists() else []
