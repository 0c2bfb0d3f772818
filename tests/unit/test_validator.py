"""The validator end to end on a tiny generated dataset: metrics, metrics.json, predictions.json and its ids,
plots, re-scoring the written file, and COCO-json datasets (against pycocotools where it is installed)."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _val_data import NAMES, ColourModel, make_coco_json_dataset, make_dataset

from detrain.config.cfg import make_cfg
from detrain.data.labels.ground_truth import COCO80_NAMES, image_ids, is_coco80, split_ground_truth, yolo_category_ids
from detrain.data.prepare import build_val_loader, load_split
from detrain.distributed.world import World
from detrain.engine.evaluate.score_file import score_predictions_file
from detrain.engine.evaluate.val_outputs import LastValidation
from detrain.engine.evaluate.validator import validate
from detrain.metrics import SUMMARY_KEYS, DetectionMetrics
from detrain.metrics.coco_json import COCO80_TO_91, load_predictions

SCALARS = (*SUMMARY_KEYS, "precision", "recall", "fitness", "conf", "n_images")
PLOTS = (
    "PR_curve.png",
    "F1_curve.png",
    "P_curve.png",
    "R_curve.png",
    "confusion_matrix.png",
    "confusion_matrix_normalized.png",
)


def _cfg(yaml_file: Path, **kw: Any):
    return make_cfg({"data": str(yaml_file), "imgsz": 64, "batch": 4, "workers": 0, "verbose": False, **kw})


def _validate(yaml_file: Path, save_dir: Path, plots: bool = False, **kw: Any) -> tuple[dict[str, Any], Any]:
    cfg = _cfg(yaml_file, save_json=True, plots=plots, **kw)
    data = load_split(cfg.inputs.data, "val", cfg, verbose=False)
    loader = build_val_loader(data, cfg, cfg.train.batch, World())
    metrics = validate(
        ColourModel(), loader, data, cfg, torch.device("cpu"), World(), save_dir=save_dir, plots=plots, verbose=False
    )
    return metrics, data


def _rescore(yaml_file: Path, predictions: Path, save_dir: Path) -> dict[str, Any]:
    cfg = _cfg(yaml_file, predictions=str(predictions), plots=False)
    return score_predictions_file(cfg, load_split(cfg.inputs.data, "val", cfg, verbose=False), save_dir, World())


@pytest.fixture(scope="module")
def yolo_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("validator")
    yaml_file = make_dataset(root / "ds", n_val=10)
    metrics, data = _validate(yaml_file, root / "run", plots=True)
    return {"root": root, "yaml": yaml_file, "metrics": metrics, "data": data, "save_dir": root / "run"}


def test_metrics_have_every_key_and_the_model_scores_high(yolo_run: dict[str, Any]) -> None:
    m = yolo_run["metrics"]
    for key in (*SCALARS, "per_class", "images_per_rank", "ground_truth"):
        assert key in m, key
    assert m["n_images"] == 10 and m["images_per_rank"] == [10]
    # the colour model finds every rectangle: letterboxing there and back loses well under a pixel
    assert m["map50"] == pytest.approx(1.0) and m["map"] > 0.9
    assert set(m["per_class"]) <= {0, 1, 2} and all(v["n_gt"] > 0 for v in m["per_class"].values())


def test_metrics_json_and_predictions_json_are_written_and_valid(yolo_run: dict[str, Any]) -> None:
    save_dir, m, data = yolo_run["save_dir"], yolo_run["metrics"], yolo_run["data"]
    written = json.loads((save_dir / "metrics.json").read_text())
    for key in SCALARS:
        assert written[key] == pytest.approx(m[key], abs=1e-12)
    assert set(written["per_class"]) <= set(NAMES)
    rows = json.loads((save_dir / "predictions.json").read_text())
    assert rows and all(set(r) == {"image_id", "category_id", "bbox", "score"} for r in rows)
    # numeric stems are the image ids; class k is category k + 1 for a non-COCO dataset
    stems = {int(Path(r.im_file).stem) for r in data.records}
    assert {r["image_id"] for r in rows} <= stems
    assert {r["category_id"] for r in rows} <= {1, 2, 3}
    assert [r["image_id"] for r in rows] == sorted(r["image_id"] for r in rows)
    load_predictions(save_dir / "predictions.json", stems, [1, 2, 3])  # passes the strict loader


def test_plots_are_written(yolo_run: dict[str, Any]) -> None:
    save_dir = yolo_run["save_dir"]
    for name in (*PLOTS, *(f"val_batch{i}_{k}.jpg" for i in range(3) for k in ("labels", "pred"))):
        assert (save_dir / name).stat().st_size > 0, name


def test_plots_false_writes_no_pictures(tmp_path: Path, yolo_run: dict[str, Any]) -> None:
    _validate(yolo_run["yaml"], tmp_path / "run", plots=False)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.json", "predictions.json"]


def test_metrics_object_has_the_confusion_matrix_and_the_curves(yolo_run: dict[str, Any]) -> None:
    """What ``model.val()`` (and ``model.train()``) returns: Ultralytics' ``confusion_matrix.matrix`` and
    ``curves`` / ``curves_results``, from the validator's own counts and curves."""
    raw = yolo_run["metrics"]
    m = DetectionMetrics.from_results(raw)
    counts = m.confusion_matrix.matrix
    assert counts.shape == (4, 4) and counts.dtype == np.int64  # (nc + 1, nc + 1): background last
    n_gt = [raw["per_class"].get(c, {}).get("n_gt", 0) for c in range(3)]
    # the colour model finds every rectangle with its class (its false alarm scores under 0.25): the diagonal
    # holds each class's ground truth, every other cell (misses, false alarms, confusions) is 0
    assert np.diag(counts).tolist() == [*n_gt, 0] and counts.sum() == sum(n_gt) == 11
    assert m.curves == ["Precision-Recall(B)", "F1-Confidence(B)", "Precision-Confidence(B)", "Recall-Confidence(B)"]
    results = m.curves_results
    assert [(r[2], r[3]) for r in results] == [
        ("Recall", "Precision"),
        ("Confidence", "F1"),
        ("Confidence", "Precision"),
        ("Confidence", "Recall"),
    ]
    classes = m.box.ap_class_index
    for x, y, _, _ in results:
        assert y.shape == (len(classes), len(x))
    assert len(results[0][0]) == 101 and len(results[1][0]) == 1000
    np.testing.assert_allclose(results[0][1].mean(1), m.box.ap50)  # COCO's AP50 is the mean over 101 recall points
    at_conf = int(np.abs(results[2][0] - raw["conf"]).argmin())  # P and R at the F1-optimal confidence
    np.testing.assert_allclose(results[2][1][:, at_conf], m.box.p)
    np.testing.assert_allclose(results[3][1][:, at_conf], m.box.r)
    assert "confusion" not in m.details and "curves" not in m.details
    empty = DetectionMetrics.from_results({"map": 0.5})  # a result without them
    assert empty.confusion_matrix is None and empty.curves == [] and empty.curves_results == []


