"""OpenVINO IR export (engine/openvino_ir.py): what only this format does. Its served detections, free sizes and
coco8 mAP against the .pt are tests/integration/test_exported_serve.py's, beside ONNX and TorchScript.

Here: ``half`` stores float16 weights and still serves the model; the export folder appears whole (a failed export
leaves the previous one as it was); the export reaches no network (OpenVINO's converter, which starts usage
telemetry, is never called); and every way a folder or graph can be wrong is one line.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from detrain import Model
from detrain.engine import openvino_ir
from detrain.engine.backends import load_exported
from detrain.engine.openvino_ir import export_openvino, ir_path
from detrain.errors import ConfigError, DetrainError
from detrain.nn.model import DetectionModel
from detrain.weights.checkpoint import model_meta, save_checkpoint

pytest.importorskip("openvino", reason="the openvino extra (pip install 'detrain[openvino]')")


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small YOLOv8 checkpoint with spread-out scores (biases of the class logits raised)."""
    torch.manual_seed(0)
    model = DetectionModel("yolov8n.yaml", nc=2, names={0: "a", 1: "b"})
    for conv in (m for m in model.modules() if isinstance(m, nn.Conv2d) and m.out_channels == 2):
        assert conv.bias is not None
        conv.bias.data.normal_(-1.0, 1.0)
    folder = tmp_path_factory.mktemp("w")
    meta = model_meta(model, 64)
    return save_checkpoint({"model": {**meta, "state_dict": model.state_dict()}, "ema": None}, folder / "best.pt")


def _raw(weights: Path, x: torch.Tensor) -> torch.Tensor:
    net = Model(weights).net.eval().fuse()
    with torch.no_grad():
        return net(x)


def test_half_stores_float16_weights_and_serves_the_model(weights: Path, tmp_path: Path) -> None:
    full = export_openvino(Model(weights).net, tmp_path / "full_openvino_model")
    half = export_openvino(Model(weights).net, tmp_path / "half_openvino_model", half=True)
    full_bin, half_bin = (full / "full.bin").stat().st_size, (half / "half.bin").stat().st_size
    assert 0.45 < half_bin / full_bin < 0.55, (half_bin, full_bin)  # float16: half the bytes
    x = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(0))
    want = _raw(weights, x)
    with torch.no_grad():
        got_full, got_half = load_exported(full)(x), load_exported(half)(x)
    torch.testing.assert_close(got_full, want, rtol=1e-4, atol=1e-3)
    scores = (got_half[:, 4:] - want[:, 4:]).abs().max().item()
    assert 0 < scores < 0.02, scores  # rounded weights: close, but not the float32 graph


def test_the_folder_is_replaced_whole_and_a_failed_export_leaves_the_old_one(
    weights: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = Model(weights).export(format="openvino", imgsz=64)
    assert out == weights.parent / "best_openvino_model" and sorted(p.name for p in out.iterdir()) == [
        "best.bin",
        "best.xml",
    ]
    (out / "stale.txt").write_text("from an older export")
    before = (out / "best.xml").read_bytes()
    out = Model(weights).export(format="openvino", imgsz=96)  # replaces the folder: the stale file is gone
    assert (
        sorted(p.name for p in out.iterdir()) == ["best.bin", "best.xml"] and (out / "best.xml").read_bytes() != before
    )
    kept = (out / "best.xml").read_bytes()

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    import openvino

    monkeypatch.setattr(openvino, "save_model", fail)
    with pytest.raises(OSError, match="No space left"):
        Model(weights).export(format="openvino", imgsz=64)
    assert (out / "best.xml").read_bytes() == kept  # the previous export, untouched
    assert sorted(p.name for p in weights.parent.iterdir()) == ["best.pt", "best_openvino_model"]  # no leftovers


def test_the_export_reaches_no_network(weights: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tried: list[object] = []

    def refuse(self: socket.socket, address: object) -> None:
        tried.append(address)
        raise OSError("network use during an export")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", lambda address, *a, **k: refuse(None, address))  # type: ignore[arg-type]
    import openvino
    import openvino_telemetry

    def converter(*args: object, **kwargs: object) -> None:
        raise AssertionError("openvino.convert_model starts OpenVINO's usage telemetry")

    monkeypatch.setattr(openvino, "convert_model", converter)
    monkeypatch.setattr(openvino_telemetry.Telemetry, "init", converter)
    out = export_openvino(Model(weights).net, tmp_path / "m_openvino_model", imgsz=64)
    load_exported(out)
    assert tried == []


def test_every_wrong_folder_or_graph_is_one_line(weights: Path, tmp_path: Path) -> None:
    good = export_openvino(Model(weights).net, tmp_path / "good_openvino_model", imgsz=64)
    assert ir_path(str(good)) == ir_path(str(good / "good.xml")) == good / "good.xml"
    cases: dict[str, str] = {}
    empty = tmp_path / "empty_openvino_model"
    empty.mkdir()
    cases[str(empty)] = "holds one .xml graph and its .bin; found no .xml graph"
    two = tmp_path / "two_openvino_model"
    two.mkdir()
    for name in ("a", "b"):
        (two / f"{name}.xml").write_bytes((good / "good.xml").read_bytes())
        (two / f"{name}.bin").write_bytes((good / "good.bin").read_bytes())
    cases[str(two)] = "found 2 .xml graphs"
    nobin = tmp_path / "nobin_openvino_model"
    nobin.mkdir()
    (nobin / "m.xml").write_bytes((good / "good.xml").read_bytes())
    cases[str(nobin)] = "nobin_openvino_model/m.bin is missing or not a file"
    linked = tmp_path / "linked_openvino_model"
    linked.mkdir()
    (linked / "m.xml").symlink_to(good / "good.xml")
    (linked / "m.bin").write_bytes(b"")
    cases[str(linked)] = "m.xml is a symbolic link"
    cases[str(tmp_path / "missing_openvino_model")] = "exported model not found"
    for name, line in cases.items():
        with pytest.raises(ConfigError, match=line):
            load_exported(name)


def test_a_broken_or_foreign_graph_is_one_line(weights: Path, tmp_path: Path) -> None:
    import openvino as ov

    broken = tmp_path / "broken_openvino_model"
    broken.mkdir()
    (broken / "m.xml").write_text('<?xml version="1.0"?><net name="x" version="11"><layers><layer id="0"')
    (broken / "m.bin").write_bytes(b"\0" * 16)
    with pytest.raises(DetrainError, match=r"broken_openvino_model: not a readable OpenVINO model \("):
        load_exported(broken)
    foreign = tmp_path / "foreign_openvino_model"  # a valid IR that is no export of detrain's: no metadata
    foreign.mkdir()
    param = ov.opset13.parameter([1, 3, 8, 8], np.float32, name="images")
    ov.save_model(ov.Model([ov.opset13.relu(param)], [param], "relu"), str(foreign / "m.xml"))
    with pytest.raises(ConfigError, match=r"foreign_openvino_model records no valid 'names'"):
        load_exported(foreign)


def test_a_missing_openvino_is_the_install_line(weights: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "openvino", None)  # `import openvino` now raises ImportError
    for call in (lambda: Model(weights).export(format="openvino"), lambda: load_exported("x_openvino_model")):
        with pytest.raises(ConfigError) as info:
            call()
        assert str(info.value) == 'an OpenVINO export needs openvino: pip install "detrain[openvino]"'
    assert openvino_ir.INSTALL_OPENVINO in str(info.value)
