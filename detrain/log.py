"""What a run shows and records: the per-epoch progress bar, results.csv, args.yaml, tensorboard.

Only rank 0 creates these; the trainer hands other ranks a silent stand-in (``progress=None``).
"""

from __future__ import annotations

import csv
import io
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from detrain.system.tempfiles import write_atomic

# a log file or a pipe still gets full-width lines
console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def atomic_write_text(path: str | Path, text: str, root: str | Path | None = None) -> Path:
    """Write a text file through a temporary file and a rename, so readers never see half of it, and through no
    symbolic link: ``path``'s folder (with ``root``, every folder below it) is entered without following one
    (:func:`detrain.system.tempfiles.write_atomic`)."""
    return write_atomic(path, text, root)


def atomic_write_bytes(path: str | Path, data: bytes, root: str | Path | None = None) -> Path:
    """:func:`atomic_write_text` for bytes (an encoded image)."""
    return write_atomic(path, data, root)


def save_yaml(path: str | Path, data: Mapping[str, Any]) -> Path:
    """Atomic yaml dump (args.yaml)."""
    return atomic_write_text(path, yaml.safe_dump(dict(data), sort_keys=False))


class ResultsCSV:
    """results.csv with one row per epoch. Rewritten whole (atomically) each epoch; a resumed run keeps the
    rows of finished epochs and replaces the rest, so every epoch appears exactly once."""

    def __init__(self, path: str | Path, keep_epochs_upto: int | None = None) -> None:
        self.path = Path(path)
        self.rows: list[dict[str, Any]] = []
        if keep_epochs_upto is not None and self.path.is_file():
            with open(self.path, newline="") as f:
                self.rows = [r for r in csv.DictReader(f) if int(r["epoch"]) <= keep_epochs_upto]

    def add(self, row: Mapping[str, Any]) -> None:
        self.rows = [r for r in self.rows if int(r["epoch"]) != int(row["epoch"])] + [dict(row)]
        keys: list[str] = []
        for r in self.rows:
            keys += [k for k in r if k not in keys]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=keys)
        writer.writeheader()
        for r in self.rows:
            writer.writerow({k: _fmt(r.get(k, "")) for k in keys})
        atomic_write_text(self.path, buf.getvalue())


# a validation's numbers -> their results.csv columns
METRIC_COLUMNS = {
    "precision": "metrics/precision",
    "recall": "metrics/recall",
    "map50": "metrics/mAP50",
    "map75": "metrics/mAP75",
    "map": "metrics/mAP50-95",
}


def metric_columns(metrics: Mapping[str, Any]) -> dict[str, float]:
    """A validation's metrics as results.csv's columns (those it has).

    >>> metric_columns({"map50": 0.5, "fitness": 0.1})
    {'metrics/mAP50': 0.5}
    """
    return {col: float(metrics[k]) for k, col in METRIC_COLUMNS.items() if k in metrics}


def epoch_line(epoch: int, epochs: int, row: Mapping[str, Any], speed: Mapping[str, float], seconds: float) -> str:
    """The line printed after epoch ``epoch`` (1-based) of ``epochs``: the row's losses and metrics, the speed.

    >>> speed = {"images_per_s": 10.0, "step_ms_mean": 50.0, "step_ms_slowest_rank": 60.0}
    >>> epoch_line(1, 3, {"epoch": 1, "train/box_loss": 2.0, "lr/pg0": 0.01}, speed, 3.0)
    'epoch 1/3: box_loss 2  10.0 img/s, step 50 ms mean / 60 ms slowest rank, 3.0 s'
    """
    shown = "  ".join(
        f"{k.split('/')[-1]} {float(v):.4g}" for k, v in row.items() if k.startswith(("train/", "metrics/"))
    )
    return (
        f"epoch {epoch}/{epochs}: {shown}  {speed['images_per_s']:.1f} img/s, step "
        f"{speed['step_ms_mean']:.0f} ms mean / {speed['step_ms_slowest_rank']:.0f} ms slowest "
        f"rank, {seconds:.1f} s"
    )


def _fmt(value: Any) -> Any:
    return f"{value:.6g}" if isinstance(value, float) else value


class EpochProgress:
    """A rich progress bar for one epoch: running losses, instances, imgsz and an ETA."""

    def __init__(self, epoch: int, epochs: int, total: int, loss_names: tuple[str, ...]) -> None:
        self.loss_names = loss_names
        self.progress = Progress(
            TextColumn(f"{epoch + 1:>4}/{epochs:<4}"),
            TextColumn("{task.fields[losses]}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
            disable=not console.is_terminal and os.environ.get("DETRAIN_PROGRESS") == "0",
        )
        self.task = self.progress.add_task("train", total=total, losses=self._text(None, 0, 0))
        self.progress.start()

    def _text(self, losses: Any, instances: int, imgsz: int) -> str:
        if losses is None:
            return " ".join(f"{n:>8}" for n in self.loss_names) + f" {'inst':>5} {'size':>5}"
        return " ".join(f"{float(v):8.4f}" for v in losses) + f" {instances:5d} {imgsz:5d}"

    def update(self, losses: Any, instances: int, imgsz: int) -> None:
        self.progress.update(self.task, advance=1, losses=self._text(losses, instances, imgsz))

    def close(self) -> None:
        self.progress.stop()


class TensorBoard:
    """Scalars to tensorboard when it is installed and asked for; silently nothing otherwise (with a note)."""

    def __init__(self, log_dir: Path, enabled: bool) -> None:
        self.writer = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(log_dir))
            except ImportError:
                console.print("tensorboard=True but tensorboard is not installed (pip install tensorboard); skipped")

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        if self.writer is not None:
            for k, v in scalars.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
