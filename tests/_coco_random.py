"""Shared test data: random COCO ground truth and detections, and pycocotools' verdict on them."""

from __future__ import annotations

import contextlib
import io

import numpy as np
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval


def random_coco(seed: int, n_images: int = 24, nc: int = 5, integer_boxes: bool = False) -> tuple[dict, list]:
    """A COCO ground-truth dict and a results list with the awkward cases the reference must agree on."""
    rng = np.random.default_rng(seed)
    images, anns, results = [], [], []
    ids = rng.permutation(np.arange(1, 4 * n_images, 4))[:n_images]  # sparse, listed out of order

    def box(kind: str) -> list[float]:
        size = {"tiny": (0.5, 12), "mid": (20, 120), "huge": (150, 600)}[kind]
        w, h = rng.uniform(*size, 2)
        x, y = rng.uniform(0, 640, 2)
        b = [x, y, w, h]
        return [float(np.round(v)) if integer_boxes else float(v) for v in b]

    for img_id in ids.tolist():
        images.append({"id": img_id, "width": 640, "height": 640, "file_name": f"{img_id}.jpg"})
        gts = []
        for _ in range(rng.choice([0, 1, 3, 6, 9])):
            b = box(rng.choice(["tiny", "mid", "huge"], p=[0.3, 0.4, 0.3]))
            gts.append((b, int(rng.integers(nc)), bool(rng.random() < 0.12)))
        if gts and rng.random() < 0.3:  # an exact duplicate ground truth
            gts.append(gts[int(rng.integers(len(gts)))])
        for b, c, crowd in gts:
            # COCO's area comes from the mask, so it differs from the box's w * h
            area = b[2] * b[3] * (1.0 if integer_boxes else float(rng.uniform(0.4, 1.0)))
            anns.append(
                {
                    "id": len(anns) + 1,
                    "image_id": img_id,
                    "category_id": c + 1,
                    "bbox": b,
                    "area": area,
                    "iscrowd": int(crowd),
                }
            )
        if rng.random() < 0.15:
            continue  # an image without detections
        dets = []
        for b, c, _ in gts:
            for _ in range(int(rng.integers(0, 4))):
                jitter = rng.normal(0, 0.08, 4) * np.array([b[2], b[3], b[2], b[3]])
                d = [b[0] + jitter[0], b[1] + jitter[1], max(b[2] + jitter[2], 0.1), max(b[3] + jitter[3], 0.1)]
                if integer_boxes:
                    d = [float(np.round(v)) for v in d]
                    d[2], d[3] = max(d[2], 1.0), max(d[3], 1.0)
                cls = c if rng.random() < 0.8 else int(rng.integers(nc))
                dets.append((d, cls))
        for _ in range(int(rng.integers(0, 6))):
            dets.append((box(rng.choice(["tiny", "mid", "huge"])), int(rng.integers(nc))))
        if dets and rng.random() < 0.3:  # an exact duplicate detection
            dets.append(dets[int(rng.integers(len(dets)))])
        for d, c in dets:
            score = float(np.round(rng.random(), 1))  # coarse scores: many ties
            results.append({"image_id": img_id, "category_id": c + 1, "bbox": [float(v) for v in d], "score": score})
    gt = {"images": images, "annotations": anns, "categories": [{"id": c + 1, "name": str(c)} for c in range(nc)]}
    return gt, results


def reference(gt: dict, results: list) -> COCOeval:
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = gt
        coco_gt.createIndex()
        coco_dt = coco_gt.loadRes(results)
        ev = COCOeval(coco_gt, coco_dt, "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev
