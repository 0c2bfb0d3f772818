"""``Results.boxes`` has Ultralytics' attributes and shapes (numpy arrays, equal to Ultralytics' tensors for the
same detections), the Results methods Ultralytics scripts call (to_json, save_txt, save, verbose), and the old
(n, 4) array uses still work for one release with a single deprecation warning."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import cv2
import numpy as np
import pytest
from _ultralytics import offline_ultralytics

from detrain import errors
from detrain.engine.predict.boxes import Boxes, HostArray
from detrain.engine.predict.results import Results

NAMES = {0: "cat", 1: "dog", 2: "cow"}


def _results(n: int = 3, seed: int = 0, shape: tuple[int, int] = (480, 640)) -> Results:
    rng = np.random.default_rng(seed)
    h, w = shape
    xy = rng.uniform(0, 1, (n, 2)) * [w * 0.7, h * 0.7]
    wh = rng.uniform(3, 100, (n, 2))
    xyxy = np.concatenate((xy, xy + wh), 1).astype(np.float32)
    conf = rng.uniform(0.01, 1, n).astype(np.float32)
    cls = rng.integers(0, len(NAMES), n).astype(np.int64)
    img = np.zeros((h, w, 3), np.uint8)
    return Results("pictures/a.jpg", None, shape, xyxy, conf, cls, dict(NAMES), img)


@pytest.fixture
def fresh_announcements(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """A process that has announced no deprecation yet (each is said once per process)."""
    announced: set[str] = set()
    monkeypatch.setattr(errors, "_ANNOUNCED", announced)
    return announced


def test_boxes_attributes_have_ultralytics_names_shapes_and_values() -> None:
    b = Boxes(np.array([[100, 50, 150, 100, 0.9, 0], [200, 150, 300, 250, 0.8, 1]], np.float32), (480, 640))
    assert b.data.shape == (2, 6) and b.xyxy.shape == (2, 4) and b.conf.shape == (2,) and b.cls.shape == (2,)
    np.testing.assert_array_equal(b.xywh, [[125, 75, 50, 50], [250, 200, 100, 100]])
    np.testing.assert_allclose(
        b.xyxyn, [[100 / 640, 50 / 480, 150 / 640, 100 / 480], [200 / 640, 150 / 480, 300 / 640, 250 / 480]]
    )
    np.testing.assert_allclose(
        b.xywhn, [[125 / 640, 75 / 480, 50 / 640, 50 / 480], [250 / 640, 200 / 480, 100 / 640, 100 / 480]]
    )
    assert b.cls.tolist() == [0.0, 1.0] and b.id is None and not b.is_track and b.orig_shape == (480, 640)
    tracked = Boxes(np.array([[1, 2, 3, 4, 7, 0.5, 2]], np.float32), (10, 10))
    assert tracked.is_track and tracked.id.tolist() == [7.0] and tracked.conf.tolist() == [0.5]
    with pytest.raises(ValueError, match=r"\(n, 6\) or \(n, 7\)"):
        Boxes(np.zeros((2, 4)), (10, 10))


def test_indexing_slicing_and_iteration_give_boxes() -> None:
    r = _results(4)
    b = r.boxes
    assert len(b) == len(r) == 4
    one = b[1]
    assert isinstance(one, Boxes) and one.data.shape == (1, 6) and one.orig_shape == b.orig_shape
    np.testing.assert_array_equal(one.xyxy[0], b.xyxy[1])
    assert isinstance(b[1:3], Boxes) and len(b[1:3]) == 2
    mask = b.conf > 0.5
    assert len(b[mask]) == int(mask.sum()) and len(b[[0, 2]]) == 2
    rows = list(b)
    assert all(isinstance(x, Boxes) and len(x) == 1 for x in rows) and len(rows) == 4
    np.testing.assert_array_equal(np.concatenate([x.data for x in rows]), b.data)
    assert not Boxes(np.zeros((0, 6), np.float32), (5, 5))  # empty: false, as Ultralytics' len() says


def test_tensor_style_chains_of_ultralytics_scripts_run_on_numpy() -> None:
    b = _results(3).boxes
    assert b.cpu() is b and b.numpy() is b
    xyxy = b.xyxy.cpu().numpy()
    assert type(xyxy) is np.ndarray and xyxy.dtype == np.float32
    np.testing.assert_array_equal(b.cpu().numpy().conf, b.conf)
    assert isinstance(b.cls, HostArray) and b.cls.int().dtype == np.int32 and b.cls.long().dtype == np.int64
    first = b[0]
    assert float(first.conf) == pytest.approx(float(b.conf[0])) and int(first.cls) == int(b.cls[0])
    assert first.xyxy[0].tolist() == b.xyxy[0].tolist() and first.conf.item() == b.conf[0].item()
    assert b.xyxy.detach().clone().float().tolist() == b.xyxy.tolist()


def test_results_keep_conf_cls_and_boxes_in_step() -> None:
    r = _results(5)
    assert r.conf.dtype == np.float32 and r.cls.dtype == np.int64
    np.testing.assert_array_equal(r.boxes.conf, r.conf)
    np.testing.assert_array_equal(r.boxes.cls.astype(np.int64), r.cls)
    assert r.boxes.xyxy.dtype == np.float32 and r.boxes.data.dtype == np.float32


def test_to_json_records_and_verbose_have_ultralytics_shapes() -> None:
    r = Results(
        "a.jpg",
        None,
        (40, 80),
        np.array([[8, 4, 24, 20], [0, 0, 8, 4], [1, 1, 2, 2]], np.float32),
        np.array([0.875, 0.5, 0.25], np.float32),
        np.array([1, 1, 0]),
        {0: "cat", 1: "dog"},
    )
    rows = json.loads(r.to_json())
    assert rows[0] == {
        "name": "dog",
        "class": 1,
        "confidence": 0.875,
        "box": {"x1": 8.0, "y1": 4.0, "x2": 24.0, "y2": 20.0},
    }
    assert [row["name"] for row in rows] == ["dog", "dog", "cat"]
    assert json.loads(r.to_json(normalize=True))[0]["box"] == {"x1": 0.1, "y1": 0.1, "x2": 0.3, "y2": 0.5}
    assert r.verbose() == "1 cat, 2 dogs, "
    empty = Results("b.jpg", None, (4, 4), np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0), {})
    assert empty.verbose() == "(no detections), " and empty.to_json() == "[]" and len(empty.boxes) == 0


def test_save_txt_and_save_write_whole_files(tmp_path: Path) -> None:
    r = _results(3)
    out = r.save_txt(tmp_path / "a.txt", save_conf=True)
    lines = out.read_text().splitlines()
    assert len(lines) == 3 and [len(line.split()) for line in lines] == [6, 6, 6]
    np.testing.assert_allclose([[float(v) for v in line.split()[1:5]] for line in lines], r.boxes.xywhn, atol=1e-6)
    saved = r.save(str(tmp_path / "deep" / "drawn.png"))
    assert saved == str(tmp_path / "deep" / "drawn.png")
    assert np.array_equal(cv2.imread(saved), r.plot())  # png: lossless, the drawn picture itself
    default = Path(r.save())
    try:
        assert default.name == "results_a.jpg" and cv2.imread(str(default)).shape == (480, 640, 3)
    finally:
        default.unlink()


def test_old_array_uses_still_work_with_one_deprecation_line(fresh_announcements: set[str]) -> None:
    r = _results(3)
    xyxy = np.asarray(r.boxes.xyxy).copy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        np.testing.assert_array_equal(np.asarray(r.boxes), xyxy)
        np.testing.assert_array_equal(r.boxes[:, 0], xyxy[:, 0])
        assert r.boxes.shape == (3, 4) and r.boxes.dtype == np.float32
        np.testing.assert_array_equal(r.boxes * 2, xyxy * 2)
        np.testing.assert_array_equal(1 + r.boxes, xyxy + 1)
        np.testing.assert_array_equal(r.boxes - xyxy[0], xyxy - xyxy[0])
        assert r.boxes.tolist() == xyxy.tolist() and r.boxes.astype(np.float64).dtype == np.float64
        np.testing.assert_allclose(r.boxes, xyxy)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in deprecations]
    assert "r.boxes.xyxy" in str(deprecations[0].message)
    assert deprecations[0].filename == __file__  # it points at the user's line, not at detrain
    assert fresh_announcements == {"boxes-as-array"}


def test_the_new_names_never_announce_a_deprecation(fresh_announcements: set[str]) -> None:
    r = _results(3)
    for b in (r.boxes, *r.boxes, r.boxes[:2], r.boxes.cpu().numpy()):
        _ = b.xyxy, b.xywh, b.xyxyn, b.xywhn, b.conf, b.cls, b.data, b.id, len(b), repr(b)
    _ = r.to_json(), r.verbose(), r.txt_lines(), r.xywhn, r.labels, repr(r)
    assert not fresh_announcements


def test_boxes_pickle_and_unknown_names_fail_plainly() -> None:
    b = _results(2).boxes
    again = pickle.loads(pickle.dumps(b))
    np.testing.assert_array_equal(again.data, b.data)
    assert again.orig_shape == b.orig_shape
    with pytest.raises(AttributeError, match="no attribute 'masks'"):
        _ = b.masks


def test_boxes_equal_ultralytics_boxes_for_the_same_detections(tmp_path_factory: pytest.TempPathFactory) -> None:
    with offline_ultralytics(tmp_path_factory):
        import torch
        from ultralytics.engine.results import Boxes as UltralyticsBoxes
        from ultralytics.engine.results import Results as UltralyticsResults

        for seed, shape in ((0, (480, 640)), (1, (375, 500)), (2, (33, 17))):
            r = _results(7, seed, shape)
            theirs = UltralyticsBoxes(torch.from_numpy(r.boxes.data.numpy().copy()), shape)
            for name in ("data", "xyxy", "xywh", "xyxyn", "xywhn", "conf", "cls"):
                mine, their = getattr(r.boxes, name), getattr(theirs, name).numpy()
                assert mine.shape == their.shape and mine.dtype == their.dtype, name
                np.testing.assert_array_equal(mine, their, err_msg=name)
            assert theirs.id is None and r.boxes.id is None and len(theirs) == len(r.boxes)
            np.testing.assert_array_equal(r.boxes[2:5].xywhn, theirs[2:5].xywhn.numpy())
            whole = UltralyticsResults(r.orig_img, r.path, dict(NAMES), boxes=torch.from_numpy(r.boxes.data.numpy()))
            assert r.records() == whole.summary() and r.records(True, 3) == whole.summary(True, 3)
            assert r.verbose() == whole.verbose()
            try:
                theirs_json = whole.to_json(normalize=True, decimals=4)  # needs polars, which Ultralytics may lack
            except ImportError:
                continue
            assert r.to_json(normalize=True, decimals=4) == theirs_json
