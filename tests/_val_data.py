"""A tiny generated detection dataset and a model that "sees" it, for the validator tests.

Each image is dark with at most one solid rectangle per colour (red, green, blue = classes 0, 1, 2), saved as
PNG with YOLO labels. :class:`ColourModel` finds each colour's rectangle in its input and returns it as a
detection, plus one low-scoring false alarm, so validation exercises letterboxing and the way back with a
known, high mAP.
"""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import torch
from torch import nn

NAMES = ["red", "green", "blue"]
SIZES = [(48, 64), (64, 48), (64, 64), (40, 56), (56, 40), (72, 48)]  # (h, w)


def _draw(rng: np.random.Generator, h: int, w: int) -> tuple[np.ndarray, list[tuple[int, int, int, int, int]]]:
    img = np.full((h, w, 3), 20, np.uint8)
    boxes = []
    for c in rng.permutation(3)[: int(rng.integers(1, 4))].tolist():
        bw, bh = int(rng.integers(w // 4, w // 2)), int(rng.integers(h // 4, h // 2))
        x1, y1 = int(rng.integers(0, w - bw)), int(rng.integers(0, h - bh))
        if any(not (x1 + bw <= b[0] or b[2] <= x1 or y1 + bh <= b[1] or b[3] <= y1) for b in boxes):
            continue  # keep rectangles apart so each colour stays one solid block
        bgr = [0, 0, 0]
        bgr[2 - c] = 255
        img[y1 : y1 + bh, x1 : x1 + bw] = bgr
        boxes.append((x1, y1, x1 + bw, y1 + bh, c))
    return img, boxes


def make_dataset(root: Path, n_val: int = 10, n_train: int = 4, numeric: bool = True, seed: int = 0) -> Path:
    """YOLO layout under ``root`` (images/{train,val}, labels/{train,val}) and its ``data.yaml``."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("val", n_val)):
        for i in range(n):
            h, w = SIZES[i % len(SIZES)]
            img, boxes = _draw(rng, h, w)
            stem = f"{100 + 7 * i:012d}" if numeric else f"img_{split}_{i}"
            im = root / "images" / split / f"{stem}.png"
            im.parent.mkdir(parents=True, exist_ok=True)
            cv2.imwrite(str(im), img)
            lb = root / "labels" / split / f"{stem}.txt"
            lb.parent.mkdir(parents=True, exist_ok=True)
            lb.write_text(
                "".join(
                    f"{c} {(x1 + x2) / 2 / w:.6f} {(y1 + y2) / 2 / h:.6f} {(x2 - x1) / w:.6f} {(y2 - y1) / h:.6f}\n"
                    for x1, y1, x2, y2, c in boxes
                )
            )
    yaml_file = root / "data.yaml"
    yaml_file.write_text(f"path: {root}\ntrain: images/train\nval: images/val\nnames: {NAMES}\n")
    return yaml_file


def make_coco_json_dataset(root: Path, n_val: int = 8, seed: int = 1) -> Path:
    """The same kind of images described by a COCO annotation json (ids of its own, one crowd box) and a yaml
    whose ``val`` is that json."""
    rng = np.random.default_rng(seed)
    images, annotations = [], []
    cat_ids = [3, 7, 11]  # not 1..3, so a wrong id mapping shows
    for i in range(n_val):
        h, w = SIZES[i % len(SIZES)]
        img, boxes = _draw(rng, h, w)
        name = f"pic{i}.png"
        path = root / "images" / "val" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(path), img)
        image_id = 500 + 3 * i
        images.append({"id": image_id, "file_name": name, "width": w, "height": h})
        for x1, y1, x2, y2, c in boxes:
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": cat_ids[c],
                    "bbox": [x1, y1, x2 - x1, y2 - y1],
                    "area": float((x2 - x1) * (y2 - y1)),
                    "iscrowd": 0,
                }
            )
    annotations[0]["iscrowd"] = 1
    doc = {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": cid, "name": n} for cid, n in zip(cat_ids, NAMES)],
    }
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    (root / "annotations" / "instances_val.json").write_text(json.dumps(doc))
    yaml_file = root / "coco_json.yaml"
    yaml_file.write_text(
        f"path: {root}\ntrain: annotations/instances_val.json\nval: annotations/instances_val.json\nnames: {NAMES}\n"
    )
    return yaml_file


class ColourModel(nn.Module):
    """(B, 3, H, W) in [0, 1] -> (B, 4 + 3, 4): per colour the xywh box of its pixels (score 0.9 where any,
    else 0), then a false alarm of class 0 with score 0.05 in the top-left corner."""

    nc = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        out = torch.zeros(b, 7, 4)
        for i in range(b):
            for c in range(3):
                others = [k for k in range(3) if k != c]
                mask = (x[i, c] > 0.5) & (x[i, others[0]] < 0.5) & (x[i, others[1]] < 0.5)
                ys, xs = torch.nonzero(mask, as_tuple=True)
                if len(xs):
                    x1, y1, x2, y2 = xs.min().float(), ys.min().float(), xs.max().float() + 1, ys.max().float() + 1
                    out[i, :4, c] = torch.stack(((x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1))
                    out[i, 4 + c, c] = 0.9
            out[i, :4, 3] = torch.tensor([4.0, 4.0, 8.0, 8.0])
            out[i, 4, 3] = 0.05
        return out
