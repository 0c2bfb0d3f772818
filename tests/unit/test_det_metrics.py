"""What ``Model.train()``/``val()`` return: Ultralytics' ``DetMetrics`` shape over the COCO-exact numbers (map75
from the same accumulation as map, per-class maps with the mean for classes without ground truth), printable,
picklable, and readable as the old dict for one release with a single deprecation warning."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _ultralytics import offline_ultralytics

from detrain import errors
from detrain.metrics import DetectionMetrics, coco_summary, match_image
from detrain.metrics.summary import DetMetrics

NAMES = {0: "cat", 1: "dog", 2: "cow", 3: "owl"}  # no ground truth of class 2


def _summary() -> DetMetrics:
    """Detections of varying quality for classes 0, 1 and 3 over a few images (class 2: only false positives)."""
    rng = np.random.default_rng(0)
    stats = []
    for image_id in range(6):
        gt_cls = np.array([0, 1, 3, 0, 1])[: 2 + image_id % 4]
        gt = np.array([[10.0 + 60 * i, 20, 50 + 60 * i, 90] for i in range(len(gt_cls))])
        det = gt + rng.normal(0, 3 + 2 * gt_cls[:, None], gt.shape)  # class 3 boxes are the loosest
        det_cls = gt_cls.copy()
        extra = np.array([[5.0, 5, 30, 30]]), np.array([2])  # a class no image holds
        stats.append(
            match_image(
                np.concatenate((det, extra[0])),
                np.concatenate((rng.uniform(0.3, 1, len(det)), [0.6])),
                np.concatenate((det_cls, extra[1])),
                gt,
                gt_cls,
                image_id=image_id,
            )
        )
    return coco_summary(stats, nc=len(NAMES))


def _result(summary: DetMetrics) -> dict[str, Any]:
    """The dict the validator returns (as engine/evaluate/validator.finish builds it)."""
    return {
        **summary.as_dict(),
        "per_class": summary.per_class,
        "conf": summary.conf,
        "n_images": 6,
        "names": dict(NAMES),
        "speed": {"preprocess": 0.5, "inference": 12.0, "loss": 0.0, "postprocess": 1.5},
        "save_dir": "runs/val/exp",
    }


@pytest.fixture
def fresh_announcements(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    announced: set[str] = set()
    monkeypatch.setattr(errors, "_ANNOUNCED", announced)
    return announced


def test_box_metrics_are_the_coco_exact_numbers() -> None:
    summary = _summary()
    m = DetectionMetrics.from_results(_result(summary))
    precision = summary.coco_precision
    assert precision is not None
    present = [0, 1, 3]
    # AP per class and IoU threshold from the COCO tables (area all, 100 detections)
    ap_table = np.array([[precision[t, :, k, 0, -1].mean() for t in range(10)] for k in present])
    assert m.box.ap_class_index.tolist() == present and m.box.nc == 4
    assert m.box.map == summary.map == pytest.approx(ap_table.mean(), abs=1e-12)
    assert m.box.map50 == pytest.approx(ap_table[:, 0].mean(), abs=1e-12)
    assert m.box.map75 == summary.map75 == pytest.approx(ap_table[:, 5].mean(), abs=1e-12)
    assert 0 < m.box.map75 < m.box.map50 <= 1  # IoU 0.75 is harder on these jittered boxes
    np.testing.assert_allclose(m.box.ap, ap_table.mean(1), atol=1e-12)
    np.testing.assert_allclose(m.box.ap50, ap_table[:, 0], atol=1e-12)
    np.testing.assert_allclose(m.box.maps, [*ap_table.mean(1)[:2], m.box.map, ap_table.mean(1)[2]], atol=1e-12)
    assert m.box.mp == summary.precision and m.box.mr == summary.recall
    assert m.fitness == m.box.fitness() == summary.fitness
    assert m.nt_per_class.tolist() == [summary.per_class[k]["n_gt"] if k in present else 0 for k in range(4)]


def test_results_dict_speed_names_save_dir_and_repr() -> None:
    m = DetectionMetrics.from_results(_result(_summary()))
    assert list(m.results_dict) == [
        "metrics/precision(B)",
        "metrics/recall(B)",
        "metrics/mAP50(B)",
        "metrics/mAP50-95(B)",
        "fitness",
    ]
    assert list(m.results_dict.values()) == [m.box.mp, m.box.mr, m.box.map50, m.box.map, m.fitness]
    assert list(m.keys) == list(m.results_dict)[:4]  # Ultralytics' key names (no call, no deprecation)
    assert m.speed == {"preprocess": 0.5, "inference": 12.0, "loss": 0.0, "postprocess": 1.5}
    assert m.names == NAMES and m.save_dir == Path("runs/val/exp")
    text = repr(m)
    assert text.startswith("DetectionMetrics(mAP50-95 ") and f"{m.box.map75:.4f}" in text and len(text) < 300
    assert m.details["n_images"] == 6 and m.details["map_small"] == _summary().map_small


def test_pickle_round_trip_keeps_every_number() -> None:
    m = DetectionMetrics.from_results(_result(_summary()))
    again = pickle.loads(pickle.dumps(m))
    assert again.results_dict == m.results_dict and again.speed == m.speed and again.save_dir == m.save_dir
    assert again.box.map75 == m.box.map75 and again.names == m.names
    np.testing.assert_array_equal(again.box.maps, m.box.maps)
    np.testing.assert_array_equal(again.box.ap_class_index, m.box.ap_class_index)
    assert repr(again) == repr(m)


def test_undefined_coco_values_read_zero_as_in_ultralytics() -> None:
    empty = coco_summary([], nc=2)
    m = DetectionMetrics.from_results({**empty.as_dict(), "per_class": {}, "names": {0: "a", 1: "b"}})
    assert m.box.map == m.box.map50 == m.box.map75 == 0.0 and m.details["map"] == -1.0
    assert m.box.maps.tolist() == [0.0, 0.0] and m.fitness == 0.0 and m.save_dir is None
    assert m.speed == dict.fromkeys(("preprocess", "inference", "loss", "postprocess"), 0.0)
    assert DetectionMetrics.from_results({}, names={0: "a"}).box.nc == 1  # the names the caller knows


def test_the_old_dict_still_reads_with_one_deprecation_line(fresh_announcements: set[str]) -> None:
    summary = _summary()
    m = DetectionMetrics.from_results(_result(summary))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert m["map50"] == summary.map50 and m["save_dir"] == "runs/val/exp"
        assert m.get("map", 9) == summary.map and m.get("no such key", 9) == 9
        assert "per_class" in m and "nothing" not in m
        keys = m.keys()
        assert "map75" in keys and set(m) == set(keys)
        assert dict(m.items())["fitness"] == summary.fitness and summary.map in list(m.values())
        with pytest.raises(KeyError):
            _ = m["nothing"]
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1 and "metrics.box.map" in str(deprecations[0].message)
    assert deprecations[0].filename == __file__
    assert fresh_announcements == {"metrics-as-dict"}


def test_ultralytics_attributes_never_announce_a_deprecation(fresh_announcements: set[str]) -> None:
    m = DetectionMetrics.from_results(_result(_summary()))
    _ = m.box.map, m.box.map50, m.box.map75, m.box.maps, m.box.mp, m.box.mr, m.box.f1, m.box.mean_results()
    _ = m.results_dict, m.fitness, m.maps, m.ap_class_index, m.keys, m.speed, m.names, m.save_dir, repr(m)
    _ = m.mean_results(), m.class_result(0), m.nt_per_image, pickle.dumps(m)
    assert not fresh_announcements


def test_same_numbers_as_ultralytics_metric_built_from_the_same_per_class_ap(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Ultralytics' Metric fed the per-class AP table (at each IoU threshold) and P/R of the classes with ground
    truth gives the same means, per-class maps (mean for the absent class), fitness and results_dict."""
    summary = _summary()
    m = DetectionMetrics.from_results(_result(summary))
    precision = summary.coco_precision
    assert precision is not None
    with offline_ultralytics(tmp_path_factory):
        from ultralytics.utils.metrics import DetMetrics as UltralyticsDetMetrics

        theirs = UltralyticsDetMetrics(names=dict(NAMES))
        index = m.box.ap_class_index
        theirs.box.nc = len(NAMES)
        theirs.box.all_ap = np.array([[precision[t, :, k, 0, -1].mean() for t in range(10)] for k in index])
        theirs.box.ap_class_index = index
        theirs.box.p, theirs.box.r = m.box.p, m.box.r
        for name in ("map", "map50", "map75", "mp", "mr"):
            assert getattr(m.box, name) == pytest.approx(getattr(theirs.box, name), abs=1e-12), name
        np.testing.assert_allclose(m.box.maps, theirs.box.maps, atol=1e-12)
        np.testing.assert_allclose(m.box.ap, theirs.box.ap, atol=1e-12)
        assert m.fitness == pytest.approx(theirs.fitness, abs=1e-12)
        assert list(m.results_dict) == list(theirs.results_dict) and list(m.keys) == theirs.keys
        assert list(m.results_dict.values()) == pytest.approx(list(theirs.results_dict.values()), abs=1e-12)
        assert sorted(m.speed) == sorted(theirs.speed)
