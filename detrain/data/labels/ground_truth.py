"""Ground truth and COCO ids of a dataset split, shared by the validator, ``predictions.json`` and scoring a file.

Every image of a split gets an :class:`ImageGT`: its COCO image id and its boxes in the pixels of the file on
disk, as ``[x_min, y_min, w, h]`` float64 with area, crowd flags and annotation ids. Where they come from:

* a COCO annotation json, when the split was given as one in the dataset yaml, or when
  ``<path>/annotations/instances_<split folder>.json`` exists beside YOLO labels and covers every image of the
  split with matching categories (``DatasetInfo.coco_json``). Then the json's own image and category ids are
  used, crowd boxes are ignored the COCO way and the json's ``area`` decides small/medium/large: the numbers
  are those of pycocotools on the same file.
* otherwise the YOLO labels, mapped to pixels with each image's verified size. Image ids are the file stems
  when every stem is a distinct number (``000000000139.jpg`` -> 139), else the image's position in the
  split's sorted file list. Category ids are COCO's 91-id numbering for the full COCO dataset in the YOLO
  layout, else class index + 1 (so also for the COCO subsets coco8 and coco128, as YOLOv8 writes them).
  "The full COCO dataset" (:func:`is_full_coco`) means: the 80 COCO class names in COCO order, and the
  yaml is named ``coco.yaml`` or the split is one of COCO's own image lists (``train2017.txt``,
  ``val2017.txt``, ``test-dev2017.txt``, as ``datasets/coco.yaml`` has them; coco128's image *folder*
  ``train2017`` is not).

>>> g = yolo_image_gt("a/7.jpg", (100, 200), np.array([0]), np.array([[0.5, 0.5, 0.5, 0.2]]), image_id=7)
>>> g.boxes_ltwh.tolist(), g.area.tolist()
([[50.0, 40.0, 100.0, 20.0]], [2000.0])
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from detrain.errors import DatasetError
from detrain.metrics.coco_json import COCO80_TO_91, load_coco_annotations

# The 80 class names of COCO in the order of the YOLO layout.
COCO80_NAMES: tuple[str, ...] = (
    "person",
    "bicycle",
    "car",
    "motorcycle",
    "airplane",
    "bus",
    "train",
    "truck",
    "boat",
    "traffic light",
    "fire hydrant",
    "stop sign",
    "parking meter",
    "bench",
    "bird",
    "cat",
    "dog",
    "horse",
    "sheep",
    "cow",
    "elephant",
    "bear",
    "zebra",
    "giraffe",
    "backpack",
    "umbrella",
    "handbag",
    "tie",
    "suitcase",
    "frisbee",
    "skis",
    "snowboard",
    "sports ball",
    "kite",
    "baseball bat",
    "baseball glove",
    "skateboard",
    "surfboard",
    "tennis racket",
    "bottle",
    "wine glass",
    "cup",
    "fork",
    "knife",
    "spoon",
    "bowl",
    "banana",
    "apple",
    "sandwich",
    "orange",
    "broccoli",
    "carrot",
    "hot dog",
    "pizza",
    "donut",
    "cake",
    "chair",
    "couch",
    "potted plant",
    "bed",
    "dining table",
    "toilet",
    "tv",
    "laptop",
    "mouse",
    "remote",
    "keyboard",
    "cell phone",
    "microwave",
    "oven",
    "toaster",
    "sink",
    "refrigerator",
    "book",
    "clock",
    "vase",
    "scissors",
    "teddy bear",
    "hair drier",
    "toothbrush",
)


def ltwh2xyxy(ltwh: np.ndarray) -> np.ndarray:
    """COCO ``[x_min, y_min, w, h]`` boxes (n, 4) -> corner boxes.

    >>> ltwh2xyxy(np.array([[1.0, 2, 3, 4]])).tolist()
    [[1.0, 2.0, 4.0, 6.0]]
    """
    return np.concatenate((ltwh[:, :2], ltwh[:, :2] + ltwh[:, 2:]), 1)


@dataclass
class ImageGT:
    """One image's ground truth in the pixels of the file on disk (what COCO evaluation compares against)."""

    image_id: int
    boxes_ltwh: np.ndarray  # (m, 4) float64 x_min, y_min, w, h
    cls: np.ndarray  # (m,) int64 class index
    area: np.ndarray  # (m,) float64, what the size ranges use
    crowd: np.ndarray  # (m,) bool
    ann_ids: np.ndarray | None = None  # (m,) int64 annotation ids of a json (None: YOLO labels)

    def boxes_xyxy(self) -> np.ndarray:
        """(m, 4) corner boxes."""
        return ltwh2xyxy(self.boxes_ltwh)


