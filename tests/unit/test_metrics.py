"""detrain.metrics against the COCO reference (pycocotools) on randomised data, plus unit cases."""

from __future__ import annotations

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

pytest.importorskip("pycocotools")
from _coco_random import random_coco, reference


def ours(gt: dict, results: list, xyxy: bool = False, shuffle_images: int | None = None) -> list[ImageStats]:
    stats = []
    for img in gt["images"]:
        g = [a for a in gt["annotations"] if a["image_id"] == img["id"]]
        d = [r for r in results if r["image_id"] == img["id"]]
        gb = np.array([a["bbox"] for a in g], np.float64).reshape(-1, 4)
        db = np.array([r["bbox"] for r in d], np.float64).reshape(-1, 4)
        args = (np.array([r["score"] for r in d]), np.array([r["category_id"] - 1 for r in d]))
        gargs = (
            np.array([a["category_id"] - 1 for a in g]),
            np.array([a["area"] for a in g]),
            np.array([a["iscrowd"] for a in g], bool),
        )
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
        results.append(
            {
                "image_id": img_id,
                "category_id": 1,
                "bbox": [float(x), float(y), 30.0, 30.0],
                "score": float(np.round(rng.random(), 1)),
            }
        )
    gt["annotations"] += [
        {"id": 1000 + i, "image_id": img_id, "category_id": 1, "bbox": r["bbox"], "area": 900.0, "iscrowd": 0}
        for i, r in enumerate(results[-150::7])
    ]
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
    s = match_image(
        np.array([[0.0, 0, 10, 10], [50, 50, 60, 60]]),
        np.array([0.9, 0.8]),
        np.array([0, 2]),
        np.array([[0.0, 0, 10, 10]]),
        np.array([0]),
    )
    m = coco_summary([s], nc=3)
    assert set(m.per_class) == {0}
    assert m.map == pytest.approx(1.0) and m.map_large == -1.0  # a 10x10 box is small
    assert m.per_class[0]["n_gt"] == 1 and m.per_class[0]["n_images"] == 1
    assert m.pr_curve.shape == (1, 101) and m.f1_curve.shape == (1, 1000)


def test_crowd_absorbs_many_detections() -> None:
    crowd = np.array([[0.0, 0, 100, 100]])
    dets = np.array([[0.0, 0, 10, 10], [20, 20, 30, 30], [0, 0, 100, 100]])
    s = match_image(dets, np.array([0.9, 0.8, 0.7]), np.zeros(3), crowd, np.array([0]), gt_crowd=np.array([True]))
    assert s.matched()[:, 0, 0].all() and s.ignored()[:, 0, 0].all()
    assert coco_box_iou(np.array([[0.0, 0, 10, 10]]), np.array([[0.0, 0, 100, 100]]), np.array([True]))[0, 0] == 1.0


def test_greedy_prefers_best_free_gt_and_iou_is_exact() -> None:
    gts = np.array([[0.0, 0, 10, 10], [0, 0, 10, 12]])
    det = np.array([[0.0, 0, 10, 11]])
    s = match_image(np.concatenate([det, det]), np.array([0.9, 0.9]), np.zeros(2), gts, np.zeros(2))
    assert s.matched()[:, 0, 0].tolist() == [True, True]
    iou = coco_box_iou(np.array([[0.0, 0, 2, 1]]), np.array([[0.0, 0, 1, 1]]))
    assert iou[0, 0] == 0.5  # no +1 in widths; matches at exactly the threshold
    s = match_image_coco(
        np.array([[0.0, 0, 2, 1]]), np.array([1.0]), np.zeros(1), np.array([[0.0, 0, 1, 1]]), np.zeros(1)
    )
    assert s.matched()[0, 0].tolist() == [True] + [False] * 9


def test_stats_pickle_small() -> None:
    gt, results = random_coco(2)
    stats = ours(gt, results)
    back = pickle.loads(pickle.dumps(stats))
    assert coco_summary(back, 5).map == coco_summary(stats, 5).map
    assert stats[0].det_matched.dtype == np.uint8


