"""Validation plots: PR curves, F1/P/R over confidence, confusion matrix, results.png (PNG), and batches of
images with their boxes drawn (JPEG).

Curves use matplotlib's object API on the Agg canvas (no pyplot, no global backend switch), so they are
safe in worker processes and threads and never open a window; batch images are drawn with OpenCV.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import cv2
import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from detrain.log import atomic_write_bytes
from detrain.metrics import ConfusionMatrix, DetMetrics
from detrain.plots.palette import class_color

Names = Sequence[str] | Mapping[int, str]
_LABELLED_CLASSES = 20  # beyond this many curves a legend hides the plot


def plot_all(
    save_dir: str | Path, metrics: DetMetrics, confusion: ConfusionMatrix | np.ndarray | None, names: Names
) -> list[Path]:
    """Every validation plot into ``save_dir``: PR_curve, F1/P/R_curve, confusion_matrix[_normalized].png.

    ``confusion`` is a :class:`ConfusionMatrix` or its (summed) ``matrix``; None skips those two plots.

    >>> from detrain.metrics import coco_summary
    >>> [p.name for p in plot_all("val", coco_summary([], nc=1), ConfusionMatrix(1).matrix, {0: "cat"})]
    ['PR_curve.png', 'F1_curve.png', 'P_curve.png', 'R_curve.png', 'confusion_matrix.png',
     'confusion_matrix_normalized.png']
    """
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    paths = [plot_pr_curve(metrics, names, save_dir / "PR_curve.png")]
    for which, file in (("f1", "F1_curve.png"), ("p", "P_curve.png"), ("r", "R_curve.png")):
        paths.append(plot_confidence_curve(metrics, names, save_dir / file, which))
    if confusion is not None:
        paths.append(plot_confusion_matrix(confusion, names, save_dir / "confusion_matrix.png", normalize=False))
        paths.append(plot_confusion_matrix(confusion, names, save_dir / "confusion_matrix_normalized.png"))
    return paths


def plot_pr_curve(metrics: DetMetrics, names: Names, path: str | Path) -> Path:
    """COCO precision over recall at IoU 0.5 per class (101 recall points) and their mean.

    >>> from detrain.metrics import coco_summary
    >>> plot_pr_curve(coco_summary([], nc=2), ["person", "car"], "PR_curve.png")
    PosixPath('PR_curve.png')
    """
    fig, ax = _figure()
    x = metrics.recall_grid
    for row, k in enumerate(metrics.curve_classes.tolist()):
        label = f"{_name(names, k)} {metrics.per_class[k]['ap50']:.3f}" if _labelled(metrics) else None
        ax.plot(x, metrics.pr_curve[row], linewidth=1, label=label)
    if len(metrics.curve_classes):
        ax.plot(x, metrics.pr_curve.mean(0), linewidth=3, color="blue", label=f"all classes {metrics.map50:.3f} mAP50")
    _finish(fig, ax, "Recall", "Precision", "Precision-Recall curve (IoU 0.5)")
    return _save(fig, path)


def plot_confidence_curve(metrics: DetMetrics, names: Names, path: str | Path, which: str = "f1") -> Path:
    """F1 (``which="f1"``), precision (``"p"``) or recall (``"r"``) over the confidence threshold.

    The bold line is the mean over classes; the legend gives its best value and where it lies.

    >>> from detrain.metrics import coco_summary
    >>> plot_confidence_curve(coco_summary([], nc=1), ["person"], "F1_curve.png", "f1")
    PosixPath('F1_curve.png')
    """
    curves = {"f1": (metrics.f1_curve, "F1"), "p": (metrics.p_curve, "Precision"), "r": (metrics.r_curve, "Recall")}
    if which not in curves:
        raise ValueError(f"which must be one of {sorted(curves)}, got {which!r}")
    y, label = curves[which]
    fig, ax = _figure()
    x = metrics.conf_grid
    for row, k in enumerate(metrics.curve_classes.tolist()):
        ax.plot(x, y[row], linewidth=1, label=_name(names, k) if _labelled(metrics) else None)
    if len(y):
        mean = y.mean(0)
        # F1: the (smoothed) optimum behind metrics.precision/recall; P: its peak; R: at confidence 0
        best = {"f1": int(np.abs(x - metrics.conf).argmin()), "p": int(mean.argmax()), "r": 0}[which]
        ax.plot(x, mean, linewidth=3, color="blue", label=f"all classes {mean[best]:.2f} at {x[best]:.3f}")
    _finish(fig, ax, "Confidence", label, f"{label}-Confidence curve")
    return _save(fig, path)


def plot_confusion_matrix(
    confusion: ConfusionMatrix | np.ndarray, names: Names, path: str | Path, normalize: bool = True
) -> Path:
    """Heat map of ``matrix[predicted, true]`` with a background row/column; normalised per true class.

    >>> plot_confusion_matrix(ConfusionMatrix(2), ["a", "b"], "confusion_matrix.png")
    PosixPath('confusion_matrix.png')
    """
    counts = confusion.matrix if isinstance(confusion, ConfusionMatrix) else np.asarray(confusion)
    values = counts / np.maximum(counts.sum(0, keepdims=True), 1) if normalize else counts.astype(np.float64)
    n = len(counts)
    labels = [_name(names, k) for k in range(n - 1)] + ["background"]
    size = min(max(6.0, 0.2 * n), 16.0)
    fig = Figure(figsize=(size + 1.5, size))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    shown = np.where(values > 0, values, np.nan)  # empty cells stay white
    image = ax.imshow(shown, cmap="Blues", vmin=0.0, vmax=1.0 if normalize else max(float(values.max()), 1.0))
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    if n <= 101:  # names stay readable up to COCO's 80 classes (+ background) at this figure size
        ticks, font = np.arange(n), 8 if n <= 30 else 5
        ax.set_xticks(ticks, labels, rotation=90, fontsize=font)
        ax.set_yticks(ticks, labels, fontsize=font)
    if n <= 30:  # cell values only where they fit
        for i, j in zip(*np.nonzero(values > 0)):
            text = f"{values[i, j]:.2f}" if normalize else f"{int(counts[i, j])}"
            ax.text(
                j,
                i,
                text,
                ha="center",
                va="center",
                fontsize=7,
                color="white" if values[i, j] > 0.5 * np.nanmax(shown) else "black",
            )
    ax.set_xlabel("True")
    ax.set_ylabel("Predicted")
    ax.set_title("Confusion matrix" + (" (normalised per true class)" if normalize else ""))
    fig.tight_layout()
    return _save(fig, path)


def plot_results_csv(csv_path: str | Path, path: str | Path | None = None) -> Path:
    """results.png beside ``csv_path``: one small panel per column of results.csv against the epoch.

    >>> with open("results.csv", "w", newline="") as f:
    ...     csv.writer(f).writerows([["epoch", "train/box_loss", "metrics/mAP50"], [1, 1.5, 0.1], [2, 1.2, 0.3]])
    >>> plot_results_csv("results.csv")
    PosixPath('results.png')
    """
    csv_path = Path(csv_path)
    with open(csv_path, newline="", encoding="utf-8") as f:
        rows = [{k.strip(): v.strip() for k, v in r.items() if k is not None} for r in csv.DictReader(f)]
    # per-node resource columns (one set per node: hundreds on a large cluster) are left to TensorBoard
    columns = [k for k in (rows[0] if rows else {}) if k != "epoch" and not re.match(r"node\d+/", k)]
    x = [_float(r.get("epoch", i)) for i, r in enumerate(rows)]
    cols = min(5, max(len(columns), 1))
    n_rows = max(math.ceil(len(columns) / cols), 1)
    fig = Figure(figsize=(3.2 * cols, 2.6 * n_rows))
    FigureCanvasAgg(fig)
    for i, name in enumerate(columns):
        ax = fig.add_subplot(n_rows, cols, i + 1)
        y = np.array([_float(r.get(name)) for r in rows])
        ax.plot(x, y, marker=".", linewidth=1.5, markersize=5)
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, csv_path.with_name("results.png") if path is None else path)


def plot_images(
    imgs: np.ndarray,
    boxes: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray | None]],
    names: Names,
    path: str | Path,
    im_files: Sequence[str] | None = None,
    max_size: int = 1920,
) -> Path:
    """A grid of up to 16 images (uint8 (B, 3, H, W) RGB, all one size) with boxes drawn, saved as JPEG.

    ``boxes[i]`` is (corner boxes (n, 4) in the image's pixels, classes (n,), scores (n,) or None for
    ground truth); a box is labelled with its class name, and its score when given. The grid is scaled down
    to at most ``max_size`` pixels a side.

    >>> plot_images(np.zeros((1, 3, 32, 32), np.uint8), [(np.array([[2., 2, 20, 20]]), np.array([0]), None)],
    ...             ["cat"], "val_batch0_labels.jpg")
    PosixPath('val_batch0_labels.jpg')
    """
    imgs = np.asarray(imgs)[:16]
    n, _, h, w = imgs.shape
    cols = max(1, math.ceil(math.sqrt(n)))
    rows = max(1, math.ceil(n / cols))
    scale = min(1.0, max_size / max(cols * w, rows * h))
    th, tw = max(1, round(h * scale)), max(1, round(w * scale))
    canvas = np.full((rows * th, cols * tw, 3), 255, np.uint8)
    thickness = max(1, round(0.003 * max(th, tw) + 0.5))
    font = max(0.3, 0.35 * thickness)
    for i in range(n):
        y0, x0 = (i // cols) * th, (i % cols) * tw
        tile = np.ascontiguousarray(imgs[i].transpose(1, 2, 0)[:, :, ::-1])  # RGB CHW -> BGR HWC for OpenCV
        if scale != 1.0:
            tile = cv2.resize(tile, (tw, th), interpolation=cv2.INTER_AREA)
        xyxy, cls, scores = boxes[i] if i < len(boxes) else (np.zeros((0, 4)), np.zeros(0, np.int64), None)
        _draw_boxes(tile, np.asarray(xyxy, np.float64).reshape(-1, 4) * scale, cls, scores, names, thickness, font)
        cv2.rectangle(tile, (0, 0), (tw - 1, th - 1), (255, 255, 255), max(1, thickness // 2))
        if im_files is not None and i < len(im_files):
            cv2.putText(
                tile,
                Path(im_files[i]).name[:40],
                (3, th - 4),
                cv2.FONT_HERSHEY_SIMPLEX,
                font,
                (220, 220, 220),
                1,
                cv2.LINE_AA,
            )
        canvas[y0 : y0 + th, x0 : x0 + tw] = tile
    path = Path(path)
    ok, encoded = cv2.imencode(path.suffix or ".jpg", canvas, [cv2.IMWRITE_JPEG_QUALITY, 90])
    if not ok:
        raise OSError(f"cannot encode {path}")
    return atomic_write_bytes(path, encoded.tobytes())  # whole, and never through a planted link


def _draw_boxes(
    tile: np.ndarray,
    xyxy: np.ndarray,
    cls: np.ndarray,
    scores: np.ndarray | None,
    names: Names,
    thickness: int,
    font: float,
) -> None:
    """Draw corner boxes (n, 4) in ``tile``'s pixels on it, each with its class name (and score) on a label."""
    for j, (box, c) in enumerate(zip(xyxy, np.asarray(cls).reshape(-1).astype(int))):
        color = class_color(c)
        p1, p2 = (int(box[0]), int(box[1])), (int(box[2]), int(box[3]))
        cv2.rectangle(tile, p1, p2, color, thickness, cv2.LINE_AA)
        label = _name(names, c) + (f" {float(scores[j]):.2f}" if scores is not None else "")
        (lw, lh), base = cv2.getTextSize(label, cv2.FONT_HERSHEY_SIMPLEX, font, 1)
        top = max(p1[1] - lh - base, 0)
        cv2.rectangle(tile, (p1[0], top), (p1[0] + lw, top + lh + base), color, -1)
        cv2.putText(tile, label, (p1[0], top + lh), cv2.FONT_HERSHEY_SIMPLEX, font, (255, 255, 255), 1, cv2.LINE_AA)


def _figure() -> tuple[Figure, Axes]:
    fig = Figure(figsize=(9, 6))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _finish(fig: Figure, ax: Axes, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(bbox_to_anchor=(1.02, 1), loc="upper left", fontsize=8)
    fig.tight_layout()


def _save(fig: Figure, path: str | Path) -> Path:
    """The figure as ``path`` (its suffix says the format), written whole and never through a planted link."""
    path = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=150, format=path.suffix.lstrip(".") or "png")
    return atomic_write_bytes(path, buf.getvalue())


def _labelled(metrics: DetMetrics) -> bool:
    return len(metrics.curve_classes) <= _LABELLED_CLASSES


def _name(names: Names, k: int) -> str:
    try:
        return str(names[k])
    except (IndexError, KeyError):
        return str(k)


def _float(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return float("nan")
