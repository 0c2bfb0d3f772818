"""Ultralytics' own quick start on detrain (issue 38 item 3): ``model(source)`` predicts, ``results[0].show()``
shows or, with no display, saves and says where, and ``model.val()`` after ``model.train(data=...)`` validates on
the data the model trained on (it used to fall back to the built-in shapes set)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _processes import one_thread  # noqa: F401 (a fixture)

from detrain import Model
from detrain.data.synthetic import generate_shapes

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_quick_start_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = generate_shapes(tmp_path / "shapes", n_train=8, n_val=4, imgsz=64, seed=0)
    data = root / "two.yaml"  # two classes: the built-in shapes.yaml has three, so a fallback to it would be refused
    data.write_text("path: .\ntrain: images/train\nval: images/val\nnames: [circle, rectangle]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    project = str(tmp_path / "runs")

    model = Model("n.yaml")
    trained = model.train(
        data=str(data), epochs=1, imgsz=64, batch=4, device="cpu", workers=0, plots=False, project=project
    )
    metrics = model.val(imgsz=64, batch=4, device="cpu", plots=False, project=project)  # no data=: the trained one
    assert metrics is not None and metrics.box.map >= 0
    assert len(metrics.box.maps) == 2  # per class of two.yaml, not of shapes.yaml
    image = next((root / "images" / "val").iterdir())
    results = model(str(image), imgsz=64, conf=0.0, max_det=3)
    assert len(results) == 1 and len(results[0]) == 3
    capsys.readouterr()
    saved = results[0].show()
    assert saved is not None and Path(saved).is_file()
    assert capsys.readouterr().out == f"no display to show {image}: saved {saved}\n"
    # a Model made from the run's weights knows its data too (the checkpoint records it)
    assert trained is not None
    again = Model(Path(trained.save_dir) / "weights" / "best.pt")
    assert again._data == str(data)
