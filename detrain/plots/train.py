"""Training's pictures: ``train_batch*.jpg`` (the augmented images a step sees, with their boxes) and
``results.png`` (the curves of ``results.csv``). A picture that cannot be drawn is reported, never fatal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from detrain.log import console


def plot_train_batch(batch: dict[str, Any], names: dict[int, str], path: Path) -> None:
    """The augmented images a step sees (mosaic and all), with their boxes: a check of the pipeline."""
    from detrain.nn.boxes import xywh2xyxy
    from detrain.plots.val import plot_images

    imgs = batch["img"].contiguous().cpu().numpy()  # on the device with augment_device=gpu
    h, w = imgs.shape[2:]
    scale = torch.tensor([w, h, w, h], dtype=torch.float32)
    boxes = []
    for j in range(len(imgs)):
        keep = batch["batch_idx"] == j
        boxes.append(
            (xywh2xyxy(batch["bboxes"][keep].float() * scale).numpy(), batch["cls"][keep].view(-1).long().numpy(), None)
        )
    try:
        plot_images(imgs, boxes, names, path, batch["im_file"])
    except Exception as e:  # noqa: BLE001 - a picture must never cost a run
        console.print(f"{path.name} not written: {e}")


def plot_results(save_dir: Path) -> None:
    """``results.png`` from ``results.csv``."""
    try:
        from detrain.plots.val import plot_results_csv

        plot_results_csv(save_dir / "results.csv")
    except Exception as e:  # noqa: BLE001 - a plot must never cost a finished run
        console.print(f"results.png not written: {e}")
