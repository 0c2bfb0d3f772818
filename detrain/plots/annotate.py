"""Detections drawn on a picture: a box per detection and a '<name> <score>' label, in its class's colour.

>>> img = np.zeros((60, 80, 3), np.uint8)
>>> out = draw_detections(img, np.array([[10, 10, 50, 40]]), np.array([0.9]), np.array([0]), {0: "a"})
>>> bool(out[25, 10].any()), bool(img.any())  # the box's left edge is drawn on a copy
(True, False)
"""

from __future__ import annotations

import cv2
import numpy as np

from detrain.plots.palette import class_color


def line_width_for(shape_hw: tuple[int, ...]) -> int:
    """The default box line width for a picture of this size (as Ultralytics draws): at least 2 pixels."""
    return max(round(sum(shape_hw[:2]) / 2 * 0.003), 2)


def draw_detections(
    img_bgr: np.ndarray,
    boxes_xyxy: np.ndarray,
    conf: np.ndarray,
    cls: np.ndarray,
    names: dict[int, str],
    line_width: int = 0,
    *,
    boxes: bool = True,
    labels: bool = True,
    show_conf: bool = True,
) -> np.ndarray:
    """A copy of ``img_bgr`` with the boxes (pixels, x1 y1 x2 y2) and their labels drawn; ``line_width`` 0 =
    from the picture's size. Labels sit above the box, or inside it at the top edge, always inside the picture.
    As Ultralytics' ``show_boxes``, ``show_labels`` and ``show_conf``: ``boxes=False`` draws nothing, ``labels=False``
    the boxes alone, ``show_conf=False`` labels of the class name alone."""
    out = img_bgr.copy()
    if not boxes:
        return out
    lw = line_width or line_width_for(out.shape)
    scale, thickness = lw / 3, max(lw - 1, 1)
    for (x1, y1, x2, y2), score, c in zip(
        np.asarray(boxes_xyxy).tolist(), np.asarray(conf).tolist(), np.asarray(cls).tolist()
    ):
        color = class_color(int(c))
        p1, p2 = (int(x1), int(y1)), (int(x2), int(y2))
        cv2.rectangle(out, p1, p2, color, lw, cv2.LINE_AA)
        if not labels:
            continue
        label = names.get(int(c), str(int(c))) + (f" {score:.2f}" if show_conf else "")
        (tw, th), _ = cv2.getTextSize(label, cv2.FONT_HERSHEY_SIMPLEX, scale, thickness)
        above = p1[1] - th - 3 >= 0
        x0 = max(0, min(p1[0], out.shape[1] - tw))  # keep the label inside the picture
        q2 = (x0 + tw, p1[1] - th - 3 if above else p1[1] + th + 3)
        cv2.rectangle(out, (x0, p1[1]), q2, color, -1, cv2.LINE_AA)
        cv2.putText(
            out,
            label,
            (x0, p1[1] - 2 if above else p1[1] + th + 2),
            cv2.FONT_HERSHEY_SIMPLEX,
            scale,
            (255, 255, 255),
            thickness,
            cv2.LINE_AA,
        )
    return out
