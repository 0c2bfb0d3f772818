"""The README's Ultralytics script (between its ``ultralytics-script`` markers) runs as written, but for the files
it names (the shared yolov8n.pt, coco8 and one of its images) and its sizes (1 epoch at 64 px instead of 3 at 640):
train, val, predict through ``model(...)``, ``results[0].show()`` with no display, and export (issue 38 item 6)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _processes import one_thread  # noqa: F401 (a fixture)

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
WEIGHTS = SHARED / "weights" / "yolov8n.pt"
COCO8 = SHARED / "data" / "coco8.yaml"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not (WEIGHTS.is_file() and COCO8.is_file()), reason="../shared weights or coco8 absent"),
]


def readme_script() -> str:
    text = (REPO / "README.md").read_text()
    found = re.search(r"<!-- ultralytics-script -->\n```python\n(.*?)```\n<!-- /ultralytics-script -->", text, re.S)
    assert found, "the README lost its Ultralytics script"
    return found.group(1)


def test_the_readme_ultralytics_script_runs_but_for_its_files_and_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = readme_script()
    assert script.startswith("from detrain import Model as YOLO")  # the one line an Ultralytics user changes
    image = sorted((COCO8.parent / "coco8" / "images" / "val").glob("*.jpg"))[0]
    swaps = {
        '"yolov8n.pt"': repr(str(WEIGHTS)),
        '"coco8.yaml"': repr(str(COCO8)),
        '"bus.jpg"': repr(str(image)),
        "epochs=3, imgsz=640": f"epochs=1, imgsz=64, workers=0, project={str(tmp_path / 'runs')!r}",
    }
    for old, new in swaps.items():
        assert old in script, old
        script = script.replace(old, new)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    scope: dict = {}
    exec(compile(script, "README.md", "exec"), scope)  # the project's own README: the point of the test
    out = capsys.readouterr().out
    assert "no display to show" in out and "saved" in out
    assert Path(scope["path"]).is_file() and Path(scope["path"]).suffix == ".torchscript"
    metrics = scope["metrics"]
    assert 0.0 <= metrics.box.map <= metrics.box.map50 <= 1.0
    assert scope["results"][0].boxes.xyxy.shape[1] == 4
