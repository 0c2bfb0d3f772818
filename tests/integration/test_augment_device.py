"""``augment_device=gpu`` end to end on CPU tensors: its batches against the numpy loader's, reproducibility over
runs, ranks and loader workers, a training epoch, and the key's check.

What is compared with the numpy path (``augment_device=cpu``), batch by batch, for three augmentation settings
(the defaults; rotation, shear, flips, mixup and cutmix; perspective), two sizes and two epochs:

* labels: class ids, image of each box and the boxes themselves exactly equal (both come from the same
  ``train_sample.place_sample``, so the fast path's rounded shifts are the same too);
* pixels: mean absolute difference under 1.5 levels, 99th percentile at most 8, every pixel within 48. The two
  differ only by resampling: OpenCV's fixed-point bilinear vs ``grid_sample``; libjpeg's DCT-scaled decode vs a
  block average of the whole decode; the edge pixels of rotated tiles.

The JPEG path is coco8's (``../shared/data/coco8``; skipped without it); the worker-decoded path (PNG) runs on the
synthetic shapes set.
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from detrain import Model
from detrain.config.cfg import make_cfg
from detrain.config.keys import Augment
from detrain.data.dataset import DetectionDataset
from detrain.data.labels.verify import LabelRecord, load_labels
from detrain.data.loader import build_dataloader
from detrain.data.samples.device_render import DeviceBatch
from detrain.data.synthetic import generate_shapes
from detrain.errors import ConfigError

COCO8 = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "coco8"
HYPS = {
    "defaults": Augment(),
    "rotated, mixed, cut": dataclasses.replace(Augment(), degrees=10, shear=3, flipud=0.5, mixup=0.5, cutmix=0.5),
    "perspective": dataclasses.replace(Augment(), perspective=0.0005),
}


def _records(folder: Path, pattern: str = "images/*/*") -> list[LabelRecord]:
    files = sorted(str(p) for p in folder.glob(pattern) if p.suffix in (".jpg", ".png"))
    records, _ = load_labels(files, nc=80, progress=False)
    return records


@pytest.fixture(scope="module")
def coco8() -> list[LabelRecord]:
    if not (COCO8 / "images").is_dir():
        pytest.skip(f"no coco8 at {COCO8}")
    return _records(COCO8)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_shapes(tmp_path_factory.mktemp("gpuaug") / "shapes", n_train=16, n_val=2, imgsz=96, seed=0)


def _both(
    records: list[LabelRecord], hyp: Augment, imgsz: int, epoch: int, device: str = "cpu", **kwargs: Any
) -> tuple[Any, Any]:
    """The numpy loader's batch of every image (rect: of a batch that is not square) and the gpu mode's, drawn on
    ``device``."""
    cpu = DetectionDataset(records, imgsz=imgsz, augment=True, hyp=hyp, seed=3, **kwargs)
    gpu = DetectionDataset(records, imgsz=imgsz, augment=True, hyp=hyp, seed=3, augment_device="gpu", **kwargs)
    keys = list(range(len(records)))
    if cpu.batch_shapes is not None:  # rect: the first batch that is not square
        wide = next(b for b, (h, w) in enumerate(cpu.batch_shapes) if h != w)
        keys = [i for i in keys if cpu.batch_index[i] == wide]  # type: ignore[index]
    cpu.set_epoch(epoch)
    gpu.set_epoch(epoch)
    device_batch = gpu.collate(gpu.__getitems__(keys))
    assert isinstance(device_batch, DeviceBatch)
    batch = device_batch.render(device)
    if device == "cpu":
        one = gpu[keys[-1]]  # a single sample, drawn on the CPU
        assert torch.equal(one["img"], batch["img"][-1]) and one["im_file"] == batch["im_file"][-1]
    assert batch["img"].device.type == device
    batch["img"] = batch["img"].cpu()
    return cpu.collate(cpu.__getitems__(keys)), batch


def _assert_close(want: Any, got: Any) -> None:
    for key in ("cls", "batch_idx", "bboxes"):
        assert torch.equal(want[key], got[key]), key
    assert got["img"].dtype == torch.uint8 and got["img"].shape == want["img"].shape
    assert got["img"].is_contiguous(memory_format=torch.channels_last)
    diff = (want["img"].float() - got["img"].float()).abs().flatten()
    p99 = diff.kthvalue(int(0.99 * diff.numel())).values
    assert diff.mean() < 1.5 and p99 <= 8 and diff.max() <= 48, (diff.mean(), p99, diff.max())


@pytest.mark.parametrize("hyp", HYPS)
def test_jpeg_batches_match_the_numpy_loader(coco8: list[LabelRecord], hyp: str) -> None:
    for imgsz, epoch in ((64, 0), (320, 1)):
        _assert_close(*_both(coco8, HYPS[hyp], imgsz, epoch))


@pytest.mark.parametrize("hyp", HYPS)
def test_worker_decoded_batches_match_the_numpy_loader(shapes: Path, hyp: str) -> None:
    records = _records(shapes, "images/train/*")
    for imgsz, epoch in ((64, 0), (96, 1)):
        _assert_close(*_both(records, HYPS[hyp], imgsz, epoch))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_jpeg_batches_match_the_numpy_loader(coco8: list[LabelRecord]) -> None:
    """nvJPEG decodes here: its pixels differ a little more from libjpeg's than the CPU decoder's."""
    for hyp in HYPS.values():
        for imgsz, epoch in ((64, 0), (640, 1)):
            _assert_close(*_both(coco8, hyp, imgsz, epoch, device="cuda"))


def test_rect_batches_match_the_numpy_loader(shapes: Path) -> None:
    records = _records(shapes, "images/train/*")
    want, got = _both(records, Augment(), 96, 0, rect=True, batch_size=2)
    assert want["img"].shape[2] != want["img"].shape[3]  # a rectangular batch
    _assert_close(want, got)


def _rendered(loader: Any) -> list[Any]:
    out = []
    for batch in loader:
        assert isinstance(batch, DeviceBatch)
        out.append(batch.render("cpu"))
    return out


def test_two_ranks_of_4_see_what_one_of_8_sees_and_again(shapes: Path) -> None:
    """Also through two loader workers (the DeviceBatch crosses a process boundary)."""
    hyp = HYPS["rotated, mixed, cut"]
    ds = DetectionDataset(
        _records(shapes, "images/train/*"), imgsz=64, augment=True, hyp=hyp, seed=2, augment_device="gpu"
    )
    one = _rendered(build_dataloader(ds, 8, shuffle=True, workers=2, seed=2))
    again = _rendered(build_dataloader(ds, 8, shuffle=True, workers=0, seed=2))
    two = [_rendered(build_dataloader(ds, 4, shuffle=True, workers=0, rank=r, world_size=2, seed=2)) for r in (0, 1)]
    assert len(one) == len(two[0]) == 2
    for a, b, r0, r1 in zip(one, again, *two):
        for key in ("img", "cls", "bboxes"):
            assert torch.equal(a[key], b[key])
            assert torch.equal(a[key], torch.cat((r0[key], r1[key])))


def test_an_epoch_trains_with_finite_losses(shapes: Path, tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        metrics = Model("n.yaml").train(
            data=str(shapes / "data.yaml"),
            augment_device="gpu",
            epochs=1,
            imgsz=64,
            batch=8,
            nbs=8,
            device="cpu",
            workers=0,
            warmup_epochs=0,
            close_mosaic=0,
            plots=True,
            verbose=False,
            project=str(tmp_path),
            name="run",
        )
    finally:
        torch.set_num_threads(threads)
    assert metrics is not None
    save_dir = Path(metrics.save_dir)
    rows = list(csv.DictReader((save_dir / "results.csv").open()))
    losses = [float(v) for k, v in rows[0].items() if k.strip().startswith("train/")]
    assert len(rows) == 1 and len(losses) == 3 and all(0 < v < 1e3 for v in losses), rows
    assert (save_dir / "train_batch0.jpg").is_file()  # drawn from the device's images
    assert make_cfg({"cfg": str(save_dir / "args.yaml")}, "train").inputs.augment_device == "gpu"


def test_another_value_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="augment_device"):
        make_cfg({"augment_device": "tpu"}, "train")
    with pytest.raises(ConfigError, match="augment_device='tpu' is not valid: use cpu or gpu"):
        DetectionDataset([LabelRecord("a.png", (8, 8), [], [])], imgsz=64, augment=True, augment_device="tpu")
