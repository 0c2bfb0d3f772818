"""ONNX export: the exported graph gives what the torch model gives, for any batch size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from detrain.errors import ConfigError
from detrain.export import export_onnx
from detrain.nn.model import DetectionModel

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