@dataclass
class SplitGT:
    """The ground truth of every image of a split and the category id written for each class."""

    images: dict[str, ImageGT]  # by image path, as in the records
    category_ids: np.ndarray  # (nc,) int64: the COCO category id of class k
    source: str  # "YOLO labels" or the annotation json's path
    json_file: str | None = None

    def all_image_ids(self) -> list[int]:
        """Every image id of the split."""
        return [g.image_id for g in self.images.values()]

    def class_of(self) -> dict[int, int]:
        """COCO category id -> class index."""
        return {int(c): k for k, c in enumerate(self.category_ids.tolist())}


def image_ids(im_files: Sequence[str]) -> dict[str, int]:
    """COCO image ids for YOLO-layout data: the files' numbers when every stem is a distinct number
    (000000000036.jpg -> 36), else the position in the split's sorted file list (stable, the same on every rank).

    >>> image_ids(["a/000000000036.jpg", "a/000000000042.jpg"])
    {'a/000000000036.jpg': 36, 'a/000000000042.jpg': 42}
    >>> image_ids(["b/x.jpg", "a/y.jpg"])
    {'a/y.jpg': 0, 'b/x.jpg': 1}
    """
    files = sorted(im_files)
    stems = [Path(f).stem for f in files]
    if stems and all(s.isdigit() for s in stems) and len({int(s) for s in stems}) == len(stems):
        return {f: int(s) for f, s in zip(files, stems)}
    return {f: i for i, f in enumerate(files)}


def is_coco80(names: Mapping[int, str]) -> bool:
    """Whether ``names`` are COCO's 80 classes in COCO order (the YOLO layout of COCO).

    >>> is_coco80(dict(enumerate(COCO80_NAMES))), is_coco80({0: "cat"})
    (True, False)
    """
    return len(names) == len(COCO80_NAMES) and all(names.get(k) == n for k, n in enumerate(COCO80_NAMES))


COCO_SPLITS = frozenset({"train2017", "val2017", "test2017", "test-dev2017"})


def is_full_coco(info: Any, split: str) -> bool:
    """Whether ``info`` (a ``DatasetInfo``) is the full COCO dataset in the YOLO layout (see the module doc).

    >>> from types import SimpleNamespace as NS
    >>> coco = dict(enumerate(COCO80_NAMES))
    >>> is_full_coco(NS(names=coco, yaml_file=Path("coco.yaml"), raw={}), "val")
    True
    >>> is_full_coco(NS(names=coco, yaml_file=Path("my.yaml"), raw={"val": "val2017.txt"}), "val")
    True
    >>> is_full_coco(NS(names=coco, yaml_file=Path("coco128.yaml"), raw={"val": "images/train2017"}), "val")
    False
    """
    if not is_coco80(info.names):
        return False
    if Path(str(info.yaml_file)).name == "coco.yaml":
        return True
    raw = info.raw if isinstance(getattr(info, "raw", None), dict) else {}
    entries = raw.get(split)
    entries = entries if isinstance(entries, list) else [entries]
    return any(
        e is not None and Path(str(e).strip()).suffix == ".txt" and Path(str(e).strip()).stem in COCO_SPLITS
        for e in entries
    )


def yolo_category_ids(names: Mapping[int, str], full_coco: bool = False) -> np.ndarray:
    """Category id per class for YOLO-layout data: COCO's 91 ids for the full COCO dataset, else class + 1.

    >>> yolo_category_ids({0: "a", 1: "b"}).tolist()
    [1, 2]
    """
    if full_coco:
        if not is_coco80(names):
            raise ValueError("the 91-id COCO categories need the 80 COCO class names")
        return np.array(COCO80_TO_91, np.int64)
    return np.arange(1, len(names) + 1, dtype=np.int64)


