"""What label verification yields: a usable image with its boxes (:class:`LabelRecord`) and the counts and
messages of a whole split (:class:`LabelReport`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class LabelRecord:
    """One usable image and its boxes.

    Example:
        >>> r = LabelRecord("a.jpg", (480, 640), np.zeros(0, np.int64), np.zeros((0, 4), np.float32))
        >>> r.shape_hw
        (480, 640)
    """

    im_file: str
    shape_hw: tuple[int, int]  # as cv2.imread returns it, i.e. after EXIF rotation
    cls: np.ndarray  # (n,) int64
    bboxes_xywhn: np.ndarray  # (n, 4) float32, normalised x_center y_center width height


@dataclass
class LabelReport:
    """What verification found: counts per kind, one message per problem, and where the cache lives.

    `found + missing + empty + corrupt == total`; corrupt images are the ones left out of the records. `clipped`
    counts the boxes (of kept images) that reached outside their image and were clipped to it. A message about one
    file is ``<file>: <reason>``; `files` holds the ``<file>`` of each message ("" for one about the whole split), so
    :meth:`entries` can take the file part off (a file name may hold ": ").

    Example:
        >>> LabelReport(total=2, found=1, missing=1).summary("val")
        'val: 2 images, 1 with labels, 1 missing, 0 empty, 0 corrupt (no cache)'
    """

    total: int = 0
    found: int = 0
    missing: int = 0
    empty: int = 0
    corrupt: int = 0
    clipped: int = 0
    messages: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)  # the file each message is about, "" for the split's
    cache_path: Path | None = None
    from_cache: bool = False

    def add(self, message: str, file: str = "") -> None:
        """Record `message`, about `file` (its ``<file>: `` prefix, as printed) or, with "", about the split."""
        self.messages.append(message)
        self.files.append(file)

    def entries(self) -> list[tuple[str, str]]:
        """(file, reason) of each message: the reason is the message with its ``<file>: `` prefix taken off;
        ("", message) for a message about the whole split.

        Example:
            >>> report = LabelReport()
            >>> report.add("a: b.txt: line 1: class id 5 out of range for nc=2 (valid 0-1)", "a: b.txt")
            >>> report.add("no labels found")
            >>> report.entries()
            [('a: b.txt', 'line 1: class id 5 out of range for nc=2 (valid 0-1)'), ('', 'no labels found')]
        """
        out = []
        for k, message in enumerate(self.messages):
            file = self.files[k] if k < len(self.files) else ""
            if file and message.startswith(f"{file}: "):
                out.append((file, message[len(file) + 2 :]))
            else:
                out.append(("", message))
        return out

    def summary(self, prefix: str = "") -> str:
        """One line for the log, e.g. `train: 128 images, 126 with labels, 2 missing, 0 empty, 0 corrupt (cache: ...)`,
        with the number of boxes clipped to their image when there are any.

        Example:
            >>> LabelReport(total=1, found=1).summary()
            '1 images, 1 with labels, 0 missing, 0 empty, 0 corrupt (no cache)'
            >>> LabelReport(total=1, found=1, clipped=3).summary()
            '1 images, 1 with labels, 0 missing, 0 empty, 0 corrupt, 3 boxes clipped to the image (no cache)'
        """
        where = f"cache: {self.cache_path}" if self.cache_path is not None else "no cache"
        head = f"{prefix}: " if prefix else ""
        clipped = f", {self.clipped} boxes clipped to the image" if self.clipped else ""
        return (
            f"{head}{self.total} images, {self.found} with labels, {self.missing} missing, {self.empty} empty, "
            f"{self.corrupt} corrupt{clipped} ({where})"
        )