def test_p_and_r_at_best_f1() -> None:
    # class 0: 2 gts; detections TP@0.9, FP@0.8, TP@0.3 -> best F1 at conf <= 0.3 gives P=2/3, R=1
    s = match_image(
        np.array([[0.0, 0, 10, 10], [50, 50, 60, 60], [20, 20, 30, 30]]),
        np.array([0.9, 0.8, 0.3]),
        np.zeros(3),
        np.array([[0.0, 0, 10, 10], [20, 20, 30, 30]]),
        np.zeros(2),
    )
    m = coco_summary([s], nc=1)
    assert m.conf <= 0.3
    assert m.precision == pytest.approx(2 / 3) and m.recall == pytest.approx(1.0)
    assert m.fitness == m.map
    assert set(m.as_dict()) >= {"map", "map50", "map75", "ar1", "ar10", "ar100", "precision", "recall"}


def test_bad_class_ids_raise() -> None:
    s = match_image(np.array([[0.0, 0, 10, 10]]), np.array([0.9]), np.array([5]), np.zeros((0, 4)), np.zeros(0))
    with pytest.raises(ValueError, match="outside"):
        coco_summary([s], nc=3)


def test_confusion_matrix() -> None:
    cm = ConfusionMatrix(nc=2, conf=0.25, iou_thres=0.45)
    det = np.array([[0, 0, 10, 10, 0.9, 0], [0, 0, 10, 9, 0.8, 1], [50, 50, 60, 60, 0.7, 1], [0, 0, 5, 5, 0.1, 0]])
    cm.update(det, np.array([[0, 0, 10, 10], [100, 100, 110, 110]]), np.array([0, 1]))
    # det 0 pairs with gt 0; det 1 (same place, lower IoU) and det 2 are false alarms; gt 1 is missed
    assert cm.matrix.tolist() == [[1, 0, 0], [0, 0, 2], [0, 1, 0]]
    cm.update(np.zeros((0, 6)), np.zeros((0, 4)), np.zeros(0))
    assert cm.matrix.tolist() == [[1, 0, 0], [0, 0, 2], [0, 1, 0]]  # an image without boxes adds nothing


def test_equal_iou_goes_to_the_later_gt_as_in_the_reference() -> None:
    # The first detection overlaps both gts equally; the reference's scan keeps the later one, which
    # leaves the earlier gt for the second detection.
    gt = {
        "images": [{"id": 1, "width": 100, "height": 100}],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 10, 10], "area": 100, "iscrowd": 0},
            {"id": 2, "image_id": 1, "category_id": 1, "bbox": [5, 0, 10, 10], "area": 100, "iscrowd": 0},
        ],
        "categories": [{"id": 1, "name": "a"}],
    }
    results = [
        {"image_id": 1, "category_id": 1, "bbox": [0, 0, 15, 10], "score": 0.9},
        {"image_id": 1, "category_id": 1, "bbox": [0, 0, 10, 10], "score": 0.8},
    ]
    ev = reference(gt, results)
    m = coco_summary(ours(gt, results), nc=1)
    np.testing.assert_allclose(m.coco_stats(), ev.stats, rtol=0, atol=1e-6)
    assert m.map50 == pytest.approx(1.0, abs=1e-9)


def test_repeated_image_ids_count_once() -> None:
    gt, results = random_coco(9)
    stats = ours(gt, results)
    assert coco_summary(stats + stats[:5], 5).coco_stats().tolist() == coco_summary(stats, 5).coco_stats().tolist()


def test_annotation_id_zero_as_in_the_reference() -> None:
    # The reference records matches by annotation id, so a match with annotation 0 reads as no match.
    gt, results = random_coco(12, n_images=8)
    for ann in gt["annotations"]:
        ann["id"] -= 1
    ev = reference(gt, results)
    stats = []
    for img in gt["images"]:
        g = [a for a in gt["annotations"] if a["image_id"] == img["id"]]
        d = [r for r in results if r["image_id"] == img["id"]]
        stats.append(
            match_image_coco(
                np.array([r["bbox"] for r in d]).reshape(-1, 4),
                np.array([r["score"] for r in d]),
                np.array([r["category_id"] - 1 for r in d]),
                np.array([a["bbox"] for a in g]).reshape(-1, 4),
                np.array([a["category_id"] - 1 for a in g]),
                np.array([a["area"] for a in g]),
                np.array([a["iscrowd"] for a in g], bool),
                image_id=img["id"],
                gt_ids=[a["id"] for a in g],
            )
        )
    np.testing.assert_allclose(coco_summary(stats, 5).coco_stats(), ev.stats, rtol=0, atol=1e-6)