def yolo_image_gt(im_file: str, shape_hw: Sequence[int], cls: Any, bboxes_xywhn: Any, image_id: int) -> ImageGT:
    """YOLO labels (normalised centre boxes) of one image in its original pixels."""
    h0, w0 = float(shape_hw[0]), float(shape_hw[1])
    b = np.asarray(bboxes_xywhn, np.float64).reshape(-1, 4)
    scale = np.array([w0, h0, w0, h0])
    wh = b[:, 2:] * scale[2:]
    ltwh = np.concatenate(((b[:, :2] - b[:, 2:] / 2) * scale[:2], wh), 1)
    return ImageGT(
        int(image_id), ltwh, np.asarray(cls, np.int64).reshape(-1), wh[:, 0] * wh[:, 1], np.zeros(len(b), bool)
    )


def yolo_split_gt(records: Sequence[Any], names: Mapping[int, str], full_coco: bool = False) -> SplitGT:
    """Ground truth of a split from its YOLO label records."""
    ids = image_ids([r.im_file for r in records])
    images = {r.im_file: yolo_image_gt(r.im_file, r.shape_hw, r.cls, r.bboxes_xywhn, ids[r.im_file]) for r in records}
    return SplitGT(images, yolo_category_ids(names, full_coco), "YOLO labels")


def explicit_json(info: Any, split: str) -> str | None:
    """The annotation json the yaml gave as ``split`` itself (not one found beside YOLO labels)."""
    json_file = (info.coco_json or {}).get(split) if getattr(info, "coco_json", None) else None
    entries = info.raw.get(split) if isinstance(getattr(info, "raw", None), dict) else None
    entries = entries if isinstance(entries, list) else [entries]
    explicit = any(str(e).strip().lower().endswith(".json") for e in entries if e is not None)
    return json_file if explicit else None


def json_split_gt(json_file: str, records: Sequence[Any], names: Mapping[int, str]) -> SplitGT:
    """Ground truth of a split from a COCO annotation json; raises :class:`DatasetError` when the json does not
    describe these images or classes (an image of the split missing from it, categories that fit no class)."""
    images, gts, categories = load_coco_annotations(json_file)
    category_ids = _category_ids(categories, names, json_file)
    index: dict[str, dict[str, Any]] = {}
    for image in images:
        key = _norm(str(image["file_name"]))
        if key:
            index.setdefault(key, image)
    depths = sorted({k.count("/") + 1 for k in index}, reverse=True)
    class_of = {int(c): k for k, c in enumerate(category_ids.tolist())}
    out: dict[str, ImageGT] = {}
    used: dict[int, str] = {}
    for r in records:
        im = _lookup(r.im_file, index, depths)
        if im is None:
            raise DatasetError(
                f"{json_file}: no entry in 'images' for {r.im_file} (file_name is matched against "
                "the end of the image path)"
            )
        if im["id"] in used:
            raise DatasetError(f"{json_file}: image id {im['id']} matches both {used[im['id']]} and {r.im_file}")
        used[im["id"]] = r.im_file
        g = gts[im["id"]]
        out[r.im_file] = ImageGT(
            im["id"],
            g.boxes_ltwh,
            np.array([class_of[int(c)] for c in g.category_ids], np.int64),
            g.area,
            g.iscrowd,
            g.ids,
        )
    return SplitGT(out, category_ids, f"annotations {json_file}", json_file=json_file)


