"""Time detrain's COCO metrics against pycocotools on the same synthetic detections.

    python scripts/bench_val.py --images 5000      # 5,000 images x 100 detections x 80 classes
    python scripts/bench_val.py --images 500       # a quicker look

Ground truth is ~7 boxes per image (some crowds); detections are jittered copies of the ground truth
(mostly the right class) topped up with background boxes to 100 per image. pycocotools' COCO objects
are built before its clock starts; its evaluate() + accumulate() is timed against detrain's
match_image (per image) + coco_summary, and against coco_summary alone (accumulation from matched
statistics, which is what the validator runs after gathering ranks' statistics).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time

import numpy as np

from detrain.metrics import coco_summary, match_image_coco


def synthetic(n_images: int, nc: int, dets_per_image: int, seed: int) -> list[tuple[int, dict, dict]]:
    """Per image (image_id, gt dict, det dict) with COCO ltwh boxes."""
    rng = np.random.default_rng(seed)
    images = []
    for img_id in range(1, n_images + 1):
        m = int(rng.poisson(7))
        wh = np.exp(rng.uniform(np.log(4), np.log(500), (m, 2)))
        xy = rng.uniform(0, 640, (m, 2)) - wh / 2
        gt_box = np.concatenate((xy, wh), 1)
        gt_cls = rng.integers(0, nc, m)
        gt = {
            "box": gt_box,
            "cls": gt_cls,
            "area": wh.prod(1) * rng.uniform(0.5, 1.0, m),
            "crowd": rng.random(m) < 0.02,
        }
        near = np.repeat(np.arange(m), rng.integers(1, 8, m))[:dets_per_image]
        jitter = rng.normal(0, 0.1, (len(near), 4)) * np.repeat(gt_box[near, 2:], 2, 1)
        d_near = gt_box[near] + jitter
        d_near[:, 2:] = np.abs(d_near[:, 2:]) + 1
        c_near = np.where(rng.random(len(near)) < 0.85, gt_cls[near], rng.integers(0, nc, len(near)))
        k = dets_per_image - len(near)
        wh_bg = np.exp(rng.uniform(np.log(4), np.log(400), (k, 2)))
        d_bg = np.concatenate((rng.uniform(0, 640, (k, 2)), wh_bg), 1)
        det = {
            "box": np.concatenate((d_near, d_bg)),
            "cls": np.concatenate((c_near, rng.integers(0, nc, k))),
            "score": np.round(np.concatenate((rng.uniform(0.2, 1, len(near)), rng.uniform(0, 0.6, k))), 5),
        }
        images.append((img_id, gt, det))
    return images


def to_pycocotools(images: list, nc: int):  # returns pycocotools objects (untyped)
    from pycocotools.coco import COCO

    anns, results = [], []
    for img_id, gt, det in images:
        for b, c, a, crowd in zip(gt["box"].tolist(), gt["cls"].tolist(), gt["area"].tolist(), gt["crowd"].tolist()):
            anns.append(
                {
                    "id": len(anns) + 1,
                    "image_id": img_id,
                    "category_id": c + 1,
                    "bbox": b,
                    "area": a,
                    "iscrowd": int(crowd),
                }
            )
        for b, c, s in zip(det["box"].tolist(), det["cls"].tolist(), det["score"].tolist()):
            results.append({"image_id": img_id, "category_id": c + 1, "bbox": b, "score": s})
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = {
            "images": [{"id": i} for i, _, _ in images],
            "annotations": anns,
            "categories": [{"id": c + 1} for c in range(nc)],
        }
        coco_gt.createIndex()
        coco_dt = coco_gt.loadRes(results)
    return coco_gt, coco_dt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--dets", type=int, default=100, help="detections per image")
    parser.add_argument("--classes", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from pycocotools.cocoeval import COCOeval

    images = synthetic(args.images, args.classes, args.dets, args.seed)
    coco_gt, coco_dt = to_pycocotools(images, args.classes)

    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        ev = COCOeval(coco_gt, coco_dt, "bbox")
        ev.evaluate()
        ev.accumulate()
    t_ref = time.perf_counter() - t0
    with contextlib.redirect_stdout(io.StringIO()):
        ev.summarize()

    t0 = time.perf_counter()
    stats = [
        match_image_coco(d["box"], d["score"], d["cls"], g["box"], g["cls"], g["area"], g["crowd"], image_id=i)
        for i, g, d in images
    ]
    t_match = time.perf_counter() - t0
    t0 = time.perf_counter()
    metrics = coco_summary(stats, args.classes)
    t_acc = time.perf_counter() - t0

    worst = float(np.abs(metrics.coco_stats() - ev.stats).max())
    n_gt = sum(len(g["cls"]) for _, g, _ in images)
    print(f"{args.images} images, {args.dets} detections each, {args.classes} classes, {n_gt} ground truth boxes")
    print(
        f"mAP50-95 pycocotools {ev.stats[0]:.6f}  detrain {metrics.map:.6f}  "
        f"largest difference over the 12 COCO values {worst:.1e}"
    )
    print()
    print(f"| {'what':<52} | {'seconds':>8} | {'pycocotools / this':>18} |")
    print(f"|{'-' * 54}|{'-' * 10}|{'-' * 20}|")
    rows = [
        ("pycocotools evaluate() + accumulate()", t_ref),
        ("detrain match_image (all images) + coco_summary", t_match + t_acc),
        ("detrain coco_summary from matched stats", t_acc),
    ]
    for what, t in rows:
        print(f"| {what:<52} | {t:8.2f} | {t_ref / t:17.1f}x |")
    if worst > 1e-6:
        raise SystemExit(f"detrain and pycocotools disagree by {worst}")


if __name__ == "__main__":
    main()
