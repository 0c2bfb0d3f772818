"""Validation plots as PNG files: PR curves, F1/P/R over confidence, confusion matrix, results.png.

Drawing uses matplotlib's object API on the Agg canvas (no pyplot, no global backend switch), so it is
safe in worker processes and threads and never opens a window.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from detrain.metrics import ConfusionMatrix, DetMetrics

Names = Sequence[str] | Mapping[int, str]
_LABELLED_CLASSES = 20  # beyond this many curves a legend hides the plot


def plot_all(save_dir: str | Path, metrics: DetMetrics, confusion: ConfusionMatrix | np.ndarray | None,
             names: Names) -> list[Path]:
    """Every validation plot into ``save_dir``: PR_curve, F1/P/R_curve, confusion_matrix[_normalized].png.

    ``confusion`` is a :class:`ConfusionMatrix` or its (summed) ``matrix``; None skips those two plots.

    >>> plot_all("runs/val", coco_summary(stats, nc), confusion.matrix, {0: "cat"})  # doctest: +SKIP
    [PosixPath('runs/val/PR_curve.png'), ...]
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

    >>> plot_pr_curve(metrics, ["person", "car"], "PR_curve.png")  # doctest: +SKIP
    """
    fig, ax = _figure()
    x = metrics.recall_grid
    for row, k in enumerate(metrics.curve_classes.tolist()):
        label = f"{_name(names, k)} {metrics.per_class[k]['ap50']:.3f}" if _labelled(metrics) else None
        ax.plot(x, metrics.pr_curve[row], linewidth=1, label=label)
    if len(metrics.curve_classes):
        ax.plot(x, metrics.pr_curve.mean(0), linewidth=3, color="blue", label=f"all classes {metrics.map50:.3f} mAP50")
    _finish(ax, "Recall", "Precision", "Precision-Recall curve (IoU 0.5)")
    return _save(fig, path)


def plot_confidence_curve(metrics: DetMetrics, names: Names, path: str | Path, which: str = "f1") -> Path:
    """F1 (``which="f1"``), precision (``"p"``) or recall (``"r"``) over the confidence threshold.

    The bold line is the mean over classes; the legend gives its best value and where it lies.

    >>> plot_confidence_curve(metrics, ["person"], "F1_curve.png", "f1")  # doctest: +SKIP
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
    _finish(ax, "Confidence", label, f"{label}-Confidence curve")
    return _save(fig, path)


def plot_confusion_matrix(confusion: ConfusionMatrix | np.ndarray, names: Names, path: str | Path,
                          normalize: bool = True) -> Path:
    """Heat map of ``matrix[predicted, true]`` with a background row/column; normalised per true class.

    >>> plot_confusion_matrix(ConfusionMatrix(2), ["a", "b"], "confusion_matrix.png")  # doctest: +SKIP
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
            ax.text(j, i, text, ha="center", va="center", fontsize=7,
                    color="white" if values[i, j] > 0.5 * np.nanmax(shown) else "black")
    ax.set_xlabel("True")
    ax.set_ylabel("Predicted")
    ax.set_title("Confusion matrix" + (" (normalised per true class)" if normalize else ""))
    fig.tight_layout()
    return _save(fig, path)


def plot_results_csv(csv_path: str | Path, path: str | Path | None = None) -> Path:
    """results.png beside ``csv_path``: one small panel per column of results.csv against the epoch.

    >>> plot_results_csv("runs/train/exp/results.csv")  # doctest: +SKIP
    PosixPath('runs/train/exp/results.png')
    """
    csv_path = Path(csv_path)
    with open(csv_path, newline="", encoding="utf-8") as f:
        rows = [{k.strip(): v.strip() for k, v in r.items() if k is not None} for r in csv.DictReader(f)]
    columns = [k for k in (rows[0] if rows else {}) if k != "epoch"]
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


def _figure() -> tuple[Figure, object]:
    fig = Figure(figsize=(9, 6))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _finish(ax: object, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(bbox_to_anchor=(1.02, 1), loc="upper left", fontsize=8)
    ax.figure.tight_layout()


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    return path


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
