"""Every message of a split's label verification in the run folder: ``labels_<split>.txt``, one line per message
(``<file>: <reason>``, or a line about the whole split), written atomically by the process that writes the run's
files (rank 0), the trainer's and ``detrain val``'s alike. The screen shows only a few of them
(:mod:`detrain.data.labels.reasons`).

>>> from detrain.data.labels.record import LabelReport
>>> from types import SimpleNamespace
>>> report = LabelReport(total=2, found=1, corrupt=1)
>>> report.add("d/images/val/b.png: empty image file (0 bytes); image skipped", "d/images/val/b.png")
>>> [p.name for p in write_label_reports("run", SimpleNamespace(split="val", report=report))]
['labels_val.txt']
>>> print(Path("run/labels_val.txt").read_text(), end="")
d/images/val/b.png: empty image file (0 bytes); image skipped
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from detrain.data.labels.record import LabelReport
from detrain.system.tempfiles import write_atomic
from detrain.system.text import shown


class ReportedSplit(Protocol):
    """What :func:`write_label_reports` reads of a split (:class:`detrain.data.prepare.SplitData`)."""

    @property
    def split(self) -> str: ...

    @property
    def report(self) -> LabelReport: ...


def report_file_name(split: str) -> str:
    """The name of ``split``'s report in the run folder.

    >>> report_file_name("train")
    'labels_train.txt'
    """
    return f"labels_{split}.txt"


def write_label_reports(run_dir: str | Path, *splits: ReportedSplit) -> list[Path]:
    """Write ``labels_<split>.txt`` of each of ``splits`` into the run folder ``run_dir`` (made if missing; an empty
    file for a split with nothing to report, so none from an earlier run is left standing); returns the paths.
    Call it on the process that writes the run's files only (rank 0)."""
    out = []
    for data in splits:
        lines = [shown(m) + "\n" for m in data.report.messages]  # one line each, whatever a file name holds
        out.append(write_atomic(Path(run_dir) / report_file_name(data.split), "".join(lines)))
    return out
