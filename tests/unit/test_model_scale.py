"""Which scale a model yaml builds: its own ``scale:`` wins, a file name's letter counts only for the bundled names
(n.yaml ... x.yaml, yolov8n.yaml ... yolov8x.yaml), a conflict or a choice left open is one clear error.

Each case builds the real model (or runs the real command) and reads the scale off the built layers: the stem
convolution has 16 output channels at n, 32 at s, 48 at m, 64 at l, 80 at x.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from detrain.api import Model
from detrain.cli import main as cli_main
from detrain.engine.build import architecture, build_model, check_model
from detrain.errors import ConfigError
from detrain.nn.model import DetectionModel, bundled_scale, load_model_yaml, packaged_architecture

STEM_WIDTH = {"n": 16, "s": 32, "m": 48, "l": 64, "x": 80}
ALL_SCALES = "n, s, m, l, x"


def _architecture() -> dict[str, Any]:
    d, _ = load_model_yaml(packaged_architecture())
    return d


def _write(path: Path, **changes: Any) -> Path:
    """The packaged YOLOv8 architecture (scales n..x, no scale key) with ``changes``; a None value drops the key."""
    d = {**_architecture(), **changes}
    path.write_text(yaml.safe_dump({k: v for k, v in d.items() if v is not None}, sort_keys=False))
    return path


def _built_scale(model: DetectionModel) -> str:
    width = model.model[0].conv.out_channels
    scale = next(s for s, w in STEM_WIDTH.items() if w == width)
    assert model.scale == scale and model.yaml["scale"] == scale
    return scale


def _command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        cli_main(argv)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


# -- the two cases the issue reported -------------------------------------------------------------------------------


def test_model_yaml_with_scale_s_builds_s_not_l(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """model.yaml ends in 'l': it used to build YOLOv8-L whatever its scale: line said."""
    path = _write(tmp_path / "model.yaml", scale="s")
    assert architecture(str(path)) == (str(path), "s")
    model, ckpt = build_model(str(path), nc=2)
    assert ckpt is None and _built_scale(model) == "s"
    assert _built_scale(DetectionModel(path, nc=2)) == "s"
    assert _built_scale(Model(str(path)).net) == "s"
    code, out, err = _command(["info", f"model={path}", "imgsz=64", "verbose=false"], capsys)
    assert code == 0, err
    assert f"{path}: scale s:" in out and "11,166,560 parameters" in out  # YOLOv8s at 80 classes


def test_custom_yaml_that_names_no_scale_is_refused_not_built_as_m(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """custom.yaml ends in 'm': it used to build YOLOv8-M. Several scales and none named: the user must choose."""
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path / "custom.yaml")
    message = f"model yaml {path} defines scales {ALL_SCALES} but names none: add a line such as 'scale: n' to it"
    for build in (
        lambda: architecture(str(path)),
        lambda: check_model(str(path)),
        lambda: build_model(str(path)),
        lambda: DetectionModel(path),
        lambda: Model(str(path)),
    ):
        with pytest.raises(ConfigError) as e:
            build()
        assert str(e.value) == message
    # the command stops before anything is made, with that one line and exit code 2
    code, _, err = _command(["train", f"model={path}", "data=coco8.yaml", "epochs=1", "device=cpu"], capsys)
    assert code == 2 and err == f"error: {message}\n"
    assert not (tmp_path / "runs").exists()


def test_custom_yaml_builds_the_scale_it_names(tmp_path: Path) -> None:
    path = _write(tmp_path / "custom.yaml", scale="n")
    assert _built_scale(build_model(str(path), nc=3)[0]) == "n"


def test_a_caller_may_choose_the_scale_of_a_yaml_that_names_none(tmp_path: Path) -> None:
    """The Python API's explicit ``scale=`` is a choice: it builds a custom yaml that names no scale."""
    path = _write(tmp_path / "custom.yaml")
    assert _built_scale(DetectionModel(path, scale="n", nc=1)) == "n"


# -- bundled names -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", list(STEM_WIDTH))
def test_bundled_names_imply_their_scale(scale: str) -> None:
    packaged = str(packaged_architecture())
    assert architecture(f"{scale}.yaml") == (packaged, scale)
    assert architecture(f"yolov8{scale}.yaml") == (packaged, scale)
    assert load_model_yaml(f"yolov8{scale}.yaml")[1] == scale


