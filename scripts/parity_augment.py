"""Do detrain's augmented training images follow the same distributions as Ultralytics'? One table, side by side.

Both training loaders are built the way their trainers build them, with default hyperparameters, on the same
images: detrain's through ``detrain.data.prepare`` (``load_split`` + ``build_train_loader``), Ultralytics' through
``build_yolo_dataset(mode="train")`` + ``build_dataloader``, seeded, for ``--epochs`` epochs of a 100-epoch run
(mosaic on). detrain's samples do not depend on its worker count; Ultralytics' do: each loader worker keeps its
own mosaic buffer of the images it loaded, so ``--ultralytics-workers 8`` (its trainer's default) draws partners
from fewer images than the default 0 workers, one buffer for everything. The images are linked into a temporary
folder first, so neither label cache is written beside the real labels.

What each training image was made of is recorded, not inferred: for detrain the rendered ``SamplePlan`` (its
tiles' indices, read by wrapping ``render_geometry`` in ``detrain.data.dataset``), for Ultralytics the indices
``Mosaic.get_indexes`` returned for each ``__getitem__`` (sent along with each batch from a worker).

    PYTHONPATH=/opt/ulib YOLO_OFFLINE=1 python scripts/parity_augment.py          # coco128, 640 and 320, 2 epochs
    PYTHONPATH=/opt/ulib YOLO_OFFLINE=1 python scripts/parity_augment.py --data path/to/data.yaml --imgsz 640 --epochs 1
    PYTHONPATH=/opt/ulib YOLO_OFFLINE=1 python scripts/parity_augment.py --imgsz 640 --ultralytics-workers 8

Without Ultralytics importable only detrain's columns are printed.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_DATA = REPO.parent / "shared" / "data" / "coco128.yaml"
BORDER_PX = 0.5  # a box edge this close to the image edge counts as cut by it
SMALL_PX = 8.0  # boxes whose short side is below this are "small"


@dataclass
class Sample:
    """What one training image was made of: source image indices (the main image first, then its mosaic partners,
    then any mixup layer's) and whether its first layer is a mosaic; ``reduce`` the decode reduction per tile
    and whether that tile's file has a side not divisible by it (detrain only)."""

    tiles: list[int]
    mosaic: bool
    reduce: list[tuple[int, bool]] = field(default_factory=list)


@dataclass
class Stats:
    """Everything measured over a run's batches."""

    n_images: int  # in the dataset
    objects: list[int] = field(default_factory=list)  # per training image
    box_w: list[float] = field(default_factory=list)  # px
    box_h: list[float] = field(default_factory=list)
    cut: int = 0  # boxes touching the image border
    mean: list[float] = field(default_factory=list)  # per image, grey level 0-255
    contrast: list[float] = field(default_factory=list)  # per image, std of the grey level
    sharpness: list[float] = field(default_factory=list)  # per image, variance of the Laplacian of the grey level
    detail: list[float] = field(default_factory=list)  # per image, the same over its non-flat pixels only
    samples: list[Sample] = field(default_factory=list)
    sources_per_batch: list[int] = field(default_factory=list)
    epoch_counts: list[Counter] = field(default_factory=list)  # per epoch: how often each image was a tile

    def add_batch(self, batch: dict[str, Any], samples: Sequence[Sample]) -> None:
        img = batch["img"]
        n, _, h, w = img.shape
        if len(samples) != n:
            raise RuntimeError(f"recorded {len(samples)} samples for a batch of {n} images")
        idx = batch["batch_idx"].view(-1).long().numpy()
        boxes = batch["bboxes"].view(-1, 4).double().numpy() * [w, h, w, h]
        self.objects += np.bincount(idx, minlength=n).tolist()
        self.box_w += boxes[:, 2].tolist()
        self.box_h += boxes[:, 3].tolist()
        x1, y1 = boxes[:, 0] - boxes[:, 2] / 2, boxes[:, 1] - boxes[:, 3] / 2
        x2, y2 = boxes[:, 0] + boxes[:, 2] / 2, boxes[:, 1] + boxes[:, 3] / 2
        self.cut += int(((x1 < BORDER_PX) | (y1 < BORDER_PX) | (x2 > w - BORDER_PX) | (y2 > h - BORDER_PX)).sum())
        for k in range(n):
            grey = grey_level(img[k])
            self.mean.append(float(grey.mean()))
            self.contrast.append(float(grey.std()))
            self.sharpness.append(float(cv2.Laplacian(grey, cv2.CV_64F).var()))
            self.detail.append(detail(grey))
        self.samples += samples
        self.sources_per_batch.append(len({i for s in samples for i in s.tiles}))
        self.epoch_counts[-1].update(i for s in samples for i in s.tiles)

    def rows(self) -> dict[str, str]:
        """The table's cells for this run, by row name."""
        obj = np.array(self.objects)
        bw, bh = np.array(self.box_w), np.array(self.box_h)
        boxes = max(len(bw), 1)
        mosaics = [s for s in self.samples if s.mosaic]
        counts = np.array([c.get(i, 0) for c in self.epoch_counts for i in range(self.n_images)])
        pairs: Counter = Counter()
        for s in mosaics:
            pairs.update(itertools.combinations(sorted(set(s.tiles)), 2))
        pair_n = np.array(list(pairs.values())) if pairs else np.zeros(1)
        tiles = [r for s in self.samples for r in s.reduce]
        out = {
            "training images": f"{len(obj)}",
            "objects / image: mean": f"{obj.mean():.2f}",
            "objects / image: p10 p50 p90 max": _q(obj, (10, 50, 90, 100), "{:.0f}"),
            "images without objects": _pct((obj == 0).mean()),
            "box width px: p5 p25 p50 p75 p95": _q(bw, (5, 25, 50, 75, 95), "{:.0f}"),
            "box height px: p5 p25 p50 p75 p95": _q(bh, (5, 25, 50, 75, 95), "{:.0f}"),
            f"boxes with short side < {SMALL_PX:g} px": _pct((np.minimum(bw, bh) < SMALL_PX).sum() / boxes),
            "boxes cut by the image border": _pct(self.cut / boxes),
            "mosaic images": _pct(len(mosaics) / max(len(self.samples), 1)),
            "distinct sources / batch: mean min": f"{np.mean(self.sources_per_batch):.1f} "
            f"{min(self.sources_per_batch)}",
            "uses of an image / epoch: mean std": f"{counts.mean():.2f} {counts.std():.2f}",
            "uses of an image / epoch: min max": f"{counts.min()} {counts.max()}",
            "mosaics with an image twice": _pct(
                sum(len(set(s.tiles)) < len(s.tiles) for s in mosaics) / max(len(mosaics), 1)
            ),
            "image pairs in mosaics: distinct / total": f"{len(pairs)} / {int(pair_n.sum())}",
            "pair seen again (of all pair uses)": _pct(1 - len(pairs) / max(pair_n.sum(), 1)),
            "uses of a pair: mean max": f"{pair_n.mean():.2f} {pair_n.max():.0f}",
            "grey level: mean (std over images)": f"{np.mean(self.mean):.1f} ({np.std(self.mean):.1f})",
            "contrast (grey std): mean": f"{np.mean(self.contrast):.1f}",
            "sharpness (var of Laplacian): p50 mean": f"{np.median(self.sharpness):.0f} {np.mean(self.sharpness):.0f}",
            "sharpness of non-flat pixels: p50 mean": f"{np.median(self.detail):.0f} {np.mean(self.detail):.0f}",
            "tiles decoded at 1/2 1/4 1/8": "n/a",
            "reduced tiles with a partial last pixel": "n/a",
        }
        if tiles:
            by = Counter(f for f, _ in tiles)
            out["tiles decoded at 1/2 1/4 1/8"] = " ".join(_pct(by[f] / len(tiles)) for f in (2, 4, 8))
            reduced = [odd for f, odd in tiles if f > 1]
            out["reduced tiles with a partial last pixel"] = _pct(np.mean(reduced)) if reduced else "-"
        return out


def grey_level(chw: torch.Tensor) -> np.ndarray:
    """The grey level (H, W) uint8 of an RGB (3, H, W) uint8 image tensor."""
    return cv2.cvtColor(np.ascontiguousarray(chw.permute(1, 2, 0).numpy()), cv2.COLOR_RGB2GRAY)


def detail(grey: np.ndarray) -> float:
    """Mean squared Laplacian over the pixels whose 3 x 3 neighbourhood is not flat: sharpness without the
    padding and fill (flat grey), so images with more or less fill compare."""
    kernel = np.ones((3, 3), np.uint8)
    textured = cv2.dilate(grey, kernel) != cv2.erode(grey, kernel)
    lap = cv2.Laplacian(grey, cv2.CV_64F)
    return float((lap[textured] ** 2).mean()) if textured.any() else 0.0


def _q(values: np.ndarray, qs: Sequence[float], fmt: str) -> str:
    if not len(values):
        return "-"
    return " ".join(fmt.format(v) for v in np.percentile(values, qs))


def _pct(x: float) -> str:
    return f"{100 * float(x):.1f}%"


# -- the same images for both, in a temporary folder ---------------------------------------------------------------
def mirror_dataset(data: str, folder: Path) -> tuple[Path, dict[int, str]]:
    """Link the train images of ``data`` (and their labels) into folder/images/train, folder/labels/train; write
    folder/data.yaml using them for train and val. Returns (that yaml, class names)."""
    import yaml

    from detrain.data.dataset_yaml import load_dataset_yaml
    from detrain.data.labels.verify import img2label_path

    info = load_dataset_yaml(data, download=False)
    (folder / "images" / "train").mkdir(parents=True)
    (folder / "labels" / "train").mkdir(parents=True)
    seen: set[str] = set()
    for k, im in enumerate(info.train):
        src = Path(im)
        name = src.name if src.name not in seen else f"{k:07d}_{src.name}"  # same name in two folders
        seen.add(name)
        (folder / "images" / "train" / name).symlink_to(src.resolve())
        label = Path(img2label_path(im))
        if label.exists():
            (folder / "labels" / "train" / f"{Path(name).stem}.txt").symlink_to(label.resolve())
    names = {int(k): str(v) for k, v in info.names.items()}
    spec = {"path": str(folder), "train": "images/train", "val": "images/train", "names": names}
    yaml_file = folder / "data.yaml"
    yaml_file.write_text(yaml.safe_dump(spec, sort_keys=False))
    return yaml_file, names


# -- detrain -------------------------------------------------------------------------------------------------------
@contextmanager
def detrain_plans(shapes_hw: Callable[[], Sequence[tuple[int, int]]]) -> Iterator[list[Sample]]:
    """Record each rendered training sample's plan, in order (wraps ``render_geometry`` as the dataset sees it)."""
    from detrain.data import dataset as module

    if not hasattr(module, "render_geometry"):
        raise SystemExit("detrain.data.dataset no longer renders through render_geometry: update detrain_plans()")
    original = module.render_geometry
    records: list[Sample] = []

    def recording(plan: Any, *args: Any, **kwargs: Any) -> Any:
        shapes = shapes_hw()
        tiles = [t for layer in plan.layers for t in layer.tiles]
        reduce = [
            (f, bool(shapes[t.index][0] % f or shapes[t.index][1] % f))
            for t, f in ((t, int(getattr(t, "reduce", 1))) for t in tiles)
        ]
        mosaic = bool(getattr(plan, "mosaic", len(plan.layers[0].tiles) > 1))
        records.append(Sample([int(t.index) for t in tiles], mosaic, reduce))
        return original(plan, *args, **kwargs)

    module.render_geometry = recording
    try:
        yield records
    finally:
        module.render_geometry = original


def run_detrain(data_yaml: Path, imgsz: int, batch: int, epochs: int, seed: int, cache: str = "") -> Stats:
    from detrain.config.cfg import make_cfg
    from detrain.data.prepare import build_train_loader, load_split
    from detrain.distributed.world import World

    cfg = make_cfg(
        {"data": str(data_yaml), "imgsz": imgsz, "batch": batch, "workers": 0, "seed": seed, "cache": cache or False}
    )
    split = load_split(cfg.inputs.data, "train", cfg, verbose=False)
    loader = build_train_loader(split, cfg, local_batch=batch, world=World())
    dataset = loader.dataset
    stats = Stats(len(dataset))
    with detrain_plans(lambda: dataset.shapes_hw) as records:
        for epoch in range(epochs):
            loader.batch_sampler.set_epoch(epoch)
            dataset.set_epoch(epoch)
            stats.epoch_counts.append(Counter())
            for b in loader:
                stats.add_batch(b, records[-len(b["img"]) :])
    return stats


def validation_detail(data_yaml: Path, imgsz: int, batch: int) -> tuple[float, float]:
    """(p50, mean) of :func:`detail` over the validation images (the same pixels in both pipelines: detrain's
    validation preprocessing is Ultralytics' exactly), a reference for what the model is scored on."""
    from detrain.config.cfg import make_cfg
    from detrain.data.prepare import build_val_loader, load_split
    from detrain.distributed.world import World

    cfg = make_cfg({"data": str(data_yaml), "imgsz": imgsz, "batch": batch, "workers": 0})
    loader = build_val_loader(load_split(cfg.inputs.data, "val", cfg, verbose=False), cfg, batch, World())
    values = [detail(grey_level(img)) for b in loader for img in b["img"]]
    return float(np.median(values)), float(np.mean(values))


# -- Ultralytics ---------------------------------------------------------------------------------------------------
@contextmanager
def ultralytics_samples(dataset: Any) -> Iterator[list[Sample]]:
    """Record, per ``dataset[i]``, the index and the partners its mosaic drew (in loader order, 0 workers)."""
    from ultralytics.data.augment import Mosaic

    records: list[Sample] = []
    base = type(dataset)
    original_indexes = Mosaic.get_indexes

    def getitem(self: Any, index: int) -> Any:
        records.append(Sample([int(index)], False))
        return base.__getitem__(self, index)

    def get_indexes(self: Any) -> Any:
        out = original_indexes(self)
        if self.dataset is dataset and records:
            records[-1].tiles += [int(i) for i in ([out] if isinstance(out, int) else out)]
            records[-1].mosaic = True
        return out

    dataset.__class__ = type(f"Recorded{base.__name__}", (base,), {"__getitem__": getitem})
    Mosaic.get_indexes = get_indexes
    try:
        yield records
    finally:
        Mosaic.get_indexes = original_indexes
        dataset.__class__ = base


def run_ultralytics(
    folder: Path, names: dict[int, str], imgsz: int, batch: int, epochs: int, seed: int, workers: int = 0
) -> Stats | None:
    """Ultralytics' training batches; with ``workers`` > 0 each worker process has its own mosaic buffer, as in
    a real run (its default is 8), and reports what its samples were made of along with each batch."""
    try:
        from ultralytics.cfg import get_cfg
        from ultralytics.data.build import build_dataloader, build_yolo_dataset
        from ultralytics.utils.torch_utils import init_seeds
    except ImportError:
        return None
    init_seeds(seed)
    cfg = get_cfg(overrides={"imgsz": imgsz, "batch": batch, "workers": workers, "seed": seed})
    data = {
        "path": str(folder),
        "train": str(folder / "images" / "train"),
        "val": str(folder / "images" / "train"),
        "names": names,
        "nc": len(names),
        "channels": 3,
    }
    dataset = build_yolo_dataset(cfg, data["train"], batch, data, mode="train", stride=32)
    stats = Stats(len(dataset))
    with ultralytics_samples(dataset) as records:
        cpu_count = os.cpu_count
        os.cpu_count = lambda: max(cpu_count() or 1, workers)  # Ultralytics caps workers at the CPU count
        try:
            loader = build_dataloader(dataset, batch, workers=workers, shuffle=True, rank=-1)
        finally:
            os.cpu_count = cpu_count
        collate = loader.collate_fn

        def collate_with_samples(items: list[Any]) -> dict[str, Any]:  # runs where the samples were made
            out = collate(items)
            out["_samples"] = records[-len(items) :]
            records.clear()
            return out

        loader.collate_fn = collate_with_samples
        for _ in range(epochs):
            stats.epoch_counts.append(Counter())
            for b in loader:
                stats.add_batch(b, b.pop("_samples"))
    return stats


# -- the table -----------------------------------------------------------------------------------------------------
def print_table(columns: dict[str, dict[str, str]]) -> None:
    names = list(columns)
    rows = list(next(iter(columns.values())))
    left = max(len(r) for r in rows)
    widths = [max(len(n), *(len(columns[n][r]) for r in rows)) for n in names]
    print(f"{'':{left}}  " + "  ".join(f"{n:>{w}}" for n, w in zip(names, widths)))
    for r in rows:
        print(f"{r:{left}}  " + "  ".join(f"{columns[n][r]:>{w}}" for n, w in zip(names, widths)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(DEFAULT_DATA), help="dataset yaml (its train split is used)")
    p.add_argument("--imgsz", type=int, nargs="+", default=[640, 320])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cache",
        choices=["", "ram", "disk"],
        default="",
        help="detrain's cache (ram: load-size pixels, resampled twice as Ultralytics does)",
    )
    p.add_argument(
        "--ultralytics-workers",
        type=int,
        default=0,
        help="Ultralytics' loader workers, each with its own mosaic buffer (its trainer's default: 8)",
    )
    args = p.parse_args()

    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="parity_augment_") as tmp:
        os.environ.setdefault("YOLO_CONFIG_DIR", str(Path(tmp) / "yolo_config"))
        os.environ.setdefault("YOLO_OFFLINE", "1")
        os.environ.setdefault("YOLO_VERBOSE", "False")
        folder = Path(tmp) / "data"
        data_yaml, names = mirror_dataset(args.data, folder)
        columns: dict[str, dict[str, str]] = {}
        reference: list[str] = []
        for imgsz in args.imgsz:
            random.seed(args.seed)
            np.random.seed(args.seed)
            ours = run_detrain(data_yaml, imgsz, args.batch, args.epochs, args.seed, args.cache)
            columns[f"detrain {imgsz}" + (f" cache={args.cache}" if args.cache else "")] = ours.rows()
            workers = args.ultralytics_workers
            theirs = run_ultralytics(folder, names, imgsz, args.batch, args.epochs, args.seed, workers)
            if theirs is not None:
                columns[f"ultralytics {imgsz}" + (f" w{workers}" if workers else "")] = theirs.rows()
            p50, mean = validation_detail(data_yaml, imgsz, args.batch)
            reference.append(f"{imgsz}: {p50:.0f} {mean:.0f}")
    theirs_shown = any(c.startswith("ultralytics") for c in columns)
    print(
        f"\n{args.data}: train split, batch {args.batch}, {args.epochs} epoch(s), seed {args.seed}, default "
        f"augmentation, "
        + (
            f"workers: detrain 0, Ultralytics {args.ultralytics_workers}"
            if theirs_shown
            else "0 workers (Ultralytics not importable: detrain only)"
        )
    )
    print_table(columns)
    print(
        "validation images (not augmented; the same pixels in both), sharpness of non-flat pixels p50 mean: "
        + ", ".join(reference)
    )


if __name__ == "__main__":
    main()
