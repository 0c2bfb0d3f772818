"""Validation: every rank scores its own shard, per-image statistics are gathered, the COCO-exact metrics
are computed once on rank 0 and broadcast, so every rank agrees on them.

>>> metrics = validate(model, loader, data, cfg, torch.device("cpu"))  # doctest: +SKIP
>>> metrics["map"], metrics["map50"]                                    # doctest: +SKIP
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from detrain import dist
from detrain.boxes import scale_boxes_to_original, xywh2xyxy
from detrain.config import Cfg
from detrain.log import atomic_write_text, console
from detrain.metrics import ConfusionMatrix, coco_summary, match_image
from detrain.ops import non_max_suppression

VAL_CONF = 0.001


def image_ids(im_files: list[str]) -> dict[str, int]:
    """COCO image ids: the files' numbers when every stem is a distinct number (000000000036.jpg -> 36),
    else the position in the split (stable, and the same on every rank).

    >>> image_ids(["a/000000000036.jpg", "a/000000000042.jpg"])
    {'a/000000000036.jpg': 36, 'a/000000000042.jpg': 42}
    """
    stems = [Path(f).stem for f in im_files]
    if all(s.isdigit() for s in stems) and len({int(s) for s in stems}) == len(stems):
        return {f: int(s) for f, s in zip(im_files, stems)}
    return {f: i for i, f in enumerate(im_files)}


@torch.no_grad()
def predict_batch(model: nn.Module, imgs_uint8: torch.Tensor, device: torch.device, conf: float, iou: float,
                  max_det: int) -> list[torch.Tensor]:
    """Detections (n, 6: x1 y1 x2 y2 score cls) per image in the input's pixels, NMS on the device."""
    imgs = imgs_uint8.to(device, non_blocking=True).float().div_(255)
    if device.type in ("cpu", "cuda"):
        imgs = imgs.contiguous(memory_format=torch.channels_last)
    preds = model(imgs)
    if isinstance(preds, (tuple, list)):
        preds = preds[0]
    return non_max_suppression(preds, conf_thres=conf, iou_thres=iou, max_det=max_det)


