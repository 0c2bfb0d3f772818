"""Class names with control characters (issue 37 item 8): an ANSI escape sequence in a name from a dataset yaml,
a checkpoint or an export would rewrite the user's terminal when printed (and a bidirectional override reorder the
line), so each source refuses it with one line naming the file, the class and an escaped excerpt."""

from __future__ import annotations

from pathlib import Path

import pytest

from detrain.data.dataset_yaml import load_dataset_yaml
from detrain.engine.backends import export_info
from detrain.errors import CheckpointError, ConfigError, DatasetError
from detrain.nn.model import DetectionModel, class_names
from detrain.weights.checkpoint import load_checkpoint, model_meta, save_checkpoint

pytestmark = pytest.mark.unit
HOSTILE = ["\x1b[2J\x1b[Hcat", "dog\nerror: forged", "\u202egnp.exe", "bell\x07", "c1\x9b31m"]


@pytest.mark.parametrize("name", HOSTILE)
def test_every_source_of_names_refuses_control_characters(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match=r"^class name 1 \(.*\) holds a control character$"):
        class_names({0: "ok", 1: name})
    data = tmp_path / "data.yaml"
    (tmp_path / "images").mkdir()
    data.write_text(f"path: .\ntrain: images\nval: images\nnames: [ok, {name!r}]\n".replace("'", '"'))
    with pytest.raises(DatasetError, match=r"data.yaml: names: class name 1 .* holds a control character") as info:
        load_dataset_yaml(data, download=False)
    assert "\x1b" not in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"^m.onnx: its metadata's class name 1 .* holds a control character"):
        export_info({"names": {0: "ok", 1: name}, "stride": 32, "imgsz": [64, 64]}, "m.onnx")


def test_a_checkpoint_with_such_a_name_is_one_line(tmp_path: Path) -> None:
    model = DetectionModel(nc=2, names={0: "ok", 1: "fine"})
    meta = model_meta(model, 64)
    meta["names"] = {0: "ok", 1: "\x1b]0;owned\x07"}
    path = tmp_path / "bad.pt"
    save_checkpoint({"model": {**meta, "state_dict": model.state_dict()}, "ema": None}, path)
    with pytest.raises((CheckpointError, ConfigError), match="holds a control character") as info:
        load_checkpoint(path)
    assert "\x1b" not in str(info.value)


def test_plain_names_in_any_script_pass() -> None:
    assert class_names({0: "chat", 1: "犬", 2: "طائر", 3: "🐟 fish"}) == {0: "chat", 1: "犬", 2: "طائر", 3: "🐟 fish"}


@pytest.mark.parametrize("recorded", ["/etc/hostname", "../secret/model.yaml", "~/.ssh/id_ed25519", "other.yaml"])
def test_a_checkpoints_architecture_is_a_mapping_or_a_packaged_name_never_a_path(tmp_path: Path, recorded: str) -> None:
    """Issue 37 item 9: a checkpoint whose ``yaml`` names a file would make detrain open it (an oracle of which
    files exist); it is refused before anything is opened. Packaged names and mappings load."""
    model = DetectionModel(nc=2, names={0: "ok", 1: "fine"})
    meta = model_meta(model, 64)
    path = tmp_path / "w.pt"
    for good in ("yolov8n.yaml", "yolov8.yaml", meta["yaml"]):
        save_checkpoint({"model": {**meta, "yaml": good, "state_dict": model.state_dict()}, "ema": None}, path)
        load_checkpoint(path)
    save_checkpoint({"model": {**meta, "yaml": recorded, "state_dict": model.state_dict()}, "ema": None}, path)
    with pytest.raises(CheckpointError, match=r"names the architecture .* never a file"):
        load_checkpoint(path)
