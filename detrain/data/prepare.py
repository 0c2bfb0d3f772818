"""From a dataset yaml to verified records and loaders, for one split, on one rank.

Work that writes files (generating the synthetic set, downloading, building the label cache) is done by
the first process of each node while the others wait at a named barrier, then they read what it wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import DataLoader

from detrain.config.cfg import Cfg
from detrain.config.keys import MAX_PIXELS, PREPARE_TIMEOUT_S
from detrain.config.values import ImageSize, image_hw
from detrain.data.dataset import DetectionDataset
from detrain.data.dataset_yaml import DatasetInfo, load_dataset_yaml
from detrain.data.download import DownloadLimits
from detrain.data.labels.class_filter import ClassFilter
from detrain.data.labels.ground_truth import explicit_json, json_labels, json_split_gt
from detrain.data.labels.reasons import drop_split_notes, no_labels_message, no_usable_detail, reason_lines
from detrain.data.labels.record import LabelReport
from detrain.data.labels.verify import LabelRecord, img2label_path, load_labels
from detrain.data.loader import build_dataloader
from detrain.distributed import dist
from detrain.distributed.launch.devices import loader_workers
from detrain.distributed.world import World
from detrain.errors import DatasetError

_SHOWN: set[str] = set()  # the dataset notes already shown by this process


@dataclass
class SplitData:
    """One split of a dataset with its verified labels (only those ``class_filter`` keeps) and the report of their
    verification (every file skipped or corrected, with its reason: :mod:`detrain.data.labels.report_file` writes it
    into the run folder)."""

    info: DatasetInfo
    split: str
    records: list[LabelRecord]
    # evaluation ground truth, built once by detrain.data.labels.ground_truth.split_ground_truth
    ground_truth: Any = field(default=None, repr=False, compare=False)
    class_filter: ClassFilter = field(default_factory=ClassFilter)
    report: LabelReport = field(default_factory=LabelReport, repr=False, compare=False)

    @property
    def nc(self) -> int:
        return len(self.names)

    @property
    def names(self) -> dict[int, str]:
        return self.class_filter.names(self.info.names)


def load_split(data: str, split: str, cfg: Cfg | None = None, verbose: bool = True) -> SplitData:
    """Resolve ``data`` and verify the labels of ``split`` (train, val or test). With ``verbose``, the main process
    shows the split's summary, the count of each reason files were skipped or corrected for and the first few files
    with theirs, and a warning when no image has labels; a split left without images is a DatasetError naming the
    most common reasons and the first file."""
    first = dist.local_rank() == 0
    # a download or the labels of a large dataset can take far longer than a training step may
    wait_s = cfg.distributed.prepare_timeout if cfg is not None else PREPARE_TIMEOUT_S
    if not first:
        dist.barrier(f"dataset {data} ({split}) prepared by the first process of this node", wait_s)
    try:
        info = load_dataset_yaml(data, limits=_download_limits(cfg))
        selection = ClassFilter.from_cfg(cfg)
        selection.check(info.names, info.yaml_file)
        files = getattr(info, split)
        if not files:
            raise DatasetError(f"{info.yaml_file}: the dataset has no '{split}' split")
        max_pixels = cfg.inputs.max_pixels if cfg is not None else MAX_PIXELS
        records, report = load_labels(
            list(files),
            info.nc,
            cache=True,
            progress=verbose and dist.is_main(),
            max_pixels=max_pixels,
            root=info.root,  # the cache stays in the dataset: a line of an image list never places it
        )
    finally:
        if first:
            dist.barrier(f"dataset {data} ({split}) prepared by the first process of this node", wait_s)
    ground_truth, summary = None, report.summary()
    json_file = explicit_json(info, split)
    if json_file is not None:  # the split is a COCO json: its annotations are the labels
        ground_truth = json_split_gt(json_file, records, info.names)
        records, summary = json_labels(records, ground_truth, json_file)
        ground_truth = selection.ground_truth(ground_truth)
        drop_split_notes(report)  # no label file is looked for
        if report.corrupt:
            summary += f"; {report.corrupt} corrupt images left out"
    if verbose and dist.is_main():
        _show(info, split, summary, report, None if json_file else list(files))
    if not records:
        raise DatasetError(f"{info.yaml_file}: no usable images in the '{split}' split: {no_usable_detail(report)}")
    if cfg is not None and split == "train" and cfg.inputs.fraction < 1.0:
        records = records[: max(1, round(len(records) * cfg.inputs.fraction))]
    split_data = SplitData(
        info=info,
        split=split,
        records=selection.records(records),
        ground_truth=ground_truth,
        class_filter=selection,
        report=report,
    )
    if ground_truth is not None and len(records) != len(ground_truth.images):  # a train fraction
        split_data.ground_truth = None
    return split_data


def _download_limits(cfg: Cfg | None) -> DownloadLimits | None:
    """The download keys of ``cfg`` (None: the defaults)."""
    if cfg is None:
        return None
    keys = cfg.inputs
    return DownloadLimits.from_gb(
        keys.download_max_gb, keys.download_max_unpacked_gb, keys.download_max_files, keys.download_anywhere
    )


def _show(info: DatasetInfo, split: str, summary: str, report: LabelReport, img_files: list[str] | None) -> None:
    """The lines of a split on screen: the dataset's note (once per process), the summary, the reasons files were
    skipped or corrected for (a handful of lines), and the warning of a split without labels (``img_files``: the
    split's images when its labels are label files, else None)."""
    from detrain.log import console

    if info.note is not None and info.note not in _SHOWN:  # once per process, not once per split
        _SHOWN.add(info.note)
        console.print(info.note)
    console.print(f"{split}: {summary}")
    # file names and reasons as they are: no markup, no wrapping inside a path
    for line in reason_lines(report, split):
        console.print(line, markup=False, soft_wrap=True)
    if img_files is not None and not report.found:  # the label files' names only when none has boxes
        warning = no_labels_message(report, [img2label_path(f) for f in img_files], split)
        if warning is not None:
            console.print(f"warning: {warning}", markup=False, soft_wrap=True)


def build_train_loader(
    data: SplitData, cfg: Cfg, local_batch: int, world: World, planned_world: int | None = None
) -> DataLoader:
    """Augmented training batches; each rank of ``world`` gets its slice of every global batch (mosaic pools as
    planned for ``planned_world`` ranks); cache=ram is filled by the first process of each node."""
    dataset = DetectionDataset(
        data.records,
        imgsz=cfg.inputs.imgsz,
        augment=True,
        hyp=cfg.augment,
        rect=cfg.train.rect,
        batch_size=local_batch,
        stride=32,
        seed=cfg.train.seed,
        cache=cfg.inputs.cache or None,
        max_pixels=cfg.inputs.max_pixels,
        augment_device=cfg.inputs.augment_device,
        # time= moves the last epochs: the trainer closes mosaic then (time_budget.py)
        close_mosaic_epoch=cfg.train.epochs - cfg.train.close_mosaic
        if cfg.train.close_mosaic and not cfg.train.time
        else None,
        cache_timeout_s=cfg.distributed.prepare_timeout,
        local_rank=world.local_rank,
        launched=world.launched,
    )
    return build_dataloader(
        dataset,
        batch_size=local_batch,
        shuffle=not cfg.train.rect,
        workers=loader_workers(cfg.distributed.workers, world.local_world_size),
        rank=world.dp_rank,  # the data-parallel group's: every rank of it its own images
        world_size=world.dp_size,
        seed=cfg.train.seed,
        planned_world=planned_world,
    )


def build_val_loader(data: SplitData, cfg: Cfg, local_batch: int, world: World, rect: bool = True) -> DataLoader:
    """Rectangular, unaugmented batches over disjoint shards of the data-parallel group of ``world`` (no padded
    duplicates);
    ``rect=False``, or an ``imgsz`` rectangle ``[h, w]``: every image letterboxed to imgsz (h x w, or the square of
    one size), for a model of one fixed input size (an export) or a size the user fixed."""
    fixed = isinstance(cfg.inputs.imgsz, ImageSize)
    workers = loader_workers(cfg.distributed.workers, world.local_world_size)
    dataset = DetectionDataset(
        data.records,
        imgsz=int(cfg.inputs.imgsz),
        augment=False,
        hyp=cfg.augment,
        rect=rect and not fixed,
        fixed_hw=image_hw(cfg.inputs.imgsz),
        batch_size=local_batch,
        stride=32,
        seed=cfg.train.seed,
        cache=None,
        max_pixels=cfg.inputs.max_pixels,
    )
    return build_dataloader(
        dataset,
        batch_size=local_batch,
        shuffle=False,
        workers=min(workers, 2) if world.distributed else workers,
        rank=world.dp_rank,  # the data-parallel group's: every rank of it its own images
        world_size=world.dp_size,
        seed=cfg.train.seed,
    )
