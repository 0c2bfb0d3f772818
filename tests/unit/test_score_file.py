"""``detrain val predictions=...``: bad files are refused naming their first bad entry; empty ones score 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _val_data import make_dataset

from detrain.config.cfg import make_cfg
from detrain.data.labels.ground_truth import split_ground_truth
from detrain.data.prepare import load_split
from detrain.distributed.world import World
from detrain.engine.evaluate.score_file import score_predictions_file
from detrain.errors import DatasetError


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("score_file")
    yaml_file = make_dataset(root / "ds", n_val=4)
    cfg = make_cfg({"data": str(yaml_file), "imgsz": 64, "workers": 0, "verbose": False, "plots": False})
    data = load_split(cfg.inputs.data, "val", cfg, verbose=False)
    first_id = min(split_ground_truth(data).all_image_ids())
    return {"root": root, "yaml": yaml_file, "data": data, "image_id": first_id}


def _score(split: dict[str, Any], tmp_path: Path, content: Any, raw: bool = False) -> dict[str, Any]:
    path = tmp_path / "predictions.json"
    path.write_text(content if raw else json.dumps(content))
    cfg = make_cfg({"data": str(split["yaml"]), "predictions": str(path), "verbose": False, "plots": False})
    return score_predictions_file(cfg, split["data"], tmp_path / "run", World())


def _ok(split: dict[str, Any], **kw: Any) -> dict[str, Any]:
    row = {"image_id": split["image_id"], "category_id": 1, "bbox": [1.0, 2.0, 10.0, 8.0], "score": 0.5}
    row.update(kw)
    return row


def test_unknown_image_id_is_named(split: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"detection 1: unknown image_id 999999"):
        _score(split, tmp_path, [_ok(split), _ok(split, image_id=999999), _ok(split, image_id=888888)])


def test_unknown_category_is_named(split: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"detection 2: unknown category_id 4 \(valid: \[1, 2, 3\]\)"):
        _score(
            split,
            tmp_path,
            [_ok(split), _ok(split, category_id=3), _ok(split, category_id=4), _ok(split, category_id=0)],
        )


def test_nan_box_is_named(split: dict[str, Any], tmp_path: Path) -> None:
    text = json.dumps([_ok(split), _ok(split, bbox=[1.0, float("nan"), 3.0, 4.0])])  # json.dumps writes NaN
    with pytest.raises(DatasetError, match=r"detection 1: bbox must be a finite number, got nan"):
        _score(split, tmp_path, text, raw=True)


def test_nan_score_is_named(split: dict[str, Any], tmp_path: Path) -> None:
    text = json.dumps([_ok(split, score=float("nan"))])
    with pytest.raises(DatasetError, match=r"detection 0: score must be a finite number"):
        _score(split, tmp_path, text, raw=True)


def test_negative_size_is_named(split: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"detection 1: bbox has a negative width or height"):
        _score(split, tmp_path, [_ok(split), _ok(split, bbox=[5.0, 5.0, -1.0, 3.0]), _ok(split, bbox=[0, 0, 1, -2])])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"annotations": []}, r"a COCO results file is a json list of detections, got dict"),
        ([{"image_id": 1, "bbox": [0, 0, 1, 1], "score": 0.5}], r"detection 0: expected an object with image_id"),
        ([[1, 1, 0, 0, 1, 1, 0.5]], r"detection 0: expected an object"),
        ('[{"image_id": 1,', r"not valid json"),
    ],
    ids=["dict", "missing-key", "row-list", "truncated"],
)
def test_wrong_format_is_refused(split: dict[str, Any], tmp_path: Path, content: Any, message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        _score(split, tmp_path, content, raw=isinstance(content, str))


def test_wrong_box_shape_and_types_are_refused(split: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"detection 1: bbox must be \[x, y, w, h\]"):
        _score(split, tmp_path, [_ok(split), _ok(split, bbox=[1, 2, 3])])
    with pytest.raises(DatasetError, match=r"detection 0: image_id must be an integer, got '7'"):
        _score(split, tmp_path, [_ok(split, image_id="7")])


def test_missing_file_is_refused(split: dict[str, Any], tmp_path: Path) -> None:
    cfg = make_cfg({"data": str(split["yaml"]), "predictions": str(tmp_path / "nope.json"), "verbose": False})
    with pytest.raises(DatasetError, match=r"nope.json: file not found"):
        score_predictions_file(cfg, split["data"], tmp_path / "run", World())


def test_empty_predictions_score_zero(split: dict[str, Any], tmp_path: Path) -> None:
    m = _score(split, tmp_path, [])
    assert m["map"] == 0.0 and m["map50"] == 0.0 and m["precision"] == 0.0 and m["recall"] == 0.0
    assert m["n_images"] == 4
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["map"] == 0.0


def test_a_perfect_file_scores_one(split: dict[str, Any], tmp_path: Path) -> None:
    gt = split_ground_truth(split["data"])
    rows = [
        {"image_id": g.image_id, "category_id": int(gt.category_ids[c]), "bbox": box, "score": 0.9}
        for g in gt.images.values()
        for box, c in zip(g.boxes_ltwh.tolist(), g.cls.tolist())
    ]
    m = _score(split, tmp_path, rows)
    assert m["map"] == pytest.approx(1.0) and m["n_images"] == 4