def test_bundled_names_build_real_models() -> None:
    assert _built_scale(build_model("n.yaml", nc=2)[0]) == "n"
    assert _built_scale(DetectionModel("yolov8s.yaml", nc=2)) == "s"
    assert _built_scale(DetectionModel()) == "n"  # the packaged architecture by itself: the documented default
    assert _built_scale(DetectionModel("yolov8.yaml", nc=2)) == "n"


@pytest.mark.parametrize(
    "name",
    [
        "model.yaml",
        "custom.yaml",
        "mymodel-s.yaml",
        "yolov8s-p2.yaml",
        "small.yaml",
        "yolov9s.yaml",
        "xl.yaml",
        "s.yaml.bak",
        "S.yaml",
    ],
)
def test_other_names_imply_no_scale(name: str) -> None:
    assert bundled_scale(name) is None
    assert bundled_scale(f"configs/{name}") is None


def test_a_bundled_name_on_disk_takes_its_scale_from_the_name_when_it_names_none(tmp_path: Path) -> None:
    path = _write(tmp_path / "yolov8s.yaml")
    assert architecture(str(path)) == (str(path), "s")
    assert _built_scale(DetectionModel(path, nc=2)) == "s"
    agreeing = _write(tmp_path / "n.yaml", scale="n")
    assert _built_scale(build_model(str(agreeing), nc=2)[0]) == "n"


@pytest.mark.parametrize(
    ("name", "own", "implied"), [("yolov8s.yaml", "m", "s"), ("n.yaml", "s", "n"), ("x.yml", "n", "x")]
)
def test_a_bundled_name_whose_yaml_names_another_scale_is_an_error(
    tmp_path: Path, name: str, own: str, implied: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path / name, scale=own)
    message = (
        f"model yaml {path} says 'scale: {own}' but its name {name} means scale {implied}: rename the file "
        f"(e.g. custom.yaml) to build {own}, or make that line 'scale: {implied}'"
    )
    for build in (lambda: architecture(str(path)), lambda: DetectionModel(path), lambda: load_model_yaml(path)):
        with pytest.raises(ConfigError) as e:
            build()
        assert str(e.value) == message
    code, _, err = _command(["info", f"model={path}", "imgsz=64"], capsys)
    assert code == 2 and err == f"error: {message}\n"


def test_a_yolov8_yaml_in_the_working_directory_does_not_stand_in_for_a_scale_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """s.yaml means the packaged architecture at s, not whatever yolov8.yaml lies in the current folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "yolov8.yaml").write_text("backbone: []\nhead: []\n")
    model, _ = build_model("s.yaml", nc=2)
    assert _built_scale(model) == "s" and len(model.model) == 23


# -- the single-scale form and hostile values ----------------------------------------------------------------------


def test_single_scale_yaml_needs_no_scale(tmp_path: Path) -> None:
    """depth/width multiples (the form inside YOLOv8 checkpoints) build the same whatever the letter."""
    path = _write(tmp_path / "custom.yaml", scales=None, depth_multiple=0.33, width_multiple=0.25)
    model = build_model(str(path), nc=2)[0]
    assert model.scale == "n" and model.model[0].conv.out_channels == 16


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"scale": "q"}, f"scale 'q' is not one of {ALL_SCALES}"),
        ({"scale": 5}, f"scale 5 is not one of {ALL_SCALES}"),
        ({"scale": ["s"]}, f"scale ['s'] is not one of {ALL_SCALES}"),
        ({"scale": "s" * 10_000}, "is not one of"),
        ({"scales": "nsmlx", "scale": "s"}, "'scales' must map scale names to [depth, width, max_channels]"),
        ({"scales": {"s": "wide"}, "scale": "s"}, "model scale s: expected [depth, width, max_channels]"),
        ({"scales": {"s": [0.33, -1, 1024]}, "scale": "s"}, "model scale s: expected [depth, width, max_channels]"),
        ({"scales": {"s": [0.33, True, 1024]}, "scale": "s"}, "model scale s: expected [depth, width, max_channels]"),
    ],
)
def test_hostile_scale_values_are_one_clear_error(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    path = _write(tmp_path / "custom.yaml", **changes)
    with pytest.raises(ConfigError, match="model") as e:
        build_model(str(path))
    assert message in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 300