def test_a_kept_validation_is_written_only_when_asked(tmp_path: Path, yolo_run: dict[str, Any], capsys) -> None:
    """Training's way: the validator hands rank 0's table and pictures to a LastValidation, which holds only the
    latest, writes nothing until the run ends, then writes what ``detrain val`` writes (and labels.jpg)."""
    cfg = _cfg(yolo_run["yaml"], plots=True)
    data = yolo_run["data"]
    loader = build_val_loader(data, cfg, cfg.train.batch, World())
    last = LastValidation(plots=True, verbose=True)
    first = validate(ColourModel(), loader, data, cfg, torch.device("cpu"), World(), plots=True, keep=last)
    kept = last.outputs
    validate(ColourModel(), loader, data, cfg, torch.device("cpu"), World(), plots=True, verbose=False, keep=last)
    assert last.outputs is not kept and last.outputs is not None  # the latest replaces the one before
    assert capsys.readouterr().out == ""  # kept, not printed (verbose or not)
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.csv").write_text("epoch,metrics/mAP50\n1,0.5\n")
    last.write(run, load_split(cfg.inputs.data, "train", cfg, verbose=False))
    for name in (*PLOTS, *(f"val_batch{i}_{k}.jpg" for i in range(3) for k in ("labels", "pred"))):
        assert (run / name).stat().st_size > 0, name
    for name in ("labels.jpg", "results.png"):
        assert (run / name).stat().st_size > 0, name
    out = capsys.readouterr().out
    assert re.search(r"^all +10 +11 +0\.990 +1\.000 +1\.000 +0\.971$", out, re.M), out
    for name in NAMES:
        assert re.search(rf"^{name} +\d+ +\d+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+$", out, re.M), out
    assert first["map"] == pytest.approx(last.outputs.metrics["map"])
    quiet, held = tmp_path / "quiet", LastValidation(plots=False, verbose=False)
    quiet.mkdir()
    held.keep(last.outputs)
    held.write(quiet, data)  # plots=false: nothing drawn; verbose=false: nothing printed
    assert list(quiet.iterdir()) == [] and capsys.readouterr().out == ""


