"""The mosaic and random affine against Ultralytics' own ``Mosaic`` and ``RandomPerspective``, from the same draws.

Ultralytics' transforms draw from Python's ``random``; each test here records those draws (mosaic centre, then
perspective, angle, scale, shear and translation) and hands the same values to detrain's planner through a
generator that returns them in detrain's order. Same images, same draws: the boxes that survive must be the
same boxes, and the pixels the same up to resampling (detrain warps each source once; Ultralytics copies it
into the 2x canvas, then warps the canvas).

The distributions the samplers produce over many samples (partners, objects per image, box sizes, borders) are
compared by ``scripts/parity_augment.py``; this file pins the geometry one sample at a time.
Ultralytics is not a dependency: the tests skip when it cannot be imported (``PYTHONPATH=/opt/ulib``); the images
are coco8's (``../shared/data/coco8``), and the tests skip without them.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cv2
import numpy as np
import pytest
from _ultralytics import offline_ultralytics

from detrain.data.image_io import read_image, resize_long_side
from detrain.data.samples.affine import random_affine_matrix
from detrain.data.samples.compose import Tile, render
from detrain.data.samples.instances import Labels
from detrain.data.samples.train_sample import mosaic_origins

COCO8 = Path(__file__).resolve().parents[3] / "shared" / "data" / "coco8"
CASES = 24  # samples per setting (fixed seeds)


@pytest.fixture(scope="module")
def ul(tmp_path_factory):
    with offline_ultralytics(tmp_path_factory):
        from ultralytics.data.augment import Mosaic, RandomPerspective
        from ultralytics.data.dataset import YOLODataset

        yield SimpleNamespace(Mosaic=Mosaic, RandomPerspective=RandomPerspective, YOLODataset=YOLODataset)


@pytest.fixture(scope="module")
def coco8(tmp_path_factory) -> Path:
    if not (COCO8 / "images" / "train").is_dir():
        pytest.skip(f"{COCO8} not found")
    root = tmp_path_factory.mktemp("coco8") / "coco8"
    shutil.copytree(COCO8, root, ignore=shutil.ignore_patterns("*.cache"))  # label caches are written beside labels
    return root


class Replay:
    """A stand-in for numpy's generator: ``uniform`` returns recorded values in order (detrain's planner
    only calls ``uniform`` for the mosaic centre and the affine)."""

    def __init__(self, values: list[float]) -> None:
        self.values = list(values)

    def uniform(self, low: float = 0.0, high: float = 1.0, size: Any = None) -> float:
        assert size is None
        value = self.values.pop(0)
        assert low <= value <= high, (low, value, high)
        return value


def _dataset(ul, root: Path, imgsz: int):
    off = (
        "hsv_h",
        "hsv_s",
        "hsv_v",
        "degrees",
        "translate",
        "scale",
        "shear",
        "perspective",
        "flipud",
        "fliplr",
        "mixup",
        "cutmix",
        "copy_paste",
    )
    args = SimpleNamespace(
        **dict.fromkeys(off, 0.0),
        mosaic=1.0,
        copy_paste_mode="flip",
        mask_ratio=4,
        overlap_mask=True,
        bgr=0.0,
        fraction=1.0,
        cache=False,
        single_cls=False,
        classes=None,
        imgsz=imgsz,
        task="detect",
    )
    data = {"names": {i: str(i) for i in range(80)}, "nc": 80, "channels": 3}
    return ul.YOLODataset(
        img_path=str(root / "images" / "train"),
        imgsz=imgsz,
        augment=False,
        hyp=args,
        rect=False,
        batch_size=4,
        stride=32,
        pad=0.0,
        data=data,
        task="detect",
    )


def _ultralytics_sample(ul, dataset, imgsz: int, seed: int, affine: dict[str, float]) -> tuple[Any, list[float]]:
    """Ultralytics' mosaic of images 0 (main), 1, 2, 3, then its random perspective; the uniform draws made."""
    draws: list[float] = []
    real = random.uniform

    def recording(a: float, b: float) -> float:
        draws.append(real(a, b))
        return draws[-1]

    random.seed(seed)
    mosaic = ul.Mosaic(dataset, imgsz=imgsz, p=1.0)
    mosaic.get_indexes = lambda: [1, 2, 3]
    perspective = ul.RandomPerspective(size=(imgsz, imgsz), **affine)
    labels = dataset.get_image_and_label(0)
    random.uniform = recording
    try:
        out = perspective(mosaic(labels))
    finally:
        random.uniform = real
    return out, draws


