"""Training's pictures: ``train_batch*.jpg`` (the augmented images a step sees, with their boxes), ``results.png``
(the curves of ``results.csv``) and ``labels.jpg`` (the training labels: how many of each class, where the boxes lie
and their sizes). A picture that cannot be drawn is reported, never fatal."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch

from detrain.log import atomic_write_bytes, console
from detrain.plots.palette import class_color

LABEL_BOXES_DRAWN = 1000  # labels.jpg lays at most this many box outlines on one another, as Ultralytics does


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


def plot_labels(records: Sequence[Any], names: Mapping[int, str], path: Path) -> None:
    """``labels.jpg``, as Ultralytics draws it, of ``records`` (the split's ``LabelRecord``: ``cls``, normalised
    ``bboxes_xywhn``): the instances of each class (bars), up to 1000 boxes' outlines laid over one another at the
    centre (their shapes), and 2-D histograms of the box centres (x, y) and of their sizes (width, height), all as
    fractions of the image.

    >>> from detrain.data.labels.record import LabelRecord
    >>> r = LabelRecord("a.jpg", (64, 64), np.array([0, 1, 1]), np.array([[.5, .5, .2, .3]] * 3, np.float32))
    >>> plot_labels([r], {0: "cat", 1: "dog"}, Path("labels.jpg"))
    >>> Path("labels.jpg").stat().st_size > 0
    True
    """
    try:
        _draw_labels(records, names, path)
    except Exception as e:  # noqa: BLE001 - a picture must never cost a run
        console.print(f"{path.name} not written: {type(e).__name__}: {e}")


def _draw_labels(records: Sequence[Any], names: Mapping[int, str], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cls = np.concatenate([np.asarray(r.cls, np.int64).reshape(-1) for r in records] or [np.zeros(0, np.int64)])
    boxes = np.concatenate(
        [np.asarray(r.bboxes_xywhn, np.float64).reshape(-1, 4) for r in records] or [np.zeros((0, 4))]
    )
    nc = max(len(names), int(cls.max()) + 1 if len(cls) else 0)
    rgb = [tuple(c / 255 for c in class_color(k)[::-1]) for k in range(nc)]  # BGR -> RGB in 0-1
    fig = Figure(figsize=(8, 8))
    FigureCanvasAgg(fig)
    (bars, shapes), (centres, sizes) = fig.subplots(2, 2)
    bars.bar(np.arange(nc), np.bincount(cls, minlength=nc), color=rgb)
    bars.set_ylabel("instances")
    if nc <= 30:
        bars.set_xticks(np.arange(nc), [str(names.get(k, k)) for k in range(nc)], rotation=90, fontsize=8)
    else:
        bars.set_xlabel("class")
    canvas = np.full((500, 500, 3), 255, np.uint8)  # box shapes centred on one 500 px square (RGB)
    for (w, h), k in zip(boxes[:LABEL_BOXES_DRAWN, 2:] * 500, cls[:LABEL_BOXES_DRAWN].tolist()):
        color = tuple(int(v) for v in class_color(k)[::-1])
        cv2.rectangle(canvas, (int(250 - w / 2), int(250 - h / 2)), (int(250 + w / 2), int(250 + h / 2)), color, 1)
    shapes.imshow(canvas)
    shapes.axis("off")
    shapes.set_title(f"box shapes ({min(len(boxes), LABEL_BOXES_DRAWN)} of {len(boxes)})", fontsize=9)
    for ax, (i, j), (x_label, y_label) in ((centres, (0, 1), ("x", "y")), (sizes, (2, 3), ("width", "height"))):
        ax.hist2d(boxes[:, i], boxes[:, j], bins=50, range=[[0, 1], [0, 1]], cmap="Blues", cmin=1)
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
    centres.invert_yaxis()  # image coordinates: y down
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=100, format="png")
    image = cv2.imdecode(np.frombuffer(buf.getvalue(), np.uint8), cv2.IMREAD_COLOR)
    ok, encoded = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 90]) if image is not None else (False, None)
    if not ok or encoded is None:
        raise OSError(f"cannot encode {path}")
    atomic_write_bytes(path, encoded.tobytes())  # whole, and never through a planted link
