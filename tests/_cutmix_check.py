"""What CutMix must have done to a training image, checked by its effect (``test_augment.py``, ``test_dataset.py``):
a partner scene full of small objects and the checks on the image and labels that come out."""

from __future__ import annotations

import numpy as np

from detrain.data.samples.instances import Labels

PARTNER_BACKGROUND = (200, 120, 0)  # BGR, unlike any colour the base scenes use


def grid_scene(
    h: int, w: int, step: int, size: int, cls: int, colour: tuple[int, int, int]
) -> tuple[np.ndarray, Labels]:
    """A flat image (background ``PARTNER_BACKGROUND``) covered by a grid of ``size``-px squares every ``step`` px,
    all of class ``cls`` and BGR ``colour``."""
    boxes = [(x, y, x + size, y + size) for y in range(2, h - size, step) for x in range(2, w - size, step)]
    img = np.full((h, w, 3), PARTNER_BACKGROUND, np.uint8)
    for x1, y1, x2, y2 in boxes:
        img[y1:y2, x1:x2] = colour
    return img, Labels(np.full(len(boxes), cls), np.array(boxes, np.float32))


def expected_cut_boxes(boxes: np.ndarray, area: tuple[int, int, int, int]) -> list[list[float]]:
    """The partner's boxes CutMix keeps for ``area``: clipped to it, when more than 10 % of the box is inside and
    the clipped box is wider and taller than 2 px (YOLO's candidate rule)."""
    x1, y1, x2, y2 = area
    out = []
    for b in boxes.tolist():
        c = [max(b[0], x1), max(b[1], y1), min(b[2], x2), min(b[3], y2)]
        w, h = c[2] - c[0], c[3] - c[1]
        if w > 2 and h > 2 and w * h > 0.1 * (b[2] - b[0]) * (b[3] - b[1]):
            out.append(c)
    return sorted(np.round(np.array(out, np.float32).reshape(-1, 4), 2).tolist())


def check_cutmix(
    out: np.ndarray,
    labels: Labels,
    base: np.ndarray,
    base_labels: Labels,
    partner: np.ndarray,
    partner_labels: Labels,
    partner_cls: int,
) -> dict[str, int]:
    """What CutMix must have done to ``base`` (or nothing): the changed pixels form one rectangle holding exactly
    the partner's pixels there, away from every base box; the base labels stay; the partner's boxes inside it are
    there, clipped, and those mostly outside it are not. Returns counts of what the case exercised."""
    changed = (out != base).any(-1)
    seen = {"pasted": 0, "clipped": 0, "dropped": 0}
    own = labels.cls != partner_cls
    assert np.array_equal(labels.cls[own], base_labels.cls)
    assert np.allclose(labels.boxes_xyxy[own], base_labels.boxes_xyxy, atol=1e-3)
    if not changed.any():
        assert own.all()
        return seen
    ys, xs = np.nonzero(changed)
    area = (int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1)
    x1, y1, x2, y2 = area
    assert np.array_equal(out[y1:y2, x1:x2], partner[y1:y2, x1:x2])  # exactly the partner's pixels, one rectangle
    assert changed.sum() == (x2 - x1) * (y2 - y1)  # (no partner pixel equals a base pixel in these scenes)
    for b in base_labels.boxes_xyxy:  # no box of the sample loses pixels
        assert b[2] <= x1 or b[0] >= x2 or b[3] <= y1 or b[1] >= y2, (b, area)
    got = sorted(np.round(labels.boxes_xyxy[~own], 2).tolist())  # (boxes may have passed through xywhn)
    assert got == expected_cut_boxes(partner_labels.boxes_xyxy, area)
    inside = [
        ((min(b[2], x2) - max(b[0], x1)) * (min(b[3], y2) - max(b[1], y1)) / ((b[2] - b[0]) * (b[3] - b[1])))
        for b in partner_labels.boxes_xyxy.tolist()
        if min(b[2], x2) > max(b[0], x1) and min(b[3], y2) > max(b[1], y1)
    ]
    seen["pasted"] = 1
    seen["clipped"] = sum(0.1 < f < 1 for f in inside)
    seen["dropped"] = sum(0 < f <= 0.1 for f in inside)
    return seen
