"""An Ultralytics user's datasets folder (its settings.json's ``datasets_dir``) is used before any download, with
one line saying so; an incomplete copy there, or a settings file that is not what it should be, changes nothing.

Each test points ``YOLO_CONFIG_DIR`` at its own folder and ``DETRAIN_DATASETS_DIR`` at an empty one, so the bundled
coco8.yaml's images are missing where detrain keeps them; downloading is off (``download=False``), so a test that
fell through to the download would fail with detrain's "downloading is off" line instead of touching the network.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from detrain.data.dataset_yaml import load_dataset_yaml
from detrain.data.ultralytics_dirs import ultralytics_datasets_dir, ultralytics_settings_file
from detrain.errors import DatasetError

pytestmark = pytest.mark.unit


def _dataset(root: Path, splits: tuple[str, ...] = ("train", "val"), n: int = 2) -> Path:
    for split in splits:
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
        for i in range(n):
            (root / "images" / split / f"{i}.jpg").write_bytes(b"\xff\xd8")  # listed, never decoded here
            (root / "labels" / split / f"{i}.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    return root


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("YOLO_CONFIG_DIR", str(tmp_path / "ycfg"))
    monkeypatch.setenv("DETRAIN_DATASETS_DIR", str(tmp_path / "detrain-datasets"))
    (tmp_path / "ycfg" / "Ultralytics").mkdir(parents=True)
    return tmp_path


def _settings(env: Path, content: object) -> Path:
    path = env / "ycfg" / "Ultralytics" / "settings.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_a_bundled_yaml_uses_the_complete_copy_in_ultralytics_datasets_dir(env: Path) -> None:
    copy = _dataset(env / "ultra" / "coco8")
    settings = _settings(env, {"datasets_dir": str(env / "ultra"), "runs_dir": str(env / "runs")})
    info = load_dataset_yaml("coco8.yaml", download=False)
    assert info.root == copy and len(info.train) == len(info.val) == 2
    assert info.note == (
        f"coco8.yaml: using the copy in {copy} (the datasets_dir of {settings}) instead of downloading to "
        f"{env / 'detrain-datasets' / 'coco8'}"
    )
    assert not (env / "detrain-datasets").exists()  # nothing was fetched or made


def test_detrains_own_copy_comes_first(env: Path) -> None:
    own = _dataset(env / "detrain-datasets" / "coco8")
    _dataset(env / "ultra" / "coco8")
    _settings(env, {"datasets_dir": str(env / "ultra")})
    info = load_dataset_yaml("coco8.yaml", download=False)
    assert info.root == own and info.note is None


def test_a_users_yaml_with_a_relative_path_is_found_there_too(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ultralytics resolves a relative ``path:`` against its datasets folder; detrain first beside the yaml and in
    the current folder, then there."""
    copy = _dataset(env / "ultra" / "mine")
    _settings(env, {"datasets_dir": str(env / "ultra")})
    (env / "yamls").mkdir()
    yaml_file = env / "yamls" / "mine.yaml"
    yaml_file.write_text("path: mine\ntrain: images/train\nval: images/val\nnames: {0: a}\n")
    monkeypatch.chdir(env / "yamls")
    info = load_dataset_yaml(yaml_file, download=False)
    assert info.root == copy and info.note is not None and "mine.yaml: using the copy in" in info.note


@pytest.mark.parametrize("splits", [("train",), ("val",)])
def test_an_incomplete_copy_there_is_not_used(env: Path, splits: tuple[str, ...]) -> None:
    _dataset(env / "ultra" / "coco8", splits)
    _settings(env, {"datasets_dir": str(env / "ultra")})
    with pytest.raises(DatasetError, match="does not exist and downloading is off"):
        load_dataset_yaml("coco8.yaml", download=False)


HOSTILE = {
    "not json": "datasets_dir: /x",
    "a list": [1, 2],
    "a number": {"datasets_dir": 3},
    "empty": {"datasets_dir": " "},
    "a NUL": {"datasets_dir": "/tmp/a\0b"},
    "deep nesting": "[" * 100_000 + "]" * 100_000,
    "too large": json.dumps({"datasets_dir": "/x", "pad": "x" * (1 << 20)}),
}


@pytest.mark.parametrize("content", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_settings_file_that_is_no_usable_settings_file_is_ignored(env: Path, content: object) -> None:
    _dataset(env / "x" / "coco8")  # where a lenient reader might still end up
    _settings(env, content)
    assert ultralytics_datasets_dir() is None
    with pytest.raises(DatasetError, match="downloading is off"):
        load_dataset_yaml("coco8.yaml", download=False)


def test_a_fifo_in_place_of_the_settings_file_is_not_waited_on(env: Path) -> None:
    os.mkfifo(ultralytics_settings_file())
    assert ultralytics_datasets_dir() is None  # returns at once: the FIFO has no writer


def test_the_settings_file_follows_yolo_config_dir_then_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("YOLO_CONFIG_DIR", str(tmp_path / "a"))
    assert ultralytics_settings_file() == tmp_path / "a" / "Ultralytics" / "settings.json"
    monkeypatch.delenv("YOLO_CONFIG_DIR")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "b"))
    monkeypatch.setattr("platform.system", lambda: "Linux")
    assert ultralytics_settings_file() == tmp_path / "b" / "Ultralytics" / "settings.json"
