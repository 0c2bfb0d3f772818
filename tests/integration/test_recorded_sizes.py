"""Sizes a file records and graphs that misbehave (issue 37 item 7).

An export's metadata and a checkpoint's description record the image size the model runs at: an export traces at
it, a fixed-size graph letterboxes every image to it. They are held to the bound of ``imgsz=`` (1 to 8192, read
from the key's spec): a recorded 2**20 is one line naming the file before anything is traced, allocated or run.
An exported graph that fails at run time (onnxruntime's or TorchScript's error) or gives an output of the wrong
shape or type is one line naming the file in ``detrain predict`` and ``detrain val``, not a traceback.

The graphs here are tiny modules exported with torch's own exporters, with detrain's metadata beside them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from torch import nn

from detrain import Model
from detrain.data.synthetic import SHAPE_NAMES, generate_shapes
from detrain.engine.backends import export_summary, load_exported
from detrain.engine.export import _add_metadata
from detrain.errors import CheckpointError, ConfigError, DetrainError
from detrain.nn.model import DetectionModel
from detrain.weights.checkpoint import load_checkpoint, model_meta, save_checkpoint
from detrain.weights.limits import max_imgsz

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # torch's notes on its legacy ONNX exporter
]

SHARED = Path(__file__).resolve().parents[3] / "shared"
YOLOV8N = SHARED / "weights" / "yolov8n.pt"
HUGE = 1 << 20  # 2**20 square: a letterboxed float image of 12 TiB
SIZE = 64


def _meta(imgsz: int = SIZE, **extra: object) -> dict[str, object]:
    """detrain's metadata for a one-class graph of boxes and scores for NMS, free batch and size."""
    return {
        "producer": "detrain",
        "names": {0: "a"},
        "stride": 32,
        "imgsz": [imgsz, imgsz],
        "dynamic": True,
        "free_size": True,
        "end2end": False,
        **extra,
    }


class Boxes(nn.Module):
    """A graph of the right layout: (B, 4 + 1, anchors), one anchor per 32-pixel cell."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = torch.nn.functional.avg_pool2d(x, 32)
        return torch.cat([pooled, pooled[:, :2]], 1).flatten(2)


class WrongShape(nn.Module):
    """A graph whose output is (B, H, W): no layout detrain's postprocess reads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


class FailsWhenRun(nn.Module):
    """A graph that raises when it runs: 3 x 64 x 64 values cannot be viewed as rows of 7 x 5."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(-1, 7, 5)


class Integers(nn.Module):
    """A graph of the right shape but of integers, no scores."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = torch.nn.functional.avg_pool2d(x, 32)
        return torch.cat([pooled, pooled[:, :2]], 1).flatten(2).to(torch.int64)


def _torchscript(module: nn.Module, path: Path, meta: dict[str, object]) -> Path:
    torch.jit.save(torch.jit.script(module), str(path), _extra_files={"detrain.json": json.dumps(meta)})
    return path


def _onnx(module: nn.Module, path: Path, meta: dict[str, object], dynamic: bool = True, at: int = SIZE) -> Path:
    """``module`` traced at (1, 3, ``at``, ``at``); ``dynamic``: batch, height and width free in the graph too."""
    axes = {"images": {0: "batch", 2: "height", 3: "width"}} if dynamic else None
    torch.onnx.export(
        module,
        (torch.zeros(1, 3, at, at),),
        str(path),
        input_names=["images"],
        output_names=["output0"],
        dynamic_axes=axes,
        dynamo=False,
    )
    _add_metadata(path, meta)
    return path


def _export(fmt: str, module: nn.Module, path: Path, meta: dict[str, object], dynamic: bool = True) -> Path:
    if fmt == "onnx":
        pytest.importorskip("onnxruntime")
        return _onnx(module, path.with_suffix(".onnx"), meta, dynamic)
    return _torchscript(module, path.with_suffix(".torchscript"), meta)


def _failing(fmt: str, path: Path, meta: dict[str, object]) -> Path:
    """A graph that raises when served at 64: TorchScript's view of the wrong size; an ONNX graph traced at 32
    alone (its metadata says any size), which onnxruntime refuses to run on a 64 x 64 input."""
    if fmt == "onnx":
        pytest.importorskip("onnxruntime")
        return _onnx(Boxes(), path.with_suffix(".onnx"), meta, dynamic=False, at=32)
    return _torchscript(FailsWhenRun(), path.with_suffix(".torchscript"), meta)


@pytest.fixture
def picture(tmp_path: Path) -> Path:
    path = tmp_path / "p.png"
    cv2.imwrite(str(path), np.full((SIZE, SIZE, 3), 128, np.uint8))
    return path


