"""Issue 26's "done when": a user's Ultralytics script that trains, validates, predicts and reads ``r.boxes.xyxy``
and ``metrics.box.map`` runs on detrain after changing only the import and the class name, and touches nothing
deprecated. Where Ultralytics is importable, the boxes it read equal Ultralytics' ``Boxes`` of the same detections,
and the script as written runs on Ultralytics itself and leaves the same names behind (so it is an Ultralytics
script, not one shaped like it).

The run is tiny (8 images of 64 px, one epoch, scale n, on the CPU).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _processes import one_thread  # noqa: F401 (a fixture)
from _ultralytics import offline_ultralytics

from detrain import errors
from detrain.data.synthetic import generate_shapes
from detrain.metrics.det_metrics import RESULT_KEYS

pytestmark = pytest.mark.usefixtures("one_thread")

# As an Ultralytics user writes it (DATA, PROJECT and IMAGES are set above it).
ULTRALYTICS_SCRIPT = """\
from ultralytics import YOLO

model = YOLO("yolov8n.yaml")
metrics = model.train(data=DATA, epochs=1, imgsz=64, batch=8, device="cpu", workers=0, project=PROJECT, name="train",
                      exist_ok=True, plots=False)
trained = {"map": metrics.box.map, "map50": metrics.box.map50, "map75": metrics.box.map75, **metrics.results_dict}

metrics = model.val(data=DATA, imgsz=64, batch=4, device="cpu", project=PROJECT, name="val", plots=False)
validated = {"map": metrics.box.map, "map50": metrics.box.map50, "maps": metrics.box.maps.tolist(),
             "fitness": metrics.fitness, "speed": metrics.speed, "save_dir": str(metrics.save_dir)}
print(metrics)

results = model.predict(IMAGES, imgsz=64, conf=0.0, max_det=5, device="cpu")  # an epoch-old model: all it has
found = []
for r in results:
    xyxy = r.boxes.xyxy.cpu().numpy()
    conf = r.boxes.conf.cpu().numpy()
    cls = r.boxes.cls.cpu().numpy().astype(int)
    for box in r.boxes:
        x1, y1, x2, y2 = box.xyxy[0].tolist()
        found.append((r.names[int(box.cls[0])], float(box.conf[0]), x1, y1, x2, y2))
    rows = r.to_json()
"""


def _on_detrain(script: str) -> str:
    """The user's two edits: the import and the class name."""
    return script.replace("from ultralytics import YOLO", "from detrain import Model").replace("YOLO(", "Model(")


def _run(script: str, values: dict[str, Any]) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "__main__", **values}
    exec(compile(script, "user_script.py", "exec"), namespace)
    return namespace


def test_an_ultralytics_script_runs_with_only_the_import_and_class_name_changed(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = generate_shapes(tmp_path / "shapes", n_train=8, n_val=2, imgsz=64, seed=0)
    values = {
        "DATA": str(root / "data.yaml"),
        "PROJECT": str(tmp_path / "runs"),
        "IMAGES": str(root / "images" / "val"),
    }
    script = _on_detrain(ULTRALYTICS_SCRIPT)
    changed = [(a, b) for a, b in zip(ULTRALYTICS_SCRIPT.splitlines(), script.splitlines()) if a != b]
    assert len(changed) == 2 and len(script.splitlines()) == len(ULTRALYTICS_SCRIPT.splitlines())  # nothing else

    announced: set[str] = set()
    monkeypatch.setattr(errors, "_ANNOUNCED", announced)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ns = _run(script, values)
    assert not announced, announced  # nothing deprecated was touched
    assert not [w for w in caught if "deprecated and stops working" in str(w.message)]

    trained, validated = ns["trained"], ns["validated"]
    assert set(trained) == {"map", "map50", "map75", *RESULT_KEYS, "fitness"}  # as on Ultralytics (test below)
    assert 0.0 <= trained["map"] <= 1.0 and 0.0 <= trained["map50"] <= 1.0 and 0.0 <= trained["map75"] <= 1.0
    assert trained["metrics/mAP50-95(B)"] == trained["map"] and trained["fitness"] == trained["map"]
    written = json.loads((Path(validated["save_dir"]) / "metrics.json").read_text())
    assert Path(validated["save_dir"]).parent == tmp_path / "runs"
    assert validated["map"] == max(written["map"], 0.0) and validated["map50"] == max(written["map50"], 0.0)
    assert len(validated["maps"]) == 3 and validated["fitness"] == validated["map"]
    assert validated["speed"]["inference"] > 0 and validated["speed"]["loss"] == 0.0

    results = ns["results"]
    assert len(results) == 2 and len(ns["found"]) == sum(len(r) for r in results) == 10
    for name, conf, x1, y1, x2, y2 in ns["found"]:
        assert name in ("circle", "rectangle", "triangle") and 0.0 <= conf <= 1.0 and x1 <= x2 and y1 <= y2
    assert json.loads(ns["rows"]) == results[-1].records()

    with offline_ultralytics(tmp_path_factory):
        import torch
        from ultralytics.engine.results import Boxes as UltralyticsBoxes

        for r in results:
            theirs = UltralyticsBoxes(torch.from_numpy(r.boxes.data.numpy().copy()), r.orig_shape)
            for attr in ("data", "xyxy", "xywh", "xyxyn", "xywhn", "conf", "cls"):
                np.testing.assert_array_equal(getattr(r.boxes, attr), getattr(theirs, attr).numpy(), err_msg=attr)


def test_the_script_is_an_ultralytics_script(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    root = generate_shapes(tmp_path / "shapes", n_train=8, n_val=2, imgsz=64, seed=0)
    # Ultralytics resolves a relative dataset path against its own datasets folder: name the folder outright
    data = root / "absolute.yaml"
    data.write_text((root / "data.yaml").read_text().replace("path: .", f"path: {root}"))
    values = {"DATA": str(data), "PROJECT": str(tmp_path / "runs"), "IMAGES": str(root / "images" / "val")}
    with offline_ultralytics(tmp_path_factory):
        ns = _run(ULTRALYTICS_SCRIPT, values)
    assert set(ns["trained"]) == {"map", "map50", "map75", *RESULT_KEYS, "fitness"}
    assert set(ns["validated"]["speed"]) == {"preprocess", "inference", "loss", "postprocess"}
    assert len(ns["validated"]["maps"]) == 3 and len(ns["found"]) == 10
    assert {tuple(row) for row in json.loads(ns["rows"])} == {("name", "class", "confidence", "box")}