def split_ground_truth(data: Any) -> SplitGT:
    """The ground truth of a ``SplitData`` (computed once and kept on it).

    A split given as a json uses it; a json found beside YOLO labels is used when it fits the split (else the
    YOLO labels, with a note saying why).
    """
    cached = getattr(data, "ground_truth", None)
    if cached is not None:
        return cached
    info, records, names = data.info, data.records, dict(data.info.names)
    # classes= and single_cls= (``class_filter.py``): the records hold only the labels kept, a json all of them
    selection = getattr(data, "class_filter", None)
    json_file = (getattr(info, "coco_json", None) or {}).get(data.split)
    gt: SplitGT | None = None
    if json_file and explicit_json(info, data.split):
        gt = json_split_gt(json_file, records, names)
    elif json_file:
        try:
            gt = json_split_gt(json_file, records, names)
        except DatasetError as e:
            _note(f"evaluating against the YOLO labels, not {json_file}: {e}")
    if gt is not None and selection is not None:
        gt = selection.ground_truth(gt)
    if gt is None:
        gt = yolo_split_gt(records, names, is_full_coco(info, data.split))
        if selection is not None:
            gt.category_ids = selection.category_ids(gt.category_ids)
    with contextlib.suppress(AttributeError):  # a read-only stand-in: compute again next time
        data.ground_truth = gt
    return gt


def json_labels(records: Sequence[Any], gt: SplitGT, json_file: str) -> tuple[list[Any], str]:
    """Records whose boxes are the json's non-crowd annotations (normalised to each image's verified size), for
    training on a split given as a COCO json; and a line for the log."""
    from detrain.data.labels.verify import LabelRecord

    out, n_boxes, n_crowd, n_mismatch = [], 0, 0, 0
    for r in records:
        g = gt.images[r.im_file]
        h0, w0 = (float(v) for v in r.shape_hw)
        keep = ~g.crowd & (g.boxes_ltwh[:, 2] > 0) & (g.boxes_ltwh[:, 3] > 0)
        n_crowd += int(g.crowd.sum())
        xyxy = g.boxes_xyxy()[keep]
        if len(xyxy) and (xyxy[:, 2].max() > w0 + 1 or xyxy[:, 3].max() > h0 + 1):
            n_mismatch += 1
        xyxy = np.clip(xyxy, 0, [w0, h0, w0, h0])
        xywhn = np.concatenate(((xyxy[:, :2] + xyxy[:, 2:]) / 2, xyxy[:, 2:] - xyxy[:, :2]), 1) / [w0, h0, w0, h0]
        ok = (xywhn[:, 2] > 0) & (xywhn[:, 3] > 0)
        out.append(
            LabelRecord(r.im_file, tuple(r.shape_hw), g.cls[keep][ok].astype(np.int64), xywhn[ok].astype(np.float32))
        )
        n_boxes += int(ok.sum())
    line = f"{len(out)} images, {n_boxes} boxes from {json_file} ({n_crowd} crowd boxes used only in evaluation)"
    if n_mismatch:
        line += f"; {n_mismatch} images have boxes beyond their size (rotated by EXIF?), clipped"
    return out, line


def _category_ids(categories: list[dict[str, Any]], names: Mapping[int, str], json_file: str) -> np.ndarray:
    """The json category id of each class: by name when the json's names are the dataset's, else the k-th id in
    ascending order when the counts agree."""
    nc = len(names)
    by_name = {str(c["name"]): int(c["id"]) for c in categories}
    if len(by_name) == len(categories) == nc and set(by_name) == {str(n) for n in names.values()}:
        return np.array([by_name[str(names[k])] for k in range(nc)], np.int64)
    if len(categories) == nc:
        _note(f"{json_file}: category names differ from the dataset's names; class k is the k-th category id")
        return np.array(sorted(int(c["id"]) for c in categories), np.int64)
    raise DatasetError(
        f"{json_file}: {len(categories)} categories but the dataset yaml names {nc} classes; "
        "list the json's categories under names: (in ascending id order)"
    )


def _norm(path: str) -> str:
    parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".")]
    return "/".join(parts)


def _lookup(im_file: str, index: dict[str, dict[str, Any]], depths: list[int]) -> dict[str, Any] | None:
    parts = _norm(os.fspath(im_file)).split("/")
    for d in depths:
        if d <= len(parts):
            hit = index.get("/".join(parts[-d:]))
            if hit is not None:
                return hit
    return None


def _note(message: str) -> None:
    from detrain.distributed import dist
    from detrain.log import console

    if dist.is_main():
        console.print(f"note: {message}")
