"""A split's label report in a few lines: the count of each reason files were skipped or corrected for, the first
files with theirs, and the warning of a split without any labels.

Every message stays in the report (and in ``labels_<split>.txt`` in the run folder,
:mod:`detrain.data.labels.report_file`); the screen gets a handful of lines however large the dataset:

>>> report = LabelReport(total=3, found=1, corrupt=2)
>>> report.add("d/labels/train/b.txt: line 1: class id 23 out of range for nc=2 (valid 0-1); image skipped",
...            "d/labels/train/b.txt")
>>> report.add("d/labels/train/c.txt: line 4: class id 7 out of range for nc=2 (valid 0-1); image skipped",
...            "d/labels/train/c.txt")
>>> print("\\n".join(reason_lines(report, "train")))
train: 2 files skipped or corrected (every one in labels_train.txt in the run folder):
  2 x class id out of range for nc=2; image skipped
  first 2:
    d/labels/train/b.txt: line 1: class id 23 out of range for nc=2 (valid 0-1); image skipped
    d/labels/train/c.txt: line 4: class id 7 out of range for nc=2 (valid 0-1); image skipped
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Sequence

from detrain.data.labels.record import LabelReport
from detrain.data.labels.report_file import report_file_name

SHOWN_FILES = 5  # files shown on screen with their reason
SHOWN_REASONS = 4  # reasons shown with their count; the rest are one line
# how the message of a split without labels begins (no label file found; label files all empty)
NO_LABELS, NO_BOXES = "no labels found for any of the ", "no boxes in any of the "
SPLIT_NOTES = (NO_LABELS, NO_BOXES)

# What varies between files with the same reason (a line number, a class id, a count, a value) is taken off, so
# they count as one: (pattern, replacement) in order, on the reason without its file.
_SAME_REASON = (
    (re.compile(r"^line \d+: "), ""),
    (re.compile(r"^class id \S+ out of range for (nc=\d+) \([^)]*\)"), r"class id out of range for \1"),
    (re.compile(r"^\S+ is not a number"), "a value is not a number"),
    (re.compile(r"^\d+ columns;"), "wrong number of columns;"),
    (re.compile(r"^negative (width|height) \S+"), r"negative \1"),
    (re.compile(r"^(coordinate|polygon extent) \S+ outside"), r"\1 outside"),
    (re.compile(r"^too many boxes: \d+, "), "too many boxes, "),
    (re.compile(r"^\d+ (zero-size box|duplicate row|box\(es\) reaching)"), r"\1"),
    (re.compile(r"^image too large: it declares \S+ = \d+ pixels, "), "image too large: "),
    (re.compile(r"\(too large: \d+ bytes, "), "(too large: "),
)


def reason_kind(reason: str) -> str:
    """The reason of a message (its file part taken off) without what varies from file to file, for counting.

    Example:
        >>> reason_kind("line 3: class id 23 out of range for nc=2 (valid 0-1); image skipped")
        'class id out of range for nc=2; image skipped'
        >>> reason_kind("not a readable image (OpenCV cannot decode it); image skipped")
        'not a readable image (OpenCV cannot decode it); image skipped'
    """
    for pattern, replacement in _SAME_REASON:
        reason = pattern.sub(replacement, reason, count=1)
    return reason


def file_entries(report: LabelReport) -> list[tuple[str, str]]:
    """(file, reason) of each message about one file, in the order of the files (messages about the whole split,
    such as the one of a split without labels, left out)."""
    return [(file, reason) for file, reason in report.entries() if file]


def reason_counts(entries: Sequence[tuple[str, str]]) -> list[tuple[str, int]]:
    """(reason, how many messages give it) of ``entries``' reasons (:func:`reason_kind`), most frequent first (in
    the order first met on a tie)."""
    return Counter(reason_kind(reason) for _, reason in entries).most_common()


def reason_lines(report: LabelReport, split: str, files: int = SHOWN_FILES, reasons: int = SHOWN_REASONS) -> list[str]:
    """The lines shown for ``split`` after its summary: how many files were skipped or corrected, the count of each
    reason (at most ``reasons`` lines), the first ``files`` files with their reason; none when there is nothing."""
    entries = file_entries(report)
    if not entries:
        return []
    counts = reason_counts(entries)
    n_files = len({file for file, _ in entries})
    lines = [
        f"{split}: {n_files} file{'s' if n_files != 1 else ''} skipped or corrected (every one in "
        f"{report_file_name(split)} in the run folder):"
    ]
    shown = counts if len(counts) <= reasons else counts[: reasons - 1]
    lines += [f"  {n} x {kind}" for kind, n in shown]
    if len(shown) < len(counts):
        rest = counts[len(shown) :]
        lines.append(f"  {sum(n for _, n in rest)} x {len(rest)} other reasons")
    lines.append(f"  first {min(files, len(entries))}{f' of {len(entries)}' if len(entries) > files else ''}:")
    lines += [f"    {file}: {reason}" for file, reason in entries[:files]]
    return lines


def no_usable_detail(report: LabelReport) -> str:
    """Why a split kept no image, for its error: the most common reason(s) and the first file with its reason.

    Example:
        >>> report = LabelReport(total=1, corrupt=1)
        >>> report.add("a.png: empty image file (0 bytes); image skipped", "a.png")
        >>> no_usable_detail(report)
        '1 of 1 images skipped, 1 x empty image file (0 bytes); first: a.png: empty image file (0 bytes)'
    """
    entries = file_entries(report)
    skipped = [(file, reason) for file, reason in entries if reason.endswith("image skipped")] or entries
    if not skipped:
        return f"{report.corrupt} of {report.total} images skipped"
    counts = reason_counts(skipped)[:2]
    said = ", then ".join(f"{n} x {kind.removesuffix('; image skipped')}" for kind, n in counts)
    file, reason = skipped[0]
    first = reason.removesuffix("; image skipped")
    return f"{report.corrupt} of {report.total} images skipped, {said}; first: {file}: {first}"


def no_labels_message(report: LabelReport, label_files: Sequence[str], split: str = "") -> str | None:
    """The warning of a split none of whose usable images has a box (every label file missing, as with no
    ``labels/`` folder at all, or empty), naming the folder(s) looked in; None when some image has boxes or none is
    usable (the error of an empty split says why).

    Example:
        >>> labels = ["d/labels/train/a.txt", "d/labels/train/b.txt"]
        >>> no_labels_message(LabelReport(total=2, missing=2), labels, "train")
        "no labels found for any of the 2 'train' images (looked in d/labels/train): training on backgrounds only"
    """
    usable = report.total - report.corrupt
    if report.found or not usable:
        return None
    folders = sorted({os.path.dirname(f) for f in label_files})
    where = folders[0] if folders else "?"
    if len(folders) > 1:
        where += f" and {len(folders) - 1} other folder{'s' if len(folders) > 2 else ''}"
    images = f"{usable} '{split}' images" if split else f"{usable} images"
    outcome = (
        "training on backgrounds only"
        if split in ("", "train")
        else "every image is a background, with no box to score detections against"
    )
    if not report.empty:
        return f"{NO_LABELS}{images} (looked in {where}): {outcome}"
    return (
        f"{NO_BOXES}{images}: {report.empty} label files are empty, {report.missing} missing (looked in {where}): "
        f"{outcome}"
    )


def drop_split_notes(report: LabelReport) -> None:
    """Remove from ``report`` the message of a split without labels (for a split whose labels are a COCO json, where
    the label files are not looked for)."""
    keep = [k for k, (file, message) in enumerate(report.entries()) if file or not message.startswith(SPLIT_NOTES)]
    report.messages = [report.messages[k] for k in keep]
    report.files = [report.files[k] if k < len(report.files) else "" for k in keep]