def _detrain_sample(root: Path, imgsz: int, draws: list[float], affine: dict[str, float]) -> tuple[np.ndarray, Labels]:
    files = sorted((root / "images" / "train").iterdir())[:4]
    images, labels = [], []
    for f in files:
        img = resize_long_side(read_image(str(f)), imgsz)  # Ultralytics' load size
        h, w = img.shape[:2]
        rows = np.loadtxt(root / "labels" / "train" / f"{f.stem}.txt", ndmin=2)
        images.append(img)
        labels.append(Labels.from_xywhn(rows[:, 0], rows[:, 1:5], w, h))
    # Ultralytics' first draw decides whether to mosaic at all (p = 1 here), then come the mosaic centre's y and
    # x; detrain draws x then y; the affine's eight draws come in the same order in both
    _, yc, xc, *rest = draws
    rng = Replay([xc, yc, *rest])
    sizes = [(im.shape[1], im.shape[0]) for im in images]
    origins = mosaic_origins(rng, sizes, imgsz)  # type: ignore[arg-type]
    keys = ("degrees", "translate", "scale", "shear", "perspective")
    m, s = random_affine_matrix(rng, (imgsz, imgsz), (imgsz, imgsz), *(affine[k] for k in keys))  # type: ignore
    assert not rng.values
    tiles = [Tile(im, size, o, lab) for im, size, o, lab in zip(images, sizes, origins, labels)]
    return render(tiles, (2 * imgsz, 2 * imgsz), m, (imgsz, imgsz), s)


DEFAULT = {"degrees": 0.0, "translate": 0.1, "scale": 0.5, "shear": 0.0, "perspective": 0.0}
ROTATED = {"degrees": 10.0, "translate": 0.1, "scale": 0.5, "shear": 2.0, "perspective": 0.0}


@pytest.mark.parametrize("imgsz", [320, 640])
@pytest.mark.parametrize("affine", [DEFAULT, ROTATED], ids=["default", "rotated"])
def test_same_draws_keep_the_same_boxes(ul, coco8, imgsz, affine):
    dataset = _dataset(ul, coco8, imgsz)
    kept = theirs_kept = 0
    for seed in range(CASES):
        theirs, draws = _ultralytics_sample(ul, dataset, imgsz, seed, affine)
        img, ours = _detrain_sample(coco8, imgsz, draws, affine)
        instances = theirs["instances"]
        instances.convert_bbox("xyxy")
        instances.denormalize(imgsz, imgsz) if instances.normalized else None
        boxes = np.asarray(instances.bboxes, np.float64)
        cls = np.asarray(theirs["cls"]).reshape(-1)
        # the same objects, in the same order (tiles in the same order, each tile's labels in file order)
        assert ours.cls.tolist() == cls.tolist(), f"seed {seed}: classes {ours.cls.tolist()} != {cls.tolist()}"
        # the same boxes, up to the half pixel the scale-only fast path may shift a tile by (affine.plan_warp)
        np.testing.assert_allclose(ours.boxes_xyxy, boxes, atol=1.0, err_msg=f"seed {seed}")
        # the same pixels up to resampling (one warp here, a copy then a warp there, sampled a fraction of a pixel
        # apart): seen at most 9.6 grey levels apart on average, 3.6 once both are blurred 5x5 (texture aside);
        # a tile misplaced by even a few pixels differs by tens
        diff = np.abs(img.astype(np.int16) - theirs["img"].astype(np.int16)).mean()
        blurred = np.abs(cv2.blur(img, (5, 5)).astype(np.int16) - cv2.blur(theirs["img"], (5, 5)).astype(np.int16))
        assert diff < 12 and blurred.mean() < 5, (seed, float(diff), float(blurred.mean()))
        kept += len(ours)
        theirs_kept += len(cls)
    assert kept == theirs_kept > CASES  # boxes did survive: the comparison was not of empty label sets
