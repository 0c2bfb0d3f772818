"""ONNX and TorchScript export: the exported graph gives what the torch model gives, for any batch size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from detrain import __version__ as detrain_version
from detrain.config.cfg import CHOICES
from detrain.engine.export import SUFFIXES, export_model, export_onnx, export_torchscript
from detrain.errors import ConfigError, DetrainError
from detrain.nn.model import DetectionModel
from detrain.weights.checkpoint import model_meta, save_checkpoint

# torch announces the deprecation of torch.jit; loading a TorchScript export is still what users do with one
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")

IMGSZ = 96  # small: the graph is the same at any size, and the CPU is shared


@pytest.fixture(scope="module")
def model() -> DetectionModel:
    torch.manual_seed(0)
    m = DetectionModel(scale="n", nc=3, names={0: "a", 1: "b", 2: "c"})
    # Non-trivial BatchNorm statistics, so folding them into the convolutions is really exercised.
    g = torch.Generator().manual_seed(1)
    for bn in (x for x in m.modules() if isinstance(x, nn.BatchNorm2d)):
        bn.running_mean.copy_(torch.randn(bn.num_features, generator=g) * 0.1)
        bn.running_var.copy_(torch.rand(bn.num_features, generator=g) + 0.5)
    return m


def test_onnx_matches_torch_for_batch_1_and_2(model: DetectionModel, tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime")
    out = export_onnx(model, tmp_path / "sub" / "model.onnx", imgsz=IMGSZ)
    assert out == tmp_path / "sub" / "model.onnx" and out.is_file()
    assert [p.name for p in out.parent.iterdir()] == ["model.onnx"]  # no temporary file left
    assert model.training and any(isinstance(x, nn.BatchNorm2d) for x in model.modules())  # untouched

    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["images"]
    assert [o.name for o in session.get_outputs()] == ["output0"]
    reference = model.eval()
    try:
        for batch in (1, 2):
            x = torch.rand(batch, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(batch))
            with torch.no_grad():
                want = reference(x)
            (got,) = session.run(None, {"images": x.numpy()})
            assert got.shape == (batch, 4 + 3, (IMGSZ // 8) ** 2 + (IMGSZ // 16) ** 2 + (IMGSZ // 32) ** 2)
            torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-4, atol=1e-4)
    finally:
        model.train()


def test_metadata_records_names_and_stride(model: DetectionModel, tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    out = export_onnx(model, tmp_path / "m.onnx", imgsz=(64, 96), dynamic_batch=False)
    proto = onnx.load(str(out))
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["names"] == "{0: 'a', 1: 'b', 2: 'c'}"
    assert meta["stride"] == "32" and meta["imgsz"] == "[64, 96]"
    dims = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [1, 3, 64, 96]  # a fixed batch when dynamic_batch=False


def test_bad_image_size_is_a_clear_error(model: DetectionModel, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="imgsz must be a positive multiple of 32"):
        export_onnx(model, tmp_path / "m.onnx", imgsz=100)
    assert list(tmp_path.iterdir()) == []


def test_failed_export_leaves_no_file(model: DetectionModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        Path(str(args[2])).write_bytes(b"half a file")
        raise RuntimeError("exporter crashed")

    monkeypatch.setattr(torch.onnx, "export", broken)
    with pytest.raises(RuntimeError, match="exporter crashed"):
        export_onnx(model, tmp_path / "m.onnx", imgsz=64)
    assert list(tmp_path.iterdir()) == []


def _reference(model: DetectionModel, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    try:
        with torch.no_grad():
            return model(x)
    finally:
        model.train()


def test_torchscript_matches_torch_for_batch_1_and_3(model: DetectionModel, tmp_path: Path) -> None:
    out = export_torchscript(model, tmp_path / "sub" / "model.torchscript", imgsz=IMGSZ)
    assert out == tmp_path / "sub" / "model.torchscript" and out.is_file()
    assert [p.name for p in out.parent.iterdir()] == ["model.torchscript"]  # no temporary file left
    assert model.training and any(isinstance(x, nn.BatchNorm2d) for x in model.modules())  # untouched

    extra = {"detrain.json": ""}
    loaded = torch.jit.load(str(out), map_location="cpu", _extra_files=extra)
    meta = json.loads(extra["detrain.json"])
    assert meta == {
        "producer": "detrain",
        "version": detrain_version,
        "task": "detect",
        "family": "yolov8",
        "stride": 32,
        "imgsz": [IMGSZ, IMGSZ],
        "batch": 1,
        "dynamic": True,
        "free_size": True,
        "half": False,
        "end2end": False,
        "output": "boxes (B, 4 + nc, N): xywh and class scores per anchor, for NMS",
        "names": {"0": "a", "1": "b", "2": "c"},
    }
    for batch in (1, 3):  # traced at batch 1; the batch stays free
        x = torch.rand(batch, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            got = loaded(x)
        assert got.shape == (batch, 4 + 3, (IMGSZ // 8) ** 2 + (IMGSZ // 16) ** 2 + (IMGSZ // 32) ** 2)
        torch.testing.assert_close(got, _reference(model, x), rtol=1e-4, atol=1e-4)


_LOAD_WITHOUT_DETRAIN = """
import importlib.abc, sys
class NoDetrain(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "detrain" or name.startswith("detrain."):
            raise ImportError("detrain must not be needed to load the export")
sys.meta_path.insert(0, NoDetrain())
import torch
module = torch.jit.load(sys.argv[1], map_location="cpu")
x = torch.rand(2, 3, int(sys.argv[3]), int(sys.argv[3]), generator=torch.Generator().manual_seed(7))
with torch.no_grad():
    torch.save({"x": x, "y": module(x)}, sys.argv[2])
assert not any(m == "detrain" or m.startswith("detrain.") for m in sys.modules), "detrain was imported"
"""


def test_torchscript_loads_without_detrain(model: DetectionModel, tmp_path: Path) -> None:
    out = export_torchscript(model, tmp_path / "model.torchscript", imgsz=IMGSZ)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_WITHOUT_DETRAIN, str(out), str(tmp_path / "y.pt"), str(IMGSZ)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = torch.load(tmp_path / "y.pt", weights_only=True)
    torch.testing.assert_close(result["y"], _reference(model, result["x"]), rtol=1e-4, atol=1e-4)


def test_failed_torchscript_export_leaves_no_file(
    model: DetectionModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(module: object, path: str, **kwargs: object) -> None:
        Path(path).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(torch.jit, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        export_torchscript(model, tmp_path / "m.torchscript", imgsz=64)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_an_unwritable_destination_is_a_one_line_error(model: DetectionModel, tmp_path: Path, fmt: str) -> None:
    (tmp_path / "a_file").write_text("not a folder")
    out = tmp_path / "a_file" / f"m{SUFFIXES[fmt]}"
    with pytest.raises(DetrainError, match=f"cannot write the export {out}: ") as info:
        export_model(model, out, format=fmt, imgsz=64)
    assert "\n" not in str(info.value) and [p.name for p in tmp_path.iterdir()] == ["a_file"]


def test_an_existing_file_is_replaced_whole(model: DetectionModel, tmp_path: Path) -> None:
    target = tmp_path / "m.torchscript"
    target.write_bytes(b"an older export")
    export_model(model, target, format="torchscript", imgsz=64)
    assert torch.jit.load(str(target)) is not None and [p.name for p in tmp_path.iterdir()] == ["m.torchscript"]
    mask = os.umask(0o022)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask  # an ordinary file, not mkstemp's private 0600


@pytest.mark.parametrize("fmt", ["tflite", "ONNX ", "../onnx", ""])
def test_unknown_format_is_a_one_line_error_listing_the_valid_ones(
    model: DetectionModel, tmp_path: Path, fmt: str
) -> None:
    with pytest.raises(ConfigError, match=r"expected one of onnx, torchscript$"):
        export_model(model, tmp_path / "m.x", format=fmt, imgsz=64)
    assert list(tmp_path.iterdir()) == []


def test_formats_agree_with_the_cfg_choices() -> None:
    assert (*SUFFIXES, "openvino") == CHOICES["format"]  # one file each; OpenVINO a folder (engine/openvino_ir.py)


def detrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "detrain.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_exports_torchscript_beside_the_weights(model: DetectionModel, tmp_path: Path) -> None:
    weights = save_checkpoint(
        {"model": {**model_meta(model, 64), "state_dict": model.state_dict()}, "ema": None}, tmp_path / "best.pt"
    )
    proc = detrain("export", f"model={weights}", "format=torchscript", "imgsz=64")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "best.torchscript"
    assert proc.stdout.strip() == f"exported {out}"
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = torch.jit.load(str(out))(x)
    torch.testing.assert_close(got, _reference(model, x), rtol=1e-4, atol=1e-4)

    bad = detrain("export", f"model={weights}", "format=tflite")
    assert bad.returncode == 2
    assert (
        bad.stderr.strip() == "error: invalid value for 'format': 'tflite'; expected one of onnx, torchscript, openvino"
    )


# ------------------------------------------------------------------ YOLO26: the end-to-end head's (B, 300, 6)
E2E_IMGSZ = 160  # 400 + 100 + 25 anchors: more than max_det, so the top-k really selects


@pytest.fixture(scope="module")
def e2e_model() -> DetectionModel:
    torch.manual_seed(0)
    m = DetectionModel("yolo26n.yaml", nc=3, names={0: "a", 1: "b", 2: "c"})
    g = torch.Generator().manual_seed(1)
    for bn in (x for x in m.modules() if isinstance(x, nn.BatchNorm2d)):
        bn.running_mean.copy_(torch.randn(bn.num_features, generator=g) * 0.1)
        bn.running_var.copy_(torch.rand(bn.num_features, generator=g) + 0.5)
    for p in m.parameters():  # class logits far from their prior, so scores spread and the top-k order is clear
        p.data.add_(torch.randn(p.shape, generator=g) * 0.02)
    return m


def _same_detections(got: torch.Tensor, want: torch.Tensor) -> None:
    """(B, k, 6) top-k outputs: the same scores, best first, and every detection of ``got`` (above the cut-off, where
    pairs of equal score may swap in or out) found in ``want`` with the same class, box and score."""
    assert got.shape == want.shape
    for g, w in zip(got, want):
        torch.testing.assert_close(g[:, 4], w[:, 4], rtol=1e-4, atol=1e-4)  # scores, best first
        above = g[g[:, 4] > w[-1, 4] + 1e-4]
        assert len(above) > len(g) // 2
        for row in above:
            same_class = w[:, 5] == row[5]
            box = (w[:, :4] - row[:4]).abs().amax(1) + (w[:, 4] - row[4]).abs() * 1e3
            assert bool(same_class.any()) and box[same_class].min() < 2e-3, row.tolist()


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_end_to_end_export_gives_the_top_k_detections(e2e_model: DetectionModel, tmp_path: Path, fmt: str) -> None:
    out = export_model(e2e_model, tmp_path / f"m{SUFFIXES[fmt]}", format=fmt, imgsz=E2E_IMGSZ)
    x = torch.rand(2, 3, E2E_IMGSZ, E2E_IMGSZ, generator=torch.Generator().manual_seed(3))
    want = _reference(e2e_model, x)
    assert want.shape == (2, 300, 6)
    if fmt == "onnx":
        ort = pytest.importorskip("onnxruntime")
        session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        (got,) = session.run(None, {"images": x.numpy()})
        meta = session.get_modelmeta().custom_metadata_map
        assert meta["output"].startswith("detections (B, max_det, 6)")
        got = torch.from_numpy(got)
    else:
        extra = {"detrain.json": ""}
        with torch.no_grad():
            got = torch.jit.load(str(out), map_location="cpu", _extra_files=extra)(x)
        assert json.loads(extra["detrain.json"])["output"].startswith("detections (B, max_det, 6)")
    _same_detections(got, want)


def test_end_to_end_export_with_nms_gives_the_one_to_many_boxes(e2e_model: DetectionModel, tmp_path: Path) -> None:
    out = export_torchscript(e2e_model, tmp_path / "m.torchscript", imgsz=E2E_IMGSZ, nms=True)
    x = torch.rand(1, 3, E2E_IMGSZ, E2E_IMGSZ, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = torch.jit.load(str(out), map_location="cpu")(x)
    assert got.shape == (1, 4 + 3, 525)
    e2e_model.set_inference(nms=True)
    try:
        torch.testing.assert_close(got, _reference(e2e_model, x), rtol=1e-4, atol=1e-3)
    finally:
        e2e_model.set_inference()
    assert e2e_model.head.end2end  # the model passed in keeps its own inference options
