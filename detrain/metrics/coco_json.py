"""COCO-format json: the rounding of detections written out (``predictions.json``), detections and ground truth
read in; scoring is the validator's (:mod:`detrain.engine.evaluate.score_file`).

Boxes in these files are COCO's ``[x_min, y_min, w, h]`` in pixels (called ``ltwh`` here). Files are
checked strictly: the first bad entry is named by its index and value in a :class:`DatasetError`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from detrain.errors import DatasetError

# Category id of each of the 80 YOLO COCO classes in the 91-id COCO annotation files.
COCO80_TO_91: tuple[int, ...] = (
    1,
    2,
    3,
    4,
    5,
    6,
    7,
    8,
    9,
    10,
    11,
    13,
    14,
    15,
    16,
    17,
    18,
    19,
    20,
    21,
    22,
    23,
    24,
    25,
    27,
    28,
    31,
    32,
    33,
    34,
    35,
    36,
    37,
    38,
    39,
    40,
    41,
    42,
    43,
    44,
    46,
    47,
    48,
    49,
    50,
    51,
    52,
    53,
    54,
    55,
    56,
    57,
    58,
    59,
    60,
    61,
    62,
    63,
    64,
    65,
    67,
    70,
    72,
    73,
    74,
    75,
    76,
    77,
    78,
    79,
    80,
    81,
    82,
    84,
    85,
    86,
    87,
    88,
    89,
    90,
)


@dataclass
class CocoDetections:
    """One image's detections from a results file, in file order (which breaks score ties)."""

    boxes_ltwh: np.ndarray  # (n, 4) float64
    scores: np.ndarray  # (n,) float64
    category_ids: np.ndarray  # (n,) int64


@dataclass
class CocoGroundTruth:
    """One image's annotations, in file order. ``area`` is the file's (mask) area, used for size ranges."""

    boxes_ltwh: np.ndarray  # (m, 4) float64
    category_ids: np.ndarray  # (m,) int64
    area: np.ndarray  # (m,) float64
    iscrowd: np.ndarray  # (m,) bool
    ids: np.ndarray  # (m,) int64 annotation ids (-1 where the file has none)


def coco_rounded(boxes_xyxy: Any, scores: Any) -> tuple[np.ndarray, np.ndarray]:
    """Corner boxes and scores as a COCO results file holds them: ``[x, y, w, h]`` rounded to 3 decimals,
    scores to 5 (float64).

    >>> coco_rounded(np.array([[1.00004, 2, 11, 22]]), np.array([0.9123456]))
    (array([[ 1.,  2., 10., 20.]]), array([0.91235]))
    """
    boxes = _np(boxes_xyxy).reshape(-1, 4).astype(np.float64)
    ltwh = np.round(np.concatenate((boxes[:, :2], boxes[:, 2:] - boxes[:, :2]), 1), 3)
    return ltwh, np.round(_np(scores).reshape(-1).astype(np.float64), 5)


def load_predictions(
    path: str | Path, valid_image_ids: Collection[int], valid_category_ids: Collection[int]
) -> dict[int, CocoDetections]:
    """Read a COCO results file (a list of {image_id, category_id, bbox, score}) grouped by image id.

    Raises :class:`DatasetError` naming the first entry with an unknown image or category id, a box that
    is not 4 finite numbers with ``w, h >= 0``, a score that is not a finite number, or a missing key.

    >>> import tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "p.json")
    >>> _ = open(f, "w").write('[{"image_id": 1, "category_id": 3, "bbox": [0, 0, 5, 5], "score": 0.5}]')
    >>> load_predictions(f, {1}, {3})[1].scores.tolist()
    [0.5]
    """
    rows = _read_json(path)
    if not isinstance(rows, list):
        raise DatasetError(f"{path}: a COCO results file is a json list of detections, got {type(rows).__name__}")
    n = len(rows)
    image_ids = np.zeros(n, np.int64)
    category_ids = np.zeros(n, np.int64)
    boxes = np.zeros((n, 4), np.float64)
    scores = np.zeros(n, np.float64)
    for i, row in enumerate(rows):
        where = f"{path}: detection {i}"
        if not isinstance(row, dict) or not {"image_id", "category_id", "bbox", "score"} <= row.keys():
            raise DatasetError(f"{where}: expected an object with image_id, category_id, bbox, score; got {row!r}")
        image_ids[i] = _int(row["image_id"], f"{where}: image_id")
        category_ids[i] = _int(row["category_id"], f"{where}: category_id")
        boxes[i] = _box(row["bbox"], f"{where}: bbox")
        scores[i] = _number(row["score"], f"{where}: score")
    _first_bad(
        ~np.isin(image_ids, np.fromiter(valid_image_ids, np.int64)),
        image_ids,
        f"{path}: detection {{i}}: unknown image_id {{v}} (not an image of the ground truth)",
    )
    _first_bad(
        ~np.isin(category_ids, np.fromiter(valid_category_ids, np.int64)),
        category_ids,
        f"{path}: detection {{i}}: unknown category_id {{v}} (valid: {sorted(valid_category_ids)})",
    )
    order = np.argsort(image_ids, kind="stable")  # groups by image, keeping file order inside each
    starts = np.flatnonzero(np.r_[True, np.diff(image_ids[order]) != 0]) if n else np.zeros(0, np.int64)
    grouped = {}
    for idx in np.split(order, starts[1:]) if n else []:
        grouped[int(image_ids[idx[0]])] = CocoDetections(boxes[idx], scores[idx], category_ids[idx])
    return grouped


