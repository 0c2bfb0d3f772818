"""What a validation shows besides its numbers: the per-class table (printed) and, with ``plots``, the curves
(PR_curve.png, F1/P/R_curve.png), the confusion matrices (counts and normalised) and its first batches drawn
(val_batch{0,1,2}_labels.jpg and _pred.jpg).

``detrain val`` writes them as it finishes (:func:`detrain.engine.evaluate.validator.finish`). A training run keeps
each validation's on rank 0 (:class:`LastValidation`, replacing the one before) and writes the last one's into the
run folder when it ends, with labels.jpg (its training labels) and results.png: the same table and pictures, drawn by
the same code, and no validation run again for them (Ultralytics validates best.pt once more; detrain shows the
validation whose numbers end results.csv and ``Model.train()``'s metrics). Only rank 0 holds or writes anything;
this module calls no collective.

>>> last = LastValidation(plots=False, verbose=False)
>>> last.write(Path("run"), None)  # no validation kept, plots=false: nothing written, nothing printed
>>> last.outputs is None
True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from detrain.log import console
from detrain.metrics import DetMetrics

__all__ = ["LastValidation", "ValOutputs", "print_table"]


@dataclass
class ValOutputs:
    """Rank 0's view of one validation, what its table and pictures are made of: the summary (its curves), the
    confusion counts summed over the ranks, the classes, the numbers (``metrics``: the validator's dict) and its
    first batches with their detections (``drawn``: empty unless plots were asked for)."""

    summary: DetMetrics
    matrix: np.ndarray
    names: dict[int, str]
    metrics: dict[str, Any]
    drawn: list[dict[str, Any]] = field(default_factory=list)

    def plot(self, save_dir: Path) -> None:
        """The curves, both confusion matrices and the batch pictures into ``save_dir``; a picture that cannot be
        drawn is one line, never the loss of the metrics."""
        try:
            from detrain.plots import val as plots_val

            plots_val.plot_all(save_dir, self.summary, self.matrix, self.names)
            for i, b in enumerate(self.drawn):
                labels = [
                    (b["boxes"][b["batch_idx"] == j], b["cls"][b["batch_idx"] == j], None) for j in range(len(b["img"]))
                ]
                preds = [(p[:, :4], p[:, 5].astype(np.int64), p[:, 4]) for p in b["preds"]]
                plots_val.plot_images(b["img"], labels, self.names, save_dir / f"val_batch{i}_labels.jpg", b["im_file"])
                plots_val.plot_images(b["img"], preds, self.names, save_dir / f"val_batch{i}_pred.jpg", b["im_file"])
        except Exception as e:  # noqa: BLE001 - never lose the metrics for a plot
            console.print(f"plots not written: {type(e).__name__}: {e}")

    def print_table(self) -> None:
        """The per-class table and the COCO line (:func:`print_table`)."""
        print_table(self.metrics, self.names, int(self.metrics.get("n_images", 0)))


class LastValidation:
    """A training run's latest validation, kept by rank 0: the validator hands each one over (``keep``), and
    :meth:`write` shows the last one when the run ends. ``plots`` and ``verbose`` are the run's keys."""

    def __init__(self, plots: bool, verbose: bool) -> None:
        self.plots, self.verbose = plots, verbose
        self.outputs: ValOutputs | None = None

    def keep(self, outputs: ValOutputs) -> None:
        self.outputs = outputs

    def write(self, save_dir: Path, train_data: Any) -> None:
        """Rank 0, at the run's end: with ``plots`` results.png and labels.jpg (the labels of ``train_data``, a
        ``SplitData``); the last validation's per-class table (``verbose``) and, with ``plots``, its pictures."""
        from detrain.plots.train import plot_labels, plot_results

        if self.plots:
            plot_results(save_dir)
            if train_data is not None:
                plot_labels(train_data.records, train_data.names, save_dir / "labels.jpg")
        if self.outputs is None:  # no validation ran (val=false and an early stop)
            return
        if self.verbose:
            console.print("the last validation (EMA weights, as last.pt holds them):")
            self.outputs.print_table()
        if self.plots:
            self.outputs.plot(save_dir)


def print_table(metrics: dict[str, Any], names: dict[int, str], n_images: int) -> None:
    """Per-class table: images, instances, P, R, mAP50, mAP50-95 (COCO-exact)."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col in ("class", "images", "instances", "P", "R", "mAP50", "mAP50-95"):
        table.add_column(col, justify="left" if col == "class" else "right")
    per_class = metrics.get("per_class", {})
    total = sum(int(v.get("n_gt", 0)) for v in per_class.values())
    table.add_row(
        "all",
        str(n_images),
        str(total),
        f"{metrics['precision']:.3f}",
        f"{metrics['recall']:.3f}",
        f"{metrics['map50']:.3f}",
        f"{metrics['map']:.3f}",
    )
    for c, v in sorted(per_class.items()):
        table.add_row(
            names.get(int(c), str(c)),
            str(v.get("n_images", "")),
            str(v.get("n_gt", "")),
            f"{v['p']:.3f}",
            f"{v['r']:.3f}",
            f"{v['ap50']:.3f}",
            f"{v['ap']:.3f}",
        )
    console.print(table)
    console.print(
        f"COCO mAP50-95 {metrics['map']:.4f}  mAP50 {metrics['map50']:.4f}  mAP75 {metrics['map75']:.4f}  "
        f"AP small/medium/large {metrics['map_small']:.3f}/{metrics['map_medium']:.3f}/"
        f"{metrics['map_large']:.3f}  AR@100 {metrics['ar100']:.4f}"
    )