def test_rescoring_predictions_json_gives_the_same_numbers(tmp_path: Path, yolo_run: dict[str, Any]) -> None:
    m = yolo_run["metrics"]
    again = _rescore(yolo_run["yaml"], yolo_run["save_dir"] / "predictions.json", tmp_path / "scored")
    for key in SCALARS:
        assert again[key] == pytest.approx(m[key], abs=1e-9), key
    assert again["per_class"] == m["per_class"]
    assert (tmp_path / "scored" / "metrics.json").is_file()


def test_non_numeric_stems_get_stable_indices(tmp_path: Path) -> None:
    yaml_file = make_dataset(tmp_path / "ds", n_val=6, numeric=False)
    m, data = _validate(yaml_file, tmp_path / "run")
    rows = json.loads((tmp_path / "run" / "predictions.json").read_text())
    assert {r["image_id"] for r in rows} <= set(range(6))
    assert split_ground_truth(data).images[data.records[0].im_file].image_id == 0  # records are sorted
    again = _rescore(yaml_file, tmp_path / "run" / "predictions.json", tmp_path / "scored")
    assert again["map"] == pytest.approx(m["map"], abs=1e-9)


def test_image_and_category_id_rules() -> None:
    assert image_ids(["d/000000000139.jpg", "d/000000000285.jpg"]) == {
        "d/000000000139.jpg": 139,
        "d/000000000285.jpg": 285,
    }
    assert image_ids(["d/7.jpg", "e/7.jpg"]) == {"d/7.jpg": 0, "e/7.jpg": 1}  # repeated numbers: indices
    assert image_ids(["d/2.jpg", "d/a.jpg"]) == {"d/2.jpg": 0, "d/a.jpg": 1}
    coco = dict(enumerate(COCO80_NAMES))
    assert is_coco80(coco) and yolo_category_ids(coco, full_coco=True).tolist() == list(COCO80_TO_91)
    assert yolo_category_ids(coco).tolist() == list(range(1, 81))
    assert yolo_category_ids({0: "person", 1: "car"}).tolist() == [1, 2]


@pytest.mark.parametrize(
    ("yaml_name", "val", "expected"),
    [
        ("coco.yaml", "images/val", list(COCO80_TO_91)),  # the bundled full-COCO yaml's name
        ("mine.yaml", "val2017.txt", list(COCO80_TO_91)),  # COCO's own image list
        ("coco8.yaml", "images/val", list(range(1, 81))),  # a subset of COCO: class + 1, as YOLOv8 writes it
        ("coco128.yaml", "images/train2017", list(range(1, 81))),  # a COCO folder name alone is not full COCO
    ],
)
def test_full_coco_in_yolo_layout_writes_the_91_id_categories(
    tmp_path: Path, yaml_name: str, val: str, expected: list[int]
) -> None:
    yaml_file = make_dataset(tmp_path / "ds", n_val=4)
    if val.endswith(".txt"):
        files = sorted((tmp_path / "ds" / "images" / "val").iterdir())
        (tmp_path / "ds" / val).write_text("".join(f"./images/val/{f.name}\n" for f in files))
    elif val != "images/val":
        (tmp_path / "ds" / "images" / "val").rename(tmp_path / "ds" / val)
        (tmp_path / "ds" / "labels" / "val").rename(tmp_path / "ds" / val.replace("images", "labels"))
    target = yaml_file.with_name(yaml_name)
    target.write_text(
        yaml_file.read_text()
        .replace(f"names: {NAMES}", f"names: {list(COCO80_NAMES)}")
        .replace("val: images/val", f"val: {val}")
    )
    cfg = _cfg(target)
    gt = split_ground_truth(load_split(cfg.inputs.data, "val", cfg, verbose=False))
    assert gt.category_ids.tolist() == expected and gt.source == "YOLO labels"
    assert sorted(gt.all_image_ids())[0] == 100  # numeric stems


