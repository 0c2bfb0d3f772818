"""DetectionDataset: the sample contract, determinism, YOLOv8-exact validation preprocessing, rect shapes,
unreadable images, close_mosaic, and the disk and RAM caches."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import warnings
from dataclasses import replace
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from _cutmix_check import check_cutmix, grid_scene

from detrain.config.keys import Augment
from detrain.data import image_io
from detrain.data.dataset import DetectionDataset, Pick, rect_batch_shapes
from detrain.data.labels.verify import LabelRecord as Rec
from detrain.data.memory import ram_cache
from detrain.data.memory.ram_cache import RamCache
from detrain.data.samples.instances import Labels
from detrain.errors import DatasetError
from detrain.nn.boxes import scale_boxes_to_original, xywh2xyxy

NO_HSV = Augment(hsv_h=0.0, hsv_s=0.0, hsv_v=0.0)
# BGR colours of the objects (one per class) and of the image backgrounds (one per image).
OBJECT_BGR = [(0, 0, 255), (0, 255, 0), (255, 0, 0), (0, 255, 255), (255, 0, 255), (255, 255, 0)]
BACKGROUND_BGR = [(60, 20, 20), (20, 60, 20), (20, 20, 60), (60, 60, 20), (20, 60, 60), (60, 20, 60)]


def make_images(folder: Path, shapes_hw: list[tuple[int, int]], suffix: str = ".png") -> list[Rec]:
    """One image per shape: a background colour of its own and two objects (classes k % 6, (k + 3) % 6)."""
    records = []
    for k, (h, w) in enumerate(shapes_hw):
        img = np.full((h, w, 3), BACKGROUND_BGR[k % 6], np.uint8)
        boxes = [(0.1 * w, 0.15 * h, 0.5 * w, 0.6 * h), (0.55 * w, 0.3 * h, 0.9 * w, 0.85 * h)]
        cls = [k % 6, (k + 3) % 6]
        for c, (x1, y1, x2, y2) in zip(cls, boxes):
            img[round(y1) : round(y2), round(x1) : round(x2)] = OBJECT_BGR[c]
        path = folder / f"im{k:03d}{suffix}"
        cv2.imwrite(str(path), img, [cv2.IMWRITE_JPEG_QUALITY, 98] if suffix == ".jpg" else [])
        b = np.array([[round(v) for v in box] for box in boxes], np.float32)
        xywhn = np.stack(
            (
                (b[:, 0] + b[:, 2]) / 2 / w,
                (b[:, 1] + b[:, 3]) / 2 / h,
                (b[:, 2] - b[:, 0]) / w,
                (b[:, 3] - b[:, 1]) / h,
            ),
            1,
        )
        records.append(Rec(str(path), (h, w), np.array(cls, np.int64), xywhn.astype(np.float32)))
    return records


SHAPES = [(96, 128), (128, 96), (80, 80), (120, 160), (100, 70), (64, 128), (128, 128), (90, 120)]


@pytest.fixture
def records(tmp_path: Path) -> list[Rec]:
    return make_images(tmp_path, SHAPES)


def assert_sample_contract(s: dict, hw: tuple[int, int]) -> None:
    assert s["img"].dtype == torch.uint8 and tuple(s["img"].shape) == (3, *hw) and s["img"].is_contiguous()
    assert s["cls"].dtype == torch.float32 and s["cls"].shape[1:] == (1,)
    assert s["bboxes"].dtype == torch.float32 and s["bboxes"].shape == (len(s["cls"]), 4)
    assert (s["bboxes"] >= 0).all() and (s["bboxes"] <= 1).all()
    assert isinstance(s["im_file"], str) and len(s["ori_shape"]) == 2


def boxes_on_objects(s: dict, min_fraction: float = 0.6) -> None:
    """Inside each box (shrunk by 2 px), most pixels have the colour of its class (the image is RGB)."""
    img = s["img"].permute(1, 2, 0).numpy().astype(np.int16)
    h, w = img.shape[:2]
    boxes = xywh2xyxy(s["bboxes"] * torch.tensor([w, h, w, h])).numpy()
    for c, (x1, y1, x2, y2) in zip(s["cls"].view(-1).int().tolist(), boxes):
        inner = img[math.ceil(y1) + 2 : math.floor(y2) - 2, math.ceil(x1) + 2 : math.floor(x2) - 2]
        if inner.size == 0:
            continue
        rgb = np.array(OBJECT_BGR[c][::-1], np.int16)
        fraction = (np.abs(inner - rgb) <= 40).all(-1).mean()
        assert fraction >= min_fraction, f"class {c} box {x1, y1, x2, y2}: only {fraction:.0%} of it is the object"


def test_train_sample_contract_and_boxes(records: list[Rec]) -> None:
    ds = DetectionDataset(records, imgsz=128, augment=True, hyp=NO_HSV, seed=3)
    n_boxes = 0
    for i in range(len(ds)):
        s = ds[i]
        assert_sample_contract(s, (128, 128))
        boxes_on_objects(s)
        n_boxes += len(s["cls"])
    assert n_boxes >= len(ds)


def test_train_with_rotation_mixup_and_flips(records: list[Rec]) -> None:
    hyp = replace(NO_HSV, degrees=15.0, mixup=1.0, flipud=0.5)
    ds = DetectionDataset(records, imgsz=96, augment=True, hyp=hyp)
    for i in range(4):
        assert_sample_contract(ds[i], (96, 96))


def test_reduced_jpeg_decoding_keeps_boxes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 1024-px files shown at 128 px without zoom (scale 0): decoded at 1/8 scale, boxes still on their objects.
    recs = make_images(tmp_path, [(768, 1024), (1024, 768), (800, 1024), (1024, 1024)], ".jpg")
    reductions = []
    real = image_io.read_image
    monkeypatch.setattr(
        "detrain.data.dataset.read_image", lambda p, r=1, *cap: reductions.append(r) or real(p, r, *cap)
    )
    ds = DetectionDataset(recs, imgsz=128, augment=True, hyp=replace(NO_HSV, scale=0.0), seed=1)
    for i in range(len(ds)):
        s = ds[i]
        assert_sample_contract(s, (128, 128))
        boxes_on_objects(s, 0.5)
    assert set(reductions) == {8}


def test_same_seed_epoch_index_same_sample(records: list[Rec]) -> None:
    a = DetectionDataset(records, imgsz=96, augment=True, seed=7)
    b = DetectionDataset(records, imgsz=96, augment=True, seed=7)
    pick = Pick(2, (2, 5, 1, 7))
    same = [a[2], b[2], a.__getitems__([0, 2])[1]]
    assert all(torch.equal(same[0]["img"], s["img"]) and torch.equal(same[0]["bboxes"], s["bboxes"]) for s in same)
    assert torch.equal(a[pick]["img"], b[pick]["img"])
    assert not torch.equal(a[2]["img"], a[3]["img"])
    b.set_epoch(1)
    assert not torch.equal(a[2]["img"], b[2]["img"])
    assert not torch.equal(a[2]["img"], DetectionDataset(records, 96, True, seed=8)[2]["img"])


def test_val_is_yolov8_load_image_and_letterbox(tmp_path: Path) -> None:
    recs = make_images(tmp_path, [(96, 128), (131, 70), (200, 300), (64, 64)], ".jpg")
    imgsz = 160
    ds = DetectionDataset(recs, imgsz=imgsz, augment=False)
    for i, rec in enumerate(ds.records):
        s = ds[i]
        # Independent statement of the rule: long side to imgsz (ceil, capped), INTER_LINEAR, only if r != 1 ...
        im0 = cv2.imread(rec.im_file)
        h0, w0 = im0.shape[:2]
        r = imgsz / max(h0, w0)
        im = cv2.resize(im0, (min(math.ceil(w0 * r), imgsz), min(math.ceil(h0 * r), imgsz))) if r != 1 else im0
        # ... then letterbox to imgsz x imgsz without upscaling, centred, grey 114.
        h, w = im.shape[:2]
        dw, dh = (imgsz - w) / 2, (imgsz - h) / 2
        top, left = round(dh - 0.1), round(dw - 0.1)
        expected = cv2.copyMakeBorder(
            im, top, round(dh + 0.1), left, round(dw + 0.1), cv2.BORDER_CONSTANT, value=(114, 114, 114)
        )
        assert torch.equal(s["img"], torch.from_numpy(expected[..., ::-1].transpose(2, 0, 1).copy()))
        assert s["ori_shape"] == (h0, w0)
        assert s["ratio_pad"] == ((h / h0, w / w0), (left, top))
        # The validator's mapping back recovers the label boxes of the original file.
        boxes = xywh2xyxy(s["bboxes"] * imgsz)
        back = scale_boxes_to_original(boxes, s["ratio_pad"][0][0], s["ratio_pad"][1], (h0, w0))
        truth = xywh2xyxy(torch.from_numpy(rec.bboxes_xywhn) * torch.tensor([w0, h0, w0, h0]))
        assert torch.allclose(back, truth, atol=1.0)


def test_rect_batch_shapes_follow_the_formula(tmp_path: Path) -> None:
    shapes = [(100, 200), (200, 100), (150, 150), (90, 160), (160, 90), (120, 100), (100, 130)]
    recs = make_images(tmp_path, shapes)
    imgsz, stride, bs = 128, 32, 2
    ds = DetectionDataset(recs, imgsz=imgsz, augment=False, rect=True, batch_size=bs, stride=stride)
    ar = np.array([h / w for h, w in shapes])
    order = np.argsort(ar)
    assert [r.im_file for r in ds.records] == [recs[i].im_file for i in order]
    sorted_ar = ar[order]
    for b in range(math.ceil(len(shapes) / bs)):
        group = sorted_ar[b * bs : (b + 1) * bs]
        shape = [group.max(), 1] if group.max() < 1 else [1, 1 / group.min()] if group.min() > 1 else [1, 1]
        expected = [math.ceil(v * imgsz / stride + 0.5) * stride for v in shape]
        assert ds.batch_shapes[b].tolist() == expected
        for i in range(b * bs, min((b + 1) * bs, len(shapes))):
            s = ds[i]
            assert list(s["img"].shape[1:]) == expected
            (gy, gx), (px, py) = s["ratio_pad"]
            h0, w0 = s["ori_shape"]
            assert abs(h0 * gy + 2 * py - expected[0]) <= 1 and abs(w0 * gx + 2 * px - expected[1]) <= 1


def test_rect_batch_shapes_helper_square_batch() -> None:
    _, bi, shapes = rect_batch_shapes(np.array([[480, 640], [640, 480]], float), 2, 640, 32, 0.5)
    assert bi.tolist() == [0, 0] and shapes.tolist() == [[672, 672]]


def test_unreadable_image_is_replaced_not_fatal(records: list[Rec]) -> None:
    train = DetectionDataset(records, imgsz=64, augment=True)
    val = DetectionDataset(records, imgsz=64, augment=False)
    Path(records[3].im_file).unlink()
    with pytest.warns(UserWarning, match="im003"):
        batch = train.__getitems__(list(range(len(train))))
    assert len(batch) == len(train) and train.skipped_images >= 1
    assert all(s["im_file"] != records[3].im_file for s in batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = val[3]
    assert len(s["cls"]) == 0 and (s["img"] == 114).all() and s["im_file"] == records[3].im_file


def background_colours(s: dict) -> int:
    """How many image backgrounds show in a sample (a mosaic shows several)."""
    img = s["img"].permute(1, 2, 0).numpy().astype(np.int16)
    return sum((np.abs(img - np.array(c[::-1], np.int16)) <= 8).all(-1).mean() > 0.02 for c in BACKGROUND_BGR)


def test_close_mosaic_epoch_and_switch(records: list[Rec]) -> None:
    ds = DetectionDataset(records, imgsz=96, augment=True, hyp=NO_HSV, close_mosaic_epoch=2)
    assert ds.mosaic_active and max(background_colours(ds[i]) for i in range(len(ds))) >= 2
    ds.set_epoch(2)
    assert not ds.mosaic_active and all(background_colours(ds[i]) == 1 for i in range(len(ds)))
    ds2 = DetectionDataset(records, imgsz=96, augment=True, hyp=NO_HSV)
    ds2.close_mosaic()
    assert not ds2.mosaic_active and all(background_colours(ds2[i]) == 1 for i in range(4))


def test_close_mosaic_switches_mixup_and_cutmix_off_too(records: list[Rec]) -> None:
    """Before the switch mixup and cutmix change samples; after it each sample is what it is without them (their
    draws do not shift the others)."""
    mixed = DetectionDataset(
        records, imgsz=96, augment=True, hyp=Augment(mosaic=0.0, mixup=1.0, cutmix=1.0), close_mosaic_epoch=1
    )
    plain = DetectionDataset(records, imgsz=96, augment=True, hyp=Augment(mosaic=0.0), close_mosaic_epoch=1)
    assert all(not torch.equal(mixed[i]["img"], plain[i]["img"]) for i in range(len(mixed)))
    mixed.set_epoch(1)
    plain.set_epoch(1)
    for i in range(len(mixed)):
        a, b = mixed[i], plain[i]
        assert torch.equal(a["img"], b["img"]) and torch.equal(a["bboxes"], b["bboxes"])


def _write(path: Path, img: np.ndarray, labels: Labels) -> Rec:
    cv2.imwrite(str(path), img)
    h, w = img.shape[:2]
    return Rec(str(path), (h, w), labels.cls, labels.to_xywhn(w, h))


def test_cutmix_pastes_a_rectangle_of_a_pool_partner_with_its_boxes(tmp_path: Path) -> None:
    """With cutmix=1.0 and no other geometry (the image shown 1:1), a sample of image 0 whose pool holds image 1
    shows image 1's pixels in one rectangle away from its own object, with image 1's boxes clipped to it; those
    mostly outside are dropped. The rectangle's pixels come through the batch's decodes (the plan's tiles)."""
    base = np.full((96, 96, 3), BACKGROUND_BGR[0], np.uint8)
    base[4:22, 70:92] = OBJECT_BGR[0]
    base_labels = Labels([0], [[70, 4, 92, 22]])
    partner, partner_labels = grid_scene(96, 96, 14, 10, 1, OBJECT_BGR[1])
    recs = [_write(tmp_path / "base.png", base, base_labels), _write(tmp_path / "partner.png", partner, partner_labels)]
    hyp = replace(NO_HSV, mosaic=0.0, cutmix=1.0, scale=0.0, translate=0.0, fliplr=0.0)
    ds = DetectionDataset(recs, imgsz=96, augment=True, hyp=hyp, seed=5)
    seen = {"pasted": 0, "clipped": 0, "dropped": 0}
    for epoch in range(24):
        ds.set_epoch(epoch)
        pick = Pick(0, (0, 1))
        plan = ds._plan(pick, epoch, 0, True, None)
        assert plan.cutmix is not None and [t.index for t in plan.layers[-1].tiles] == [1]  # decoded with the batch
        s = ds[pick]
        out = np.ascontiguousarray(s["img"].permute(1, 2, 0).numpy()[..., ::-1])  # RGB -> BGR
        labels = Labels(s["cls"].view(-1).numpy(), xywh2xyxy(s["bboxes"] * 96).numpy())
        for k, v in check_cutmix(out, labels, base, base_labels, partner, partner_labels, 1).items():
            seen[k] += v
    assert seen["pasted"] >= 10 and seen["clipped"] >= 5 and seen["dropped"] >= 1, seen


def test_collate(records: list[Rec]) -> None:
    ds = DetectionDataset(records, imgsz=64, augment=True)
    samples = ds.__getitems__([0, 1, 2])
    batch = DetectionDataset.collate(samples)
    assert batch["img"].shape == (3, 3, 64, 64) and batch["img"].dtype == torch.uint8
    m = len(batch["cls"])
    assert batch["batch_idx"].shape == (m,) and batch["bboxes"].shape == (m, 4) and batch["cls"].shape == (m, 1)
    assert batch["batch_idx"].tolist() == sorted(batch["batch_idx"].tolist())
    assert len(batch["im_file"]) == len(batch["ori_shape"]) == len(batch["ratio_pad"]) == 3
    # A whole __getitems__ batch is handed on as views of its one block; anything else is stacked: same values.
    assert batch["img"].data_ptr() == samples[0]["img"].data_ptr()
    assert batch["img"].is_contiguous(memory_format=torch.channels_last)  # training batches: what the model wants
    assert batch["cls"].untyped_storage().data_ptr() == batch["img"].untyped_storage().data_ptr()
    stacked = DetectionDataset.collate([ds[i] for i in (0, 1, 2)])
    assert stacked["img"].data_ptr() != samples[0]["img"].data_ptr()
    for key in ("img", "batch_idx", "cls", "bboxes"):
        assert torch.equal(batch[key], stacked[key]), key
    part = DetectionDataset.collate(samples[1:])
    assert torch.equal(part["img"], batch["img"][1:]) and part["batch_idx"].max() <= 1
    val = DetectionDataset(records, imgsz=64, augment=False)
    vbatch = DetectionDataset.collate(val.__getitems__([0, 1]))
    assert vbatch["img"].is_contiguous() and torch.equal(vbatch["img"][1], val[1]["img"])


def test_disk_cache_gives_the_same_samples(records: list[Rec]) -> None:
    plain_val = DetectionDataset(records, imgsz=96, augment=False)
    plain_train = DetectionDataset(records, imgsz=96, augment=True)
    disk_val = DetectionDataset(records, imgsz=96, augment=False, cache="disk")
    disk_train = DetectionDataset(records, imgsz=96, augment=True, cache="disk")
    for i in range(3):
        assert torch.equal(plain_val[i]["img"], disk_val[i]["img"])
        assert torch.equal(plain_train[i]["img"], disk_train[i]["img"])
    assert Path(records[0].im_file).with_suffix(".npy").exists()
    arr = np.load(Path(records[0].im_file).with_suffix(".npy"), allow_pickle=False)
    assert np.array_equal(arr, cv2.imread(records[0].im_file))


def test_ram_cache_dataset_same_samples_and_cleanup(records: list[Rec]) -> None:
    plain = DetectionDataset(records, imgsz=96, augment=False)
    cached = DetectionDataset(records, imgsz=96, augment=False, cache="ram")
    path = Path(cached._ram.path)
    assert path.exists() and path.parent.name == f"detrain-{os.geteuid()}"  # this user's private folder
    for i in range(len(plain)):
        assert torch.equal(plain[i]["img"], cached[i]["img"])
    del cached
    import gc

    gc.collect()
    assert not path.exists() and not list(path.parent.glob(f"{path.stem}.*"))


def test_ram_cache_dataset_takes_its_place_on_the_node_from_its_world_not_the_environment(
    records: list[Rec], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second local rank waits for the first one's cache (here none comes); LOCAL_RANK in the environment is not
    read: the loaders pass the World's local rank. Under a launcher the local ranks name the cache by their parent."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    filled = DetectionDataset(records, imgsz=96, augment=False, hyp={}, cache="ram", cache_timeout_s=2)  # fills
    assert filled._ram is not None and filled._ram.owner_pid == os.getpid()
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(DatasetError, match="waiting for local rank 0"):
        DetectionDataset(records, imgsz=64, augment=False, hyp={}, cache="ram", cache_timeout_s=0.3, local_rank=1)
    monkeypatch.setenv("DETRAIN_RUN_ID", "ignored")  # no environment variable names the run (the World does)
    assert (ram_cache.run_tag(), ram_cache.run_tag(launched=True)) == (str(os.getpid()), str(os.getppid()))


def _read_cache_in_child(directory: str, key: str, shapes: list, queue: mp.Queue) -> None:
    cache = RamCache.build(key, shapes, lambda i: None, local_rank=1, timeout_s=30, directory=directory)
    queue.put([cache.get(i).tobytes() for i in range(len(shapes))])


def test_ram_cache_is_shared_across_processes(tmp_path: Path) -> None:
    shapes = [(5, 7), (3, 4), (8, 8)]
    images = [np.random.default_rng(i).integers(0, 255, (*s, 3), dtype=np.uint8) for i, s in enumerate(shapes)]
    cache = RamCache.build("share", shapes, lambda i: images[i], local_rank=0, directory=str(tmp_path))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_read_cache_in_child, args=(str(tmp_path), "share", shapes, queue))
    child.start()
    got = queue.get(timeout=120)
    child.join(60)
    assert child.exitcode == 0
    assert got == [im.tobytes() for im in images]
    assert all(np.array_equal(cache.get(i), images[i]) for i in range(3))
    assert not cache.get(0).flags.writeable


def test_ram_cache_refuses_what_does_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(ram_cache, "available_memory_bytes", lambda: 1000)
    with pytest.raises(DatasetError, match="cache=ram needs"):
        RamCache.build("big", [(100, 100)], lambda i: None, local_rank=0, directory=str(tmp_path))
    assert "needed" in capsys.readouterr().out and not list(tmp_path.iterdir())


def test_ram_cache_wait_times_out_naming_what_it_waited_for(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"local rank 0 .*detrain-ram-nobody"):
        RamCache.build("nobody", [(2, 2)], lambda i: None, local_rank=1, timeout_s=0.3, directory=str(tmp_path))


def test_ram_cache_marks_unreadable_images(tmp_path: Path) -> None:
    cache = RamCache.build(
        "gaps",
        [(2, 2), (2, 2)],
        lambda i: None if i else np.ones((2, 2, 3), np.uint8),
        local_rank=0,
        directory=str(tmp_path),
    )
    assert cache.get(0) is not None and cache.get(1) is None


COCO8 = Path(__file__).resolve().parents[3] / "shared" / "data" / "coco8"


@pytest.mark.skipif(not COCO8.is_dir(), reason="../shared/data/coco8 is not there")
def test_val_samples_equal_ultralytics(tmp_path: Path) -> None:
    """Bit-for-bit the same validation tensors, order, rect shapes, ratio_pad and boxes as YOLOv8's own loader
    (runs where ``ultralytics`` is importable, e.g. PYTHONPATH=/opt/ulib; on a copy, so its label cache stays here)."""
    pytest.importorskip("ultralytics")
    import shutil

    from ultralytics.cfg import get_cfg
    from ultralytics.data.build import build_yolo_dataset

    for sub in ("images", "labels"):
        shutil.copytree(COCO8 / sub / "val", tmp_path / sub / "val")
    recs = []
    for f in sorted((tmp_path / "images" / "val").glob("*.jpg")):
        rows = np.loadtxt(tmp_path / "labels" / "val" / f"{f.stem}.txt", ndmin=2).reshape(-1, 5)
        rows = np.unique(rows, axis=0)  # as its label check does
        shape = cv2.imread(str(f)).shape[:2]
        recs.append(Rec(str(f), shape, rows[:, 0].astype(np.int64), rows[:, 1:].astype(np.float32)))
    data = {
        "path": str(tmp_path),
        "val": str(tmp_path / "images" / "val"),
        "names": {i: str(i) for i in range(80)},
        "nc": 80,
        "channels": 3,
    }
    for imgsz, batch in ((640, 2), (320, 3)):
        theirs = build_yolo_dataset(
            get_cfg(overrides={"imgsz": imgsz, "batch": batch}),
            data["val"],
            batch,
            data,
            mode="val",
            rect=True,
            stride=32,
        )
        ours = DetectionDataset(recs, imgsz=imgsz, augment=False, rect=True, batch_size=batch)
        assert [str(f) for f in theirs.im_files] == ours.im_files
        assert np.array_equal(theirs.batch_shapes, ours.batch_shapes)
        for i in range(len(ours)):
            t, o = theirs[i], ours[i]
            assert torch.equal(t["img"], o["img"])
            assert tuple(t["ori_shape"]) == o["ori_shape"]
            (tg, tp), (og, op) = t["ratio_pad"], o["ratio_pad"]
            assert tuple(map(float, tg)) == og and tuple(map(float, tp)) == op
            key = lambda c, b: sorted(zip(c.view(-1).tolist(), map(tuple, b.tolist())))  # noqa: E731
            assert np.allclose(
                np.array([k[1] for k in key(t["cls"], t["bboxes"])]),
                np.array([k[1] for k in key(o["cls"], o["bboxes"])]),
                atol=1e-6,
            )