def load_coco_annotations(
    path: str | Path,
) -> tuple[list[dict[str, Any]], dict[int, CocoGroundTruth], list[dict[str, Any]]]:
    """Read COCO ground truth: (images with id/file_name/width/height, annotations per image id, categories).

    Every image gets an entry in the annotations dict (empty arrays when it has none). A missing ``area``
    defaults to the box's ``w * h`` and a missing ``iscrowd`` to 0.

    >>> import tempfile, os
    >>> f = os.path.join(tempfile.mkdtemp(), "gt.json")
    >>> _ = open(f, "w").write('{"images": [{"id": 5, "file_name": "a.jpg", "width": 9, "height": 9}], '
    ...     '"annotations": [{"id": 1, "image_id": 5, "category_id": 1, "bbox": [1, 1, 2, 2]}], '
    ...     '"categories": [{"id": 1, "name": "cat"}]}')
    >>> images, gt, cats = load_coco_annotations(f)
    >>> gt[5].area.tolist(), cats[0]["name"]
    ([4.0], 'cat')
    """
    data = _read_json(path)
    if not isinstance(data, dict) or not {"images", "annotations", "categories"} <= data.keys():
        raise DatasetError(f"{path}: COCO annotations need 'images', 'annotations' and 'categories' keys")
    images, categories = _coco_images(data["images"], path), _coco_categories(data["categories"], path)
    image_ids = {im["id"] for im in images}
    category_ids = {c["id"] for c in categories}
    rows: dict[int, list[tuple[list[float], int, float, bool, int]]] = {i: [] for i in image_ids}
    for i, a in enumerate(data["annotations"]):
        img, row = _coco_annotation(a, f"{path}: annotations[{i}]", image_ids, category_ids)
        rows[img].append(row)
    gts = {}
    for img, anns in rows.items():
        gts[img] = CocoGroundTruth(
            boxes_ltwh=np.array([r[0] for r in anns], np.float64).reshape(-1, 4),
            category_ids=np.array([r[1] for r in anns], np.int64),
            area=np.array([r[2] for r in anns], np.float64),
            iscrowd=np.array([r[3] for r in anns], bool),
            ids=np.array([r[4] for r in anns], np.int64),
        )
    return images, gts, categories


def _coco_images(items: Any, path: str | Path) -> list[dict[str, Any]]:
    """The ``images`` of a COCO annotation file: id (required), file_name, width and height."""
    images: list[dict[str, Any]] = []
    for i, im in enumerate(items):
        if not isinstance(im, dict) or "id" not in im:
            raise DatasetError(f"{path}: images[{i}] needs an 'id', got {im!r}")
        images.append(
            {
                "id": _int(im["id"], f"{path}: images[{i}].id"),
                "file_name": im.get("file_name", ""),
                "width": im.get("width"),
                "height": im.get("height"),
            }
        )
    return images


def _coco_categories(items: Any, path: str | Path) -> list[dict[str, Any]]:
    """The ``categories`` of a COCO annotation file: id (required) and name (the id when missing)."""
    categories: list[dict[str, Any]] = []
    for i, c in enumerate(items):
        if not isinstance(c, dict) or "id" not in c:
            raise DatasetError(f"{path}: categories[{i}] needs an 'id', got {c!r}")
        categories.append({"id": _int(c["id"], f"{path}: categories[{i}].id"), "name": str(c.get("name", c["id"]))})
    return categories


def _coco_annotation(
    a: Any, where: str, image_ids: set[int], category_ids: set[int]
) -> tuple[int, tuple[list[float], int, float, bool, int]]:
    """(image id, (box ltwh, category id, area, iscrowd, annotation id)) of one annotation, checked against the
    file's images and categories; a missing ``area`` is the box's ``w * h``, a missing ``id`` -1."""
    if not isinstance(a, dict) or not {"image_id", "category_id", "bbox"} <= a.keys():
        raise DatasetError(f"{where}: needs image_id, category_id and bbox, got {a!r}")
    img, cat = _int(a["image_id"], f"{where}.image_id"), _int(a["category_id"], f"{where}.category_id")
    if img not in image_ids:
        raise DatasetError(f"{where}: image_id {img} is not among the images")
    if cat not in category_ids:
        raise DatasetError(f"{where}: category_id {cat} is not among the categories {sorted(category_ids)}")
    box = _box(a["bbox"], f"{where}.bbox")
    area = _number(a["area"], f"{where}.area") if "area" in a else box[2] * box[3]
    ann_id = _int(a["id"], f"{where}.id") if "id" in a else -1
    return img, (box, cat, area, bool(a.get("iscrowd", 0)), ann_id)


def _read_json(path: str | Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise DatasetError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: not valid json ({e.msg} at line {e.lineno}, column {e.colno})") from None


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DatasetError(f"{where} must be an integer, got {value!r}")
    return value


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DatasetError(f"{where} must be a finite number, got {value!r}")
    return float(value)


def _box(value: Any, where: str) -> list[float]:
    if not isinstance(value, (list, tuple)) or len(value) != 4:
        raise DatasetError(f"{where} must be [x, y, w, h], got {value!r}")
    box = [_number(v, where) for v in value]
    if box[2] < 0 or box[3] < 0:
        raise DatasetError(f"{where} has a negative width or height: {value!r}")
    return box


def _first_bad(bad: np.ndarray, values: np.ndarray, message: str) -> None:
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DatasetError(message.format(i=i, v=values[i].item()))


def _np(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)
