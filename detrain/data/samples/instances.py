"""The labels of one image while it is being augmented: class ids and pixel boxes.

Boxes are ``xyxy`` in *continuous* pixel coordinates of the image they belong to: the image spans
``[0, w] x [0, h]`` and pixel ``(row i, col j)`` covers ``[j, j + 1] x [i, i + 1]``. Every geometric
augmentation moves them with the same 3x3 matrix that moves the pixels (see ``affine.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class Labels:
    """Class ids ``cls`` (n,) int64 and boxes ``boxes_xyxy`` (n, 4) float32 in pixels of the current image.

    >>> labels = Labels.from_xywhn(np.array([3]), np.array([[0.5, 0.5, 0.2, 0.4]], np.float32), w=100, h=50)
    >>> labels.boxes_xyxy.tolist()
    [[40.0, 15.0, 60.0, 35.0]]
    >>> np.allclose(labels.to_xywhn(w=100, h=50), [[0.5, 0.5, 0.2, 0.4]])
    True
    """

    cls: np.ndarray
    boxes_xyxy: np.ndarray

    def __post_init__(self) -> None:
        self.cls = np.asarray(self.cls, dtype=np.int64).reshape(-1)
        self.boxes_xyxy = np.asarray(self.boxes_xyxy, dtype=np.float32).reshape(-1, 4)

    def __len__(self) -> int:
        return len(self.cls)

    @classmethod
    def empty(cls) -> Labels:
        """No objects."""
        return cls(np.zeros(0, np.int64), np.zeros((0, 4), np.float32))

    @classmethod
    def from_xywhn(cls, classes: np.ndarray, bboxes_xywhn: np.ndarray, w: float, h: float) -> Labels:
        """Normalised centre/size boxes (as in YOLO label files) to pixels of a ``w`` x ``h`` image."""
        b = np.asarray(bboxes_xywhn, dtype=np.float32).reshape(-1, 4)
        xy = b[:, :2] * (w, h)
        half = b[:, 2:] * (w / 2, h / 2)
        return cls(classes, np.concatenate((xy - half, xy + half), 1))

    def to_xywhn(self, w: float, h: float) -> np.ndarray:
        """Boxes as normalised centre/size (n, 4) float32 for a ``w`` x ``h`` image."""
        b = self.boxes_xyxy
        out = np.empty_like(b)
        out[:, 0] = (b[:, 0] + b[:, 2]) / (2 * w)
        out[:, 1] = (b[:, 1] + b[:, 3]) / (2 * h)
        out[:, 2] = (b[:, 2] - b[:, 0]) / w
        out[:, 3] = (b[:, 3] - b[:, 1]) / h
        return out

    def scaled(self, gain_x: float, gain_y: float, pad_x: float = 0.0, pad_y: float = 0.0) -> Labels:
        """The same objects after the image was resized by the gains and shifted by the padding."""
        b = self.boxes_xyxy * np.array((gain_x, gain_y, gain_x, gain_y), np.float32)
        return Labels(self.cls, b + np.array((pad_x, pad_y, pad_x, pad_y), np.float32))

    @staticmethod
    def concat(parts: Sequence[Labels]) -> Labels:
        """All objects of several label sets, in order."""
        if not parts:
            return Labels.empty()
        return Labels(np.concatenate([p.cls for p in parts]), np.concatenate([p.boxes_xyxy for p in parts]))
