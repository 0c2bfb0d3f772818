"""COCO json helpers: strict reading, and scoring what they read equal to pycocotools."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from detrain.errors import DatasetError
from detrain.metrics import DetMetrics, coco_summary, match_image_coco
from detrain.metrics.coco_json import COCO80_TO_91, CocoDetections, load_coco_annotations, load_predictions

REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "data" / "reference"


def evaluate_coco_json(gt_path: str | Path, predictions_path: str | Path, max_dets: int = 100) -> DetMetrics:
    """Score a COCO results file against COCO ground truth with detrain's matching (class ``k`` is the k-th
    category id in ascending order): what pycocotools' ``stats`` are compared with."""
    _images, gts, categories = load_coco_annotations(gt_path)
    cat_ids = np.array(sorted(c["id"] for c in categories), np.int64)
    preds = load_predictions(predictions_path, gts.keys(), cat_ids.tolist())
    empty = CocoDetections(np.zeros((0, 4)), np.zeros(0), np.zeros(0, np.int64))
    stats = []
    for img in sorted(gts):
        g, d = gts[img], preds.get(img, empty)
        det_cls, gt_cls = np.searchsorted(cat_ids, d.category_ids), np.searchsorted(cat_ids, g.category_ids)
        stats.append(
            match_image_coco(
                d.boxes_ltwh,
                d.scores,
                det_cls,
                g.boxes_ltwh,
                gt_cls,
                g.area,
                g.iscrowd,
                max_dets,
                image_id=img,
                gt_ids=g.ids,
            )
        )
    return coco_summary(stats, nc=len(cat_ids))


def test_coco80_to_91() -> None:
    assert len(COCO80_TO_91) == 80 and len(set(COCO80_TO_91)) == 80
    assert list(COCO80_TO_91) == sorted(COCO80_TO_91)
    assert COCO80_TO_91[0] == 1 and COCO80_TO_91[11] == 13 and COCO80_TO_91[-1] == 90


def write(tmp_path: Path, name: str, payload: object) -> Path:
    path = tmp_path / name
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return path


def good(**changes: object) -> dict:
    row = {"image_id": 1, "category_id": 3, "bbox": [0, 0, 5, 5], "score": 0.5}
    row.update(changes)
    return row


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (good(image_id=9), "detection 1: unknown image_id 9"),
        (good(category_id=4), "detection 1: unknown category_id 4"),
        (good(bbox=[0, 0, float("nan"), 5]), "detection 1: bbox must be a finite number"),
        (good(bbox=[0, 0, -1, 5]), "detection 1: bbox has a negative width"),
        (good(bbox=[0, 0, 5]), r"detection 1: bbox must be \[x, y, w, h\]"),
        (good(score=float("nan")), "detection 1: score must be a finite number"),
        (good(score="high"), "detection 1: score must be a finite number"),
        (good(image_id="1"), "detection 1: image_id must be an integer"),
        ({"image_id": 1, "bbox": [0, 0, 1, 1], "score": 0.1}, "detection 1: expected an object"),
    ],
)
def test_load_predictions_names_the_first_bad_entry(tmp_path: Path, bad: dict, message: str) -> None:
    path = write(tmp_path, "p.json", [good(), bad, bad])
    with pytest.raises(DatasetError, match=message):
        load_predictions(path, {1, 2}, {3})


def test_load_predictions_file_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="not found"):
        load_predictions(tmp_path / "missing.json", {1}, {1})
    with pytest.raises(DatasetError, match="not valid json"):
        load_predictions(write(tmp_path, "a.json", "[{"), {1}, {1})
    with pytest.raises(DatasetError, match="json list"):
        load_predictions(write(tmp_path, "b.json", {"image_id": 1}), {1}, {1})