def _labels_to_original(batch: dict[str, Any], si: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ground-truth boxes of image ``si`` mapped from the letterboxed input back to the file's pixels."""
    keep = batch["batch_idx"] == si
    cls = batch["cls"][keep].view(-1)
    h, w = batch["img"].shape[2:]
    boxes = xywh2xyxy(batch["bboxes"][keep].float() * torch.tensor([w, h, w, h], dtype=torch.float32))
    (gain, _), pad = batch["ratio_pad"][si]
    return scale_boxes_to_original(boxes, float(gain), tuple(pad), tuple(batch["ori_shape"][si])), cls


def validate(model: nn.Module, loader: torch.utils.data.DataLoader, data: Any, cfg: Cfg, device: torch.device,
             save_dir: Path | None = None, plots: bool = False, verbose: bool = True) -> dict[str, Any]:
    """COCO-exact metrics of ``model`` on ``loader``'s split (the same dict on every rank)."""
    was_training = model.training
    model.eval()
    conf = VAL_CONF if cfg.conf is None else cfg.conf
    nc = data.nc
    stats, rows = [], []
    confusion = ConfusionMatrix(nc)
    ids = image_ids([r.im_file for r in loader.dataset.records])
    plotted: list[tuple[np.ndarray, torch.Tensor, dict[str, Any]]] = []
    for batch in loader:
        dets = predict_batch(model, batch["img"], device, conf, cfg.iou, cfg.max_det)
        for si, det in enumerate(dets):
            det = det.float().cpu()
            im_file = batch["im_file"][si]
            image_id = ids[im_file]
            (gain, _), pad = batch["ratio_pad"][si]
            scale_boxes_to_original(det[:, :4], float(gain), tuple(pad), tuple(batch["ori_shape"][si]))
            gt_xyxy, gt_cls = _labels_to_original(batch, si)
            stats.append(match_image(det[:, :4].numpy(), det[:, 4].numpy(), det[:, 5].numpy().astype(np.int64),
                                     gt_xyxy.numpy(), gt_cls.numpy().astype(np.int64), image_id=image_id))
            confusion.update(det.numpy(), gt_xyxy.numpy(), gt_cls.numpy().astype(np.int64))
            if cfg.save_json:
                rows += _coco_rows(det, image_id)
            if plots and len(plotted) < 3 and si == 0:
                plotted.append((batch["img"][si].numpy(), det.clone(), {"im_file": im_file}))
    if was_training:
        model.train()
    gathered = dist.all_gather_object((stats, confusion.matrix, rows))
    metrics: dict[str, Any] | None = None
    if dist.is_main():
        all_stats = [s for part in gathered for s in part[0]]
        summary = coco_summary(all_stats, nc)  # orders images by id itself, as the reference does
        metrics = {**summary.as_dict(), "per_class": summary.per_class, "conf": summary.conf,
                   "n_images": len(all_stats)}
        matrix = sum(part[1] for part in gathered)
        if save_dir is not None:
            _write_outputs(save_dir, metrics, [r for part in gathered for r in part[2]], cfg, data, summary,
                           matrix, plots)
        if verbose:
            print_table(metrics, data.names, len(all_stats))
    return dist.broadcast_object(metrics)


def _coco_rows(det: torch.Tensor, image_id: int) -> list[dict[str, Any]]:
    rows = []
    for x1, y1, x2, y2, score, cls in det.tolist():
        rows.append({"image_id": image_id, "category_id": int(cls) + 1,
                     "bbox": [round(x1, 3), round(y1, 3), round(x2 - x1, 3), round(y2 - y1, 3)],
                     "score": round(score, 5)})
    return rows


def _write_outputs(save_dir: Path, metrics: dict[str, Any], rows: list[dict[str, Any]], cfg: Cfg, data: Any,
                   summary: Any, matrix: np.ndarray, plots: bool) -> None:
    save_dir.mkdir(parents=True, exist_ok=True)
    plain = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}
    plain["per_class"] = {data.names.get(int(c), str(c)): v for c, v in metrics.get("per_class", {}).items()}
    atomic_write_text(save_dir / "metrics.json", json.dumps(plain, indent=2, default=float))
    if cfg.save_json:
        atomic_write_text(save_dir / "predictions.json", json.dumps(rows))
    if plots:
        try:
            from detrain import plots_val

            plots_val.plot_all(save_dir, summary, matrix, data.names)
        except Exception as e:  # never lose the metrics for a plot
            console.print(f"plots not written: {e}")


def print_table(metrics: dict[str, Any], names: dict[int, str], n_images: int) -> None:
    """Per-class table: images, instances, P, R, mAP50, mAP50-95 (COCO-exact)."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col in ("class", "images", "instances", "P", "R", "mAP50", "mAP50-95"):
        table.add_column(col, justify="left" if col == "class" else "right")
    per_class = metrics.get("per_class", {})
    total = sum(int(v.get("n_gt", 0)) for v in per_class.values())
    table.add_row("all", str(n_images), str(total), f"{metrics['precision']:.3f}", f"{metrics['recall']:.3f}",
                  f"{metrics['map50']:.3f}", f"{metrics['map']:.3f}")
    for c, v in sorted(per_class.items()):
        table.add_row(names.get(int(c), str(c)), str(v.get("n_images", "")), str(v.get("n_gt", "")),
                      f"{v['p']:.3f}", f"{v['r']:.3f}", f"{v['ap50']:.3f}", f"{v['ap']:.3f}")
    console.print(table)
    console.print(f"COCO mAP50-95 {metrics['map']:.4f}  mAP50 {metrics['map50']:.4f}  mAP75 {metrics['map75']:.4f}  "
                  f"AP small/medium/large {metrics['map_small']:.3f}/{metrics['map_medium']:.3f}/"
                  f"{metrics['map_large']:.3f}  AR@100 {metrics['ar100']:.4f}")