def _detrain(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The real command; torch's deprecation warning for ``torch.jit.load`` silenced (it is torch's line)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore::FutureWarning"}
    return subprocess.run(
        [sys.executable, "-m", "detrain.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )


def _one_line(done: subprocess.CompletedProcess, start: str) -> None:
    """Exit code 2 and one line on stderr that starts with ``start``: no traceback."""
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(start) and done.stderr.count("\n") == 1, done.stderr


# ------------------------------------------------------------------ recorded sizes


def test_the_bound_is_the_imgsz_keys() -> None:
    from detrain.config.keys import SPECS

    assert max_imgsz() == SPECS["imgsz"].high == 8192


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_an_export_recording_a_huge_size_is_refused_before_it_runs(fmt: str, tmp_path: Path, picture: Path) -> None:
    fixed = _meta(HUGE, free_size=False)  # a fixed-size graph: every image would be letterboxed to 2**20
    path = _export(fmt, Boxes(), tmp_path / "huge", fixed)
    refused = rf"{path.name}: its metadata records imgsz=\[{HUGE}, {HUGE}\] is outside 1 to 8192"
    with pytest.raises(ConfigError, match=refused):
        load_exported(path)
    with pytest.raises(ConfigError, match=refused):
        export_summary(path)  # Model(...)'s view, before it serves
    with pytest.raises(ConfigError, match=refused):
        Model(path).predict(picture, imgsz=SIZE)
    _one_line(_detrain("predict", f"model={path}", f"source={picture}", cwd=tmp_path), f"error: {path}: its metadata")
    at_bound = _export(fmt, Boxes(), tmp_path / "ok", _meta(8192))  # the largest imgsz= takes is taken
    assert load_exported(at_bound).imgsz == (8192, 8192)


def _checkpoint(path: Path, imgsz: int) -> Path:
    model = DetectionModel("yolov8.yaml", scale="n", nc=1, names={0: "a"})
    meta = model_meta(model, SIZE) | {"imgsz": imgsz}
    return save_checkpoint({"model": {**meta, "state_dict": model.state_dict()}, "ema": None}, path)


def test_a_checkpoint_recording_a_huge_size_is_refused_before_export_traces(tmp_path: Path) -> None:
    """20000 passes the cost bound for scale n (8.5 TFLOPs an image, under 10): the export traced at 20000 x 20000
    (12.9 GB); the size itself is now held to imgsz='s bound."""
    path = _checkpoint(tmp_path / "huge.pt", 20000)
    with pytest.raises(CheckpointError, match=r"huge.pt: its model description records imgsz=20000 is outside 1 to"):
        load_checkpoint(path)
    _one_line(_detrain("export", f"model={path}", cwd=tmp_path), f"error: {path}: its model description records")
    assert not list(tmp_path.glob("huge.*onnx*"))
    assert load_checkpoint(_checkpoint(tmp_path / "ok.pt", 8192))["model"]["imgsz"] == 8192


@pytest.mark.skipif(not YOLOV8N.is_file(), reason="needs shared/weights/yolov8n.pt")
@pytest.mark.parametrize("imgsz", [20000, [640, 1 << 20], 0])
def test_an_ultralytics_file_recording_a_size_out_of_bounds_is_refused(imgsz: object) -> None:
    from detrain.weights import ultralytics as ul

    vetted = ul.read_torch_zip(YOLOV8N)
    assert ul.ultralytics_info(vetted, YOLOV8N)["imgsz"] == 640
    vetted["train_args"] = {"imgsz": imgsz}
    with pytest.raises(CheckpointError, match=r"yolov8n.pt: its training arguments record imgsz=.* outside 1 to"):
        ul.ultralytics_info(vetted, YOLOV8N)


# ------------------------------------------------------------------ graphs that misbehave when they run


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
@pytest.mark.parametrize(
    ("wrong", "said"),
    [
        ("fails", "the exported graph failed on a (1, 3, 64, 64) batch ("),
        ("shape", "the exported graph gave a (1, 64, 64) tensor for a (1, 3, 64, 64) batch, where (1, 5, anchors)"),
    ],
    ids=["fails", "shape"],
)
def test_a_graph_that_fails_or_gives_a_wrong_shape_is_one_line_naming_the_file(
    fmt: str, wrong: str, said: str, tmp_path: Path, picture: Path
) -> None:
    bad = tmp_path / "bad"
    path = _failing(fmt, bad, _meta()) if wrong == "fails" else _export(fmt, WrongShape(), bad, _meta())
    with pytest.raises(DetrainError) as info:
        Model(path).predict(picture, imgsz=SIZE)
    assert str(info.value).startswith(f"{path}: {said}") and "\n" not in str(info.value), info.value
    _one_line(
        _detrain("predict", f"model={path}", f"source={picture}", f"imgsz={SIZE}", cwd=tmp_path), f"error: {path}"
    )


def test_a_graph_of_integers_is_one_line(tmp_path: Path) -> None:
    path = _export("torchscript", Integers(), tmp_path / "ints", _meta())
    with pytest.raises(DetrainError, match=r"ints.torchscript: the exported graph gave a \(2, 5, 4\) tensor of int64"):
        load_exported(path)(torch.zeros(2, 3, SIZE, SIZE))
    assert load_exported(_export("torchscript", Boxes(), tmp_path / "ok", _meta()))(
        torch.zeros(2, 3, 64, 64)
    ).shape == (
        2,
        5,
        4,
    )


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_val_of_a_graph_that_fails_is_one_line(fmt: str, tmp_path: Path) -> None:
    data = generate_shapes(tmp_path / "shapes", n_train=2, n_val=2, imgsz=SIZE, seed=0) / "data.yaml"
    path = _failing(fmt, tmp_path / "bad", _meta(names=dict(enumerate(SHAPE_NAMES))))
    done = _detrain("val", f"model={path}", f"data={data}", f"imgsz={SIZE}", "device=cpu", "workers=0", cwd=tmp_path)
    _one_line(done, f"error: {path}: the exported graph failed on a ")