@pytest.fixture(scope="module")
def coco_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("validator_coco")
    yaml_file = make_coco_json_dataset(root / "ds")
    metrics, data = _validate(yaml_file, root / "run")
    return {"root": root, "yaml": yaml_file, "metrics": metrics, "data": data, "save_dir": root / "run"}


def test_coco_json_split_uses_the_json_ids_and_crowd(coco_run: dict[str, Any]) -> None:
    data, m = coco_run["data"], coco_run["metrics"]
    doc = json.loads((coco_run["root"] / "ds" / "annotations" / "instances_val.json").read_text())
    gt = split_ground_truth(data)
    assert gt.json_file is not None and m["ground_truth"].startswith("annotations")
    assert sorted(gt.all_image_ids()) == sorted(im["id"] for im in doc["images"])
    assert gt.category_ids.tolist() == [3, 7, 11]
    assert sum(int(g.crowd.sum()) for g in gt.images.values()) == 1
    rows = json.loads((coco_run["save_dir"] / "predictions.json").read_text())
    assert {r["category_id"] for r in rows} <= {3, 7, 11}
    assert {r["image_id"] for r in rows} <= {im["id"] for im in doc["images"]}
    # training on the json split: the labels are its non-crowd boxes
    n_regular = sum(1 for a in doc["annotations"] if not a["iscrowd"])
    assert sum(len(r.cls) for r in data.records) == n_regular


def test_coco_json_metrics_equal_pycocotools(coco_run: dict[str, Any]) -> None:
    pytest.importorskip("pycocotools")
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(coco_run["root"] / "ds" / "annotations" / "instances_val.json"))
        ev = COCOeval(gt, gt.loadRes(str(coco_run["save_dir"] / "predictions.json")), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    ours = np.array([coco_run["metrics"][k] for k in SUMMARY_KEYS])
    np.testing.assert_allclose(ours, ev.stats, atol=1e-12)


def test_coco_json_rescoring_gives_the_same_numbers(tmp_path: Path, coco_run: dict[str, Any]) -> None:
    again = _rescore(coco_run["yaml"], coco_run["save_dir"] / "predictions.json", tmp_path / "scored")
    for key in SCALARS:
        assert again[key] == pytest.approx(coco_run["metrics"][key], abs=1e-9), key


def test_annotations_json_beside_yolo_images_is_used_for_evaluation(tmp_path: Path) -> None:
    make_coco_json_dataset(tmp_path / "ds", n_val=4)
    yaml_file = tmp_path / "ds" / "folder.yaml"  # val is the image folder; annotations/instances_val.json is found
    yaml_file.write_text(f"path: {tmp_path / 'ds'}\ntrain: images/val\nval: images/val\nnames: {NAMES}\n")
    cfg = _cfg(yaml_file)
    data = load_split(cfg.inputs.data, "val", cfg, verbose=False)
    gt = split_ground_truth(data)
    assert gt.json_file is not None and gt.category_ids.tolist() == [3, 7, 11]
    assert min(gt.all_image_ids()) == 500


def test_annotations_json_that_does_not_fit_falls_back_to_yolo_labels(tmp_path: Path) -> None:
    yaml_file = make_dataset(tmp_path / "ds", n_val=4)
    (tmp_path / "ds" / "annotations").mkdir()
    (tmp_path / "ds" / "annotations" / "instances_val.json").write_text(
        json.dumps(
            {
                "images": [{"id": 1, "file_name": "other.jpg"}],
                "annotations": [],
                "categories": [{"id": 1, "name": "x"}, {"id": 2, "name": "y"}, {"id": 3, "name": "z"}],
            }
        )
    )
    cfg = _cfg(yaml_file)
    gt = split_ground_truth(load_split(cfg.inputs.data, "val", cfg, verbose=False))
    assert gt.json_file is None and gt.source == "YOLO labels"
