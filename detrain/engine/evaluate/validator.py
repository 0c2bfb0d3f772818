"""Validation: every rank scores its own shard, per-image statistics are gathered, the COCO-exact metrics
are computed once on rank 0 and broadcast, so every rank agrees on them.

Detections are scored exactly as ``predictions.json`` holds them (boxes ``[x, y, w, h]`` rounded to 3
decimals in the original image's pixels, scores to 5), against the split's ground truth from
:mod:`detrain.data.labels.ground_truth`; so scoring that file with ``detrain val predictions=...`` (or pycocotools,
for a COCO json dataset) gives the same numbers, and so does any number of ranks.

Usage: ``metrics = validate(model, loader, data, cfg, torch.device("cpu"), World())``, then ``metrics["map"]``,
``metrics["map50"]`` (:func:`detrain.engine.evaluate.val_worker.run_val` builds the arguments from a ``Cfg``).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from detrain.config.cfg import Cfg
from detrain.data.labels.ground_truth import ImageGT, SplitGT, image_ids, ltwh2xyxy, split_ground_truth
from detrain.distributed import dist
from detrain.distributed.world import World
from detrain.engine.evaluate.val_outputs import LastValidation, ValOutputs, print_table
from detrain.engine.evaluate.val_speed import STAGES, ValSpeed
from detrain.engine.tta import augmented_forward, tta_problem
from detrain.errors import DatasetError
from detrain.log import atomic_write_text, console
from detrain.metrics import ConfusionMatrix, ImageStats, coco_summary, match_image_coco
from detrain.metrics.coco_json import coco_rounded
from detrain.metrics.det_metrics import curves_of
from detrain.nn.boxes import scale_boxes_to_original, xywh2xyxy
from detrain.nn.head import InferenceOptions, detections, set_inference

__all__ = ["VAL_CONF", "Scorer", "finish", "image_ids", "predict_batch", "print_table", "validate"]

VAL_CONF = 0.001
PLOT_BATCHES = 3  # val_batch{0,1,2}_{labels,pred}.jpg
PLOT_CONF = 0.25  # detections drawn on the batch images


@torch.no_grad()
def predict_batch(
    model: nn.Module,
    imgs_uint8: torch.Tensor,
    device: torch.device,
    conf: float,
    iou: float,
    max_det: int,
    multi_label: bool = False,
    classes: list[int] | None = None,
    agnostic: bool = False,
    amp_dtype: torch.dtype | None = None,
    speed: ValSpeed | None = None,
    augment: bool = False,
) -> list[torch.Tensor]:
    """Detections (n, 6: x1 y1 x2 y2 score cls) per image in the input's pixels, by the model's own postprocess
    (NMS, or an end-to-end head's top-k) on the device.

    ``multi_label`` keeps every (box, class) pair above ``conf``, as validation does (YOLOv8's val too);
    ``classes`` keeps only those classes (before NMS), ``agnostic`` runs NMS across classes; ``amp_dtype`` runs
    the forward (only) under autocast in that dtype, the postprocess in float32; ``speed`` times each stage;
    ``augment``: the forward at three scales and a flip (:mod:`detrain.engine.tta`), merged by the one NMS."""

    def stage(name: str, images: int = 0) -> contextlib.AbstractContextManager[None]:
        return speed.stage(name, images) if speed is not None else contextlib.nullcontext()

    with stage("preprocess", images=len(imgs_uint8)):
        imgs = imgs_uint8.to(device, non_blocking=True).float().div_(255)
        if device.type in ("cpu", "cuda"):
            imgs = imgs.contiguous(memory_format=torch.channels_last)
    with stage("inference"):
        with torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext():
            preds = augmented_forward(model, imgs) if augment else model(imgs)
        if isinstance(preds, (tuple, list)):
            preds = preds[0]
        if amp_dtype is not None:
            preds = preds.float()
    options = InferenceOptions(
        conf=conf, iou=iou, max_det=max_det, classes=classes, agnostic=agnostic, multi_label=multi_label
    )
    with stage("postprocess"):
        return detections(model, preds, options)


def coco_detections(det: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n, 6) corner detections in original pixels -> (ltwh rounded to 3 decimals, scores rounded to 5, classes),
    the values ``predictions.json`` holds (:func:`detrain.metrics.coco_json.coco_rounded`).

    >>> ltwh, s, c = coco_detections(np.array([[1.00004, 2, 11, 22, 0.9123456, 3]], np.float32))
    >>> ltwh.tolist(), s.tolist(), c.tolist()
    ([[1.0, 2.0, 10.0, 20.0]], [0.91235], [3])
    """
    if hasattr(det, "detach"):
        det = det.detach().cpu().numpy()
    d = np.asarray(det).reshape(-1, 6).astype(np.float64)
    return (*coco_rounded(d[:, :4], d[:, 4]), d[:, 5].astype(np.int64))


@dataclass
class Scorer:
    """One rank's share of an evaluation: per-image statistics, confusion counts and (optionally) detections.

    With ``classes`` only detections of those classes count (``classes=``: the ground truth holds only them)."""

    nc: int
    keep_detections: bool = False
    classes: tuple[int, ...] | None = None
    stats: list[ImageStats] = field(default_factory=list)
    confusion: ConfusionMatrix = field(init=False)
    detections: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.confusion = ConfusionMatrix(self.nc)

    def add(self, g: ImageGT, ltwh: np.ndarray, scores: np.ndarray, cls: np.ndarray) -> None:
        """Score one image's detections (COCO boxes in original pixels) against its ground truth."""
        if self.classes is not None:
            keep = np.isin(cls, self.classes)
            ltwh, scores, cls = ltwh[keep], scores[keep], cls[keep]
        self.stats.append(
            match_image_coco(
                ltwh, scores, cls, g.boxes_ltwh, g.cls, g.area, g.crowd, image_id=g.image_id, gt_ids=g.ann_ids
            )
        )
        xyxy = ltwh2xyxy(ltwh)
        regular = ~g.crowd
        self.confusion.update(
            np.concatenate((xyxy, scores[:, None], cls[:, None]), 1), g.boxes_xyxy()[regular], g.cls[regular]
        )
        if self.keep_detections:
            self.detections.append((g.image_id, ltwh, scores, cls))

    def part(self) -> tuple[list[ImageStats], np.ndarray, list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]]:
        """What this rank sends to rank 0."""
        return self.stats, self.confusion.matrix, self.detections


def validate(
    model: nn.Module,
    loader: torch.utils.data.DataLoader,
    data: Any,
    cfg: Cfg,
    device: torch.device,
    world: World,
    save_dir: Path | None = None,
    plots: bool = False,
    verbose: bool = True,
    amp_dtype: torch.dtype | None = None,
    keep: LastValidation | None = None,
) -> dict[str, Any]:
    """COCO-exact metrics of ``model`` on ``loader``'s split (the same dict on every rank of ``world``).

    ``data``: the split's ``SplitData``. With ``save_dir`` rank 0 writes metrics.json (predictions.json when
    ``cfg.predict.save_json``) and with ``plots`` the curves, confusion matrices and first batches drawn; with
    ``keep`` (training) it hands them and the table to it instead, changing no number. ``amp_dtype``: the forward
    under autocast in that dtype (training-time validation on CUDA), else float32."""
    was_training = model.training
    model.eval()
    conf = VAL_CONF if cfg.predict.conf is None else cfg.predict.conf
    gt = split_ground_truth(data)
    single, classes, agnostic = _class_options(cfg)
    set_inference(model, cfg.predict.max_det, agnostic, cfg.predict.nms)
    scorer = _scorer(data.nc, cfg, save_dir, classes)
    drawn: list[dict[str, Any]] = []
    draw = plots and (save_dir is not None or keep is not None) and world.is_main
    speed = ValSpeed(device)
    augment = cfg.predict.augment and _can_augment(model, world.is_main)
    try:
        for bi, batch in enumerate(loader):
            dets = predict_batch(
                model,
                batch["img"],
                device,
                conf,
                cfg.predict.iou,
                cfg.predict.max_det,
                multi_label=True,
                classes=classes,
                agnostic=agnostic,
                amp_dtype=amp_dtype,
                speed=speed,
                augment=augment,
            )
            if single:
                for det in dets:
                    det[:, 5] = 0
            if draw and bi < PLOT_BATCHES:
                drawn.append(_for_plot(batch, dets))
            _score_batch(scorer, gt, batch, dets)
    finally:
        if was_training:
            model.train()
    gathered = dist.all_gather_object(scorer.part())  # collective: every rank's scores, on every rank
    ms = speed.per_image_ms()  # rank 0's speed is the one reported
    metrics = finish(gathered, data, gt, cfg, save_dir, plots, verbose, drawn, ms, keep) if world.is_main else None
    return dist.broadcast_object(metrics)  # collective: rank 0's metrics on every rank


def _scorer(nc: int, cfg: Cfg, save_dir: Path | None, classes: list[int] | None) -> Scorer:
    """This rank's scorer of ``nc`` classes: it keeps the detections where predictions.json is written, and scores
    only the ``classes`` kept (``classes=``; None: all)."""
    return Scorer(
        nc,
        keep_detections=bool(cfg.predict.save_json) and save_dir is not None,
        classes=None if classes is None else tuple(classes),
    )


def _can_augment(model: nn.Module, is_main: bool) -> bool:
    """Whether ``augment=True`` runs augmented on ``model``; where it cannot, rank 0 says why in one line."""
    problem = tta_problem(model)
    if problem is not None and is_main:
        console.print(f"note: augment=True: {problem}; validating at one scale", markup=False, highlight=False)
    return problem is None


def _class_options(cfg: Cfg) -> tuple[bool, list[int] | None, bool]:
    """(single_cls, the classes kept or None for all, class-agnostic NMS). With single_cls every detection is the
    one class 'item', and NMS runs across classes, as the merged class is one."""
    single = cfg.inputs.single_cls
    classes = None if single or not cfg.inputs.classes else list(cfg.inputs.classes)
    return single, classes, single or cfg.predict.agnostic_nms


def _score_batch(scorer: Scorer, gt: Any, batch: dict[str, Any], dets: list[torch.Tensor]) -> None:
    """Each image's detections, scaled back to its original pixels, scored against its ground truth."""
    for si, det in enumerate(dets):
        det = det.float().cpu()
        (gain_y, gain_x), pad = batch["ratio_pad"][si]
        scale_boxes_to_original(det[:, :4], (float(gain_x), float(gain_y)), tuple(pad), tuple(batch["ori_shape"][si]))
        scorer.add(_image_gt(gt, batch["im_file"][si]), *coco_detections(det))


def finish(
    gathered: list[tuple[Any, Any, Any]],
    data: Any,
    gt: SplitGT,
    cfg: Cfg,
    save_dir: Path | None,
    plots: bool,
    verbose: bool,
    drawn: list[dict[str, Any]] | None = None,
    speed: dict[str, float] | None = None,
    keep: LastValidation | None = None,
    predictions_file: str | None = None,
) -> dict[str, Any]:
    """Rank 0: the metrics of all ranks' :meth:`Scorer.part`, written to ``save_dir`` and printed; with ``keep``
    the table and pictures are handed to it (:class:`~detrain.engine.evaluate.val_outputs.ValOutputs`), not printed.

    Besides the numbers metrics.json holds, the dict carries ``names`` (the split's classes), ``speed`` (rank
    0's milliseconds per image per stage, :class:`~detrain.engine.evaluate.val_speed.ValSpeed`; zeros when no model
    ran), ``confusion`` (the (nc + 1, nc + 1) counts, summed over the ranks) and ``curves``
    (:func:`~detrain.metrics.det_metrics.curves_of`), which :class:`detrain.metrics.det_metrics.DetectionMetrics`
    reads; metrics.json holds neither of the last two."""
    all_stats = [s for part in gathered for s in part[0]]
    summary = coco_summary(all_stats, data.nc)  # orders images by id itself, as the reference does
    n_images = len({s.image_id for s in all_stats})
    metrics: dict[str, Any] = {
        **summary.as_dict(),
        "per_class": summary.per_class,
        "conf": summary.conf,
        "n_images": n_images,
        "images_per_rank": [len(part[0]) for part in gathered],
        "ground_truth": gt.source,
        "names": dict(data.names),
        "speed": dict(speed) if speed is not None else dict.fromkeys(STAGES, 0.0),
    }
    if predictions_file:
        metrics["predictions"] = str(predictions_file)
    matrix = np.sum([np.asarray(part[1]) for part in gathered], axis=0)
    outputs = ValOutputs(summary, matrix, dict(data.names), metrics, drawn or [])
    if save_dir is not None:
        save_dir = Path(save_dir)
        save_dir.mkdir(parents=True, exist_ok=True)
        _write_metrics(save_dir / "metrics.json", metrics, data.names)
        if cfg.predict.save_json and not predictions_file:
            dets = sorted((d for part in gathered for d in part[2]), key=lambda d: d[0])
            atomic_write_text(save_dir / "predictions.json", _results_json(dets, gt.category_ids))
        if plots:
            outputs.plot(save_dir)
    if keep is not None:
        keep.keep(outputs)
    elif verbose:
        outputs.print_table()
    metrics["confusion"], metrics["curves"] = matrix, curves_of(summary)  # not in metrics.json
    return metrics


def _image_gt(gt: SplitGT, im_file: str) -> ImageGT:
    try:
        return gt.images[im_file]
    except KeyError:
        raise DatasetError(f"{im_file} is not an image of the split being validated") from None


def _results_json(dets: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]], category_ids: np.ndarray) -> str:
    """COCO results file text, one detection per line, in image-id order (file order within an image)."""
    lines = []
    cats = category_ids.tolist()
    for image_id, ltwh, scores, cls in dets:
        for box, score, c in zip(ltwh.tolist(), scores.tolist(), cls.tolist()):
            lines.append(json.dumps({"image_id": image_id, "category_id": cats[c], "bbox": box, "score": score}))
    return "[\n" + ",\n".join(lines) + "\n]\n" if lines else "[]\n"


def _write_metrics(path: Path, metrics: dict[str, Any], names: dict[int, str]) -> None:
    plain: dict[str, Any] = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, list))}
    plain["per_class"] = {names.get(int(c), str(c)): v for c, v in metrics.get("per_class", {}).items()}
    atomic_write_text(path, json.dumps(plain, indent=2, default=float))


def _for_plot(batch: dict[str, Any], dets: list[torch.Tensor]) -> dict[str, Any]:
    """What the batch pictures need, in the letterboxed input's pixels (at most 16 images)."""
    n = min(len(dets), 16)
    h, w = batch["img"].shape[2:]
    keep = batch["batch_idx"] < n
    boxes = xywh2xyxy(batch["bboxes"][keep].float() * torch.tensor([w, h, w, h], dtype=torch.float32))
    preds = [d[d[:, 4] >= PLOT_CONF].float().cpu().numpy() for d in dets[:n]]
    return {
        "img": batch["img"][:n].numpy(),
        "batch_idx": batch["batch_idx"][keep].numpy(),
        "cls": batch["cls"][keep].view(-1).numpy().astype(np.int64),
        "boxes": boxes.numpy(),
        "preds": preds,
        "im_file": list(batch["im_file"][:n]),
    }
