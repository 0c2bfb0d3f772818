"""detrain.metrics against the COCO reference (pycocotools) on randomised data, plus unit cases."""

from __future__ import annotations

import contextlib
import io
import pickle

import numpy as np
import pytest

from detrain.metrics import (
    ConfusionMatrix,
    ImageStats,
    coco_box_iou,
    coco_summary,
    match_image,
    match_image_coco,
)

pycocotools = pytest.importorskip("pycocotools")
from pycocotools.coco import COCO  # noqa: E402
from pycocotools.cocoeval import COCOeval  # noqa: E402


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
            anns.append({"id": len(anns) + 1, "image_id": img_id, "category_id": c + 1, "bbox": b,
                         "area": area, "iscrowd": int(crowd)})
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
            results.append({"image_id": img_id, "category_id": c + 1, "bbox": [float(v) for v in d],
                            "score": score})
    gt = {"images": images, "annotations": anns,
          "categories": [{"id": c + 1, "name": str(c)} for c in range(nc)]}
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


def ours(gt: dict, results: list, xyxy: bool = False, shuffle_images: int | None = None) -> list[ImageStats]:
    stats = []
    for img in gt["images"]:
        g = [a for a in gt["annotations"] if a["image_id"] == img["id"]]
        d = [r for r in results if r["image_id"] == img["id"]]
        gb = np.array([a["bbox"] for a in g], np.float64).reshape(-1, 4)
        db = np.array([r["bbox"] for r in d], np.float64).reshape(-1, 4)
        args = (np.array([r["score"] for r in d]), np.array([r["category_id"] - 1 for r in d]))
        gargs = (np.array([a["category_id"] - 1 for a in g]), np.array([a["area"] for a in g]),
                 np.array([a["iscrowd"] for a in g], bool))
        if xyxy:
            db[:, 2:] += db[:, :2]
            gb[:, 2:] += gb[:, :2]
            stats.append(match_image(db, *args, gb, *gargs, image_id=img["id"]))
        else:
            stats.append(match_image_coco(db, *args, gb, *gargs, image_id=img["id"]))
    if shuffle_images is not None:
        np.random.default_rng(shuffle_images).shuffle(stats)
    return stats


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_equals_pycocotools_randomised(seed: int) -> None:
    gt, results = random_coco(seed, integer_boxes=seed >= 4)
    ev = reference(gt, results)
    m = coco_summary(ours(gt, results, shuffle_images=seed), nc=5)
    np.testing.assert_allclose(m.coco_stats(), ev.stats, rtol=0, atol=1e-6)
    # Stronger: the whole tables, not only their means.
    np.testing.assert_allclose(m.coco_precision, ev.eval["precision"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(m.coco_recall, ev.eval["recall"], rtol=0, atol=1e-12)
    for k, row in m.per_class.items():
        assert row["ap"] == pytest.approx(ev.eval["precision"][:, :, k, 0, 2].mean(), abs=1e-12)
        assert row["ap50"] == pytest.approx(ev.eval["precision"][0, :, k, 0, 2].mean(), abs=1e-12)


def test_corner_boxes_agree_with_coco_boxes() -> None:
    gt, results = random_coco(11, integer_boxes=True)
    ev = reference(gt, results)
    m = coco_summary(ours(gt, results, xyxy=True), nc=5)
    np.testing.assert_allclose(m.coco_stats(), ev.stats, rtol=0, atol=1e-6)


def test_max_dets_truncation_with_tied_scores() -> None:
    """150 detections of one class on one image: only the first 100 in stable score order count."""
    rng = np.random.default_rng(7)
    gt, results = random_coco(8, n_images=6, nc=3)
    img_id = gt["images"][0]["id"]
    for _ in range(150):
        x, y = rng.uniform(0, 600, 2)
        results.append({"image_id": img_id, "category_id": 1, "bbox": [float(x), float(y), 30.0, 30.0],
                        "score": float(np.round(rng.random(), 1))})
    gt["annotations"] += [{"id": 1000 + i, "image_id": img_id, "category_id": 1, "bbox": r["bbox"],
                           "area": 900.0, "iscrowd": 0} for i, r in enumerate(results[-150::7])]
    ev = reference(gt, results)
    m = coco_summary(ours(gt, results), nc=3)
    np.testing.assert_allclose(m.coco_stats(), ev.stats, rtol=0, atol=1e-6)


def test_empty_predictions_give_zero_not_a_crash() -> None:
    gt, _ = random_coco(3)
    m = coco_summary(ours(gt, []), nc=5)
    assert m.map == 0.0 and m.map50 == 0.0 and m.ar100 == 0.0
    assert m.precision == 0.0 and m.recall == 0.0 and m.fitness == 0.0
    assert coco_summary([], nc=5).map == -1.0  # no ground truth at all: undefined, as in the reference


def test_classes_without_ground_truth_are_excluded() -> None:
    s = match_image(np.array([[0., 0, 10, 10], [50, 50, 60, 60]]), np.array([0.9, 0.8]), np.array([0, 2]),
                    np.array([[0., 0, 10, 10]]), np.array([0]))
    m = coco_summary([s], nc=3)
    assert set(m.per_class) == {0}
    assert m.map == pytest.approx(1.0) and m.map_large == -1.0  # a 10x10 box is small
    assert m.per_class[0]["n_gt"] == 1 and m.per_class[0]["n_images"] == 1
    assert m.pr_curve.shape == (1, 101) and m.f1_curve.shape == (1, 1000)


def test_crowd_absorbs_many_detections() -> None:
    crowd = np.array([[0., 0, 100, 100]])
    dets = np.array([[0., 0, 10, 10], [20, 20, 30, 30], [0, 0, 100, 100]])
    s = match_image(dets, np.array([0.9, 0.8, 0.7]), np.zeros(3), crowd, np.array([0]),
                    gt_crowd=np.array([True]))
    assert s.matched()[:, 0, 0].all() and s.ignored()[:, 0, 0].all()
    assert coco_box_iou(np.array([[0., 0, 10, 10]]), np.array([[0., 0, 100, 100]]), np.array([True]))[0, 0] == 1.0


def test_greedy_prefers_best_free_gt_and_iou_is_exact() -> None:
    gts = np.array([[0., 0, 10, 10], [0, 0, 10, 12]])
    det = np.array([[0., 0, 10, 11]])
    s = match_image(np.concatenate([det, det]), np.array([0.9, 0.9]), np.zeros(2), gts, np.zeros(2))
    assert s.matched()[:, 0, 0].tolist() == [True, True]
    iou = coco_box_iou(np.array([[0., 0, 2, 1]]), np.array([[0., 0, 1, 1]]))
    assert iou[0, 0] == 0.5  # no +1 in widths; matches at exactly the threshold
    s = match_image_coco(np.array([[0., 0, 2, 1]]), np.array([1.0]), np.zeros(1), np.array([[0., 0, 1, 1]]),
                         np.zeros(1))
    assert s.matched()[0, 0].tolist() == [True] + [False] * 9


def test_stats_pickle_small() -> None:
    gt, results = random_coco(2)
    stats = ours(gt, results)
    back = pickle.loads(pickle.dumps(stats))
    assert coco_summary(back, 5).map == coco_summary(stats, 5).map
    assert stats[0].det_matched.dtype == np.uint8


def test_p_and_r_at_best_f1() -> None:
    # class 0: 2 gts; detections TP@0.9, FP@0.8, TP@0.3 -> best F1 at conf <= 0.3 gives P=2/3, R=1
    s = match_image(np.array([[0., 0, 10, 10], [50, 50, 60, 60], [20, 20, 30, 30]]), np.array([0.9, 0.8, 0.3]),
                    np.zeros(3), np.array([[0., 0, 10, 10], [20, 20, 30, 30]]), np.zeros(2))
    m = coco_summary([s], nc=1)
    assert m.conf <= 0.3
    assert m.precision == pytest.approx(2 / 3) and m.recall == pytest.approx(1.0)
    assert m.fitness == pytest.approx(0.1 * m.map50 + 0.9 * m.map)
    assert set(m.as_dict()) >= {"map", "map50", "map75", "ar1", "ar10", "ar100", "precision", "recall"}


def test_bad_class_ids_raise() -> None:
    s = match_image(np.array([[0., 0, 10, 10]]), np.array([0.9]), np.array([5]), np.zeros((0, 4)), np.zeros(0))
    with pytest.raises(ValueError, match="outside"):
        coco_summary([s], nc=3)


def test_confusion_matrix() -> None:
    cm = ConfusionMatrix(nc=2, conf=0.25, iou_thres=0.45)
    det = np.array([[0, 0, 10, 10, 0.9, 0], [0, 0, 10, 9, 0.8, 1], [50, 50, 60, 60, 0.7, 1],
                    [0, 0, 5, 5, 0.1, 0]])
    cm.update(det, np.array([[0, 0, 10, 10], [100, 100, 110, 110]]), np.array([0, 1]))
    # det 0 pairs with gt 0; det 1 (same place, lower IoU) and det 2 are false alarms; gt 1 is missed
    assert cm.matrix.tolist() == [[1, 0, 0], [0, 0, 2], [0, 1, 0]]
    cm.update(np.zeros((0, 6)), np.zeros((0, 4)), np.zeros(0))
    other = ConfusionMatrix(nc=2)
    other.update(np.zeros((0, 6)), np.array([[0, 0, 1, 1]]), np.array([1]))
    assert cm.merge(other).matrix[2, 1] == 2
    tp, fp = cm.tp_fp()
    assert tp.tolist() == [1, 0] and fp.tolist() == [0, 2]
    assert np.allclose(cm.normalized().sum(0), 1.0)


def test_equal_iou_goes_to_the_later_gt_as_in_the_reference() -> None:
    # The first detection overlaps both gts equally; the reference's scan keeps the later one, which
    # leaves the earlier gt for the second detection.
    gt = {"images": [{"id": 1, "width": 100, "height": 100}],
          "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 10, 10], "area": 100,
                           "iscrowd": 0},
                          {"id": 2, "image_id": 1, "category_id": 1, "bbox": [5, 0, 10, 10], "area": 100,
                           "iscrowd": 0}],
          "categories": [{"id": 1, "name": "a"}]}
    results = [{"image_id": 1, "category_id": 1, "bbox": [0, 0, 15, 10], "score": 0.9},
               {"image_id": 1, "category_id": 1, "bbox": [0, 0, 10, 10], "score": 0.8}]
    ev = reference(gt, results)
    m = coco_summary(ours(gt, results), nc=1)
    np.testing.assert_allclose(m.coco_stats(), ev.stats, rtol=0, atol=1e-6)
    assert m.map50 == pytest.approx(1.0, abs=1e-9)