def test_load_predictions_groups_by_image_in_file_order(tmp_path: Path) -> None:
    rows = [good(image_id=2, score=0.1), good(score=0.2), good(image_id=2, score=0.3), good(score=0.4)]
    grouped = load_predictions(write(tmp_path, "p.json", rows), {1, 2}, {3})
    assert grouped[1].scores.tolist() == [0.2, 0.4] and grouped[2].scores.tolist() == [0.1, 0.3]
    assert grouped[2].boxes_ltwh.shape == (2, 4) and grouped[2].category_ids.tolist() == [3, 3]
    assert load_predictions(write(tmp_path, "e.json", []), {1}, {3}) == {}


def test_load_coco_annotations(tmp_path: Path) -> None:
    gt = {
        "images": [{"id": 3, "file_name": "a.jpg", "width": 10, "height": 20}, {"id": 4}],
        "annotations": [
            {"id": 1, "image_id": 3, "category_id": 5, "bbox": [1, 2, 3, 4], "area": 7.5, "iscrowd": 1},
            {"id": 2, "image_id": 3, "category_id": 5, "bbox": [0, 0, 2, 2]},
        ],
        "categories": [{"id": 5, "name": "dog"}],
    }
    images, gts, cats = load_coco_annotations(write(tmp_path, "gt.json", gt))
    assert images[0] == {"id": 3, "file_name": "a.jpg", "width": 10, "height": 20}
    assert gts[3].area.tolist() == [7.5, 4.0] and gts[3].iscrowd.tolist() == [True, False]
    assert len(gts[4].category_ids) == 0 and gts[4].boxes_ltwh.shape == (0, 4)
    assert cats == [{"id": 5, "name": "dog"}]
    gt["annotations"][1]["category_id"] = 6
    with pytest.raises(DatasetError, match=r"annotations\[1\]: category_id 6"):
        load_coco_annotations(write(tmp_path, "bad.json", gt))
    with pytest.raises(DatasetError, match="'images', 'annotations' and 'categories'"):
        load_coco_annotations(write(tmp_path, "worse.json", {"images": []}))


@pytest.mark.parametrize("seed", [20, 21])
def test_evaluate_coco_json_equals_pycocotools(tmp_path: Path, seed: int) -> None:
    pytest.importorskip("pycocotools")
    from _coco_random import random_coco, reference

    gt, results = random_coco(seed)
    # category ids with gaps, as in real COCO
    for row in gt["annotations"] + results:
        row["category_id"] = COCO80_TO_91[row["category_id"] * 7]
    for cat in gt["categories"]:
        cat["id"] = COCO80_TO_91[cat["id"] * 7]
    ev = reference(gt, results)
    m = evaluate_coco_json(write(tmp_path, "gt.json", gt), write(tmp_path, "dt.json", results))
    np.testing.assert_allclose(m.coco_stats(), ev.stats, rtol=0, atol=1e-6)


@pytest.mark.skipif(not REFERENCE.is_dir(), reason="shared reference data not present")
@pytest.mark.parametrize(
    ("name", "gt_file"), [("coco8_val", "coco8_val_gt_coco.json"), ("coco128", "coco128_gt_coco.json")]
)
def test_reference_yolov8n_predictions(name: str, gt_file: str) -> None:
    expected = json.loads((REFERENCE / f"yolov8n_{name}_pycocotools.json").read_text())
    m = evaluate_coco_json(REFERENCE / gt_file, REFERENCE / f"yolov8n_{name}_predictions.json")
    np.testing.assert_allclose(m.coco_stats(), list(expected["stats"].values()), rtol=0, atol=1e-6)
    assert m.map == pytest.approx(expected["mAP50-95"], abs=1e-6)
    # P and R follow the YOLO convention, so they land on Ultralytics' numbers for the same detections.
    yolo = json.loads((REFERENCE / f"yolov8n_{name}_ultralytics.json").read_text())
    assert m.precision == pytest.approx(yolo["P"], abs=1e-3) and m.recall == pytest.approx(yolo["R"], abs=1e-3)
