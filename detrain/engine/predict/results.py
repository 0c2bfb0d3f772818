"""What ``Model.predict`` returns: one :class:`Results` per image or video frame, plain numpy inside.

>>> r = Results("a.jpg", None, (40, 80), np.array([[8., 4, 24, 20]], np.float32), np.array([0.9], np.float32),
...             np.array([1]), {0: "cat", 1: "dog"})
>>> len(r), r.summary(), r.labels
(1, '1 dog', ['dog'])
>>> r.txt_lines(save_conf=True)
['1 0.200000 0.300000 0.200000 0.400000 0.90000']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from detrain.log import atomic_write_text
from detrain.plots.annotate import draw_detections


@dataclass(eq=False)
class Results:
    """The detections in one image or video frame, best first.

    Attributes:
        path: the image or video file (a camera as ``camera 0``, a stream as its URL without the password,
            an in-memory image as ``image<i>``).
        frame: the frame's number in its video, camera or stream (0 = first); None for an image.
        orig_shape: (height, width) of the picture, in pixels.
        boxes: (n, 4) float32 boxes, x1 y1 x2 y2 in the picture's pixels.
        conf: (n,) float32 confidences.
        cls: (n,) int64 class ids.
        names: class id -> name, for every class the model knows.
        orig_img: the picture (BGR uint8, as cv2 reads it), for :meth:`plot`; kept only while the Results is.
    """

    path: str
    frame: int | None
    orig_shape: tuple[int, int]
    boxes: np.ndarray
    conf: np.ndarray
    cls: np.ndarray
    names: dict[int, str]
    orig_img: np.ndarray | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.boxes)

    @property
    def labels(self) -> list[str]:
        """The class name of each detection."""
        return [self.names.get(int(c), str(int(c))) for c in self.cls]

    @property
    def xywhn(self) -> np.ndarray:
        """(n, 4) boxes as centre x, centre y, width, height, normalised by the picture's size (YOLO labels)."""
        h, w = self.orig_shape
        b = self.boxes.astype(np.float64)
        xywh = np.stack(((b[:, 0] + b[:, 2]) / 2, (b[:, 1] + b[:, 3]) / 2, b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]), 1)
        return (xywh / np.array([w, h, w, h])).reshape(-1, 4)

    def summary(self) -> str:
        """``'2 person, 1 car'`` (counts by class, most frequent first), or ``'no detections'``."""
        counts: dict[str, int] = {}
        for name in self.labels:
            counts[name] = counts.get(name, 0) + 1
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{n} {name}" for name, n in ranked) or "no detections"

    def plot(self, line_width: int = 0) -> np.ndarray:
        """A copy of the picture with the boxes and '<name> <conf>' labels drawn (BGR uint8)."""
        if self.orig_img is None:
            raise ValueError(f"{self.path}: the picture was not kept, nothing to draw on")
        return draw_detections(self.orig_img, self.boxes, self.conf, self.cls, self.names, line_width)

    def txt_lines(self, save_conf: bool = False) -> list[str]:
        """YOLO-format rows: ``class cx cy w h`` (normalised), and the confidence with ``save_conf``."""
        lines = []
        for c, row, score in zip(self.cls.tolist(), self.xywhn.tolist(), self.conf.tolist()):
            text = f"{int(c)} " + " ".join(f"{v:.6f}" for v in row)
            lines.append(text + (f" {score:.5f}" if save_conf else ""))
        return lines

    def save_txt(self, path: str | Path, save_conf: bool = False, root: str | Path | None = None) -> Path:
        """Write :meth:`txt_lines` to ``path`` (whole or not at all, through no symbolic link: below ``root`` when
        given, else in ``path``'s own folder); returns the path."""
        lines = self.txt_lines(save_conf)
        return atomic_write_text(path, "\n".join(lines) + ("\n" if lines else ""), root)
