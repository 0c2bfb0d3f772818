"""One colour per class for every picture detrain draws (``detrain predict`` images, batch plots).

>>> class_color(0) == class_color(0), class_color(0) != class_color(1)
(True, True)
"""

from __future__ import annotations

import cv2
import numpy as np


def class_color(cls: int) -> tuple[int, int, int]:
    """A stable, distinct BGR colour per class."""
    hue = (int(cls) * 47) % 180
    bgr = cv2.cvtColor(np.array([[[hue, 200, 230]]], np.uint8), cv2.COLOR_HSV2BGR)[0, 0]
    return int(bgr[0]), int(bgr[1]), int(bgr[2])
