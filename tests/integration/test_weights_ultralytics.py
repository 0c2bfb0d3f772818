"""Ultralytics checkpoints are read without Ultralytics, nothing in them runs, and they map onto our model."""

from __future__ import annotations

import builtins
import copy
import functools
import hashlib
import importlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import types
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _ultralytics import load_ultralytics_checkpoint, to_detrain_model
from torch import nn

from detrain.errors import CheckpointError
from detrain.weights.ultralytics import InertObject, is_ultralytics_record, read_torch_zip

SHARED = Path(__file__).resolve().parents[3] / "shared"
YOLOV8N = SHARED / "weights" / "yolov8n.pt"
IMAGE = SHARED / "data" / "coco8" / "images" / "val" / "000000000036.jpg"


# --------------------------------------------------------------------------------------------------
# Helpers: fake "ultralytics" modules so the test can pickle objects under Ultralytics' class names
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_ultralytics(monkeypatch: pytest.MonkeyPatch) -> dict[str, types.ModuleType]:
    """Register empty ``ultralytics.*`` modules so pickle can name classes placed in them (undone after)."""
    mods: dict[str, types.ModuleType] = {}
    names = ("ultralytics", "ultralytics.nn", "ultralytics.nn.tasks", "ultralytics.nn.modules", "ultralytics.utils")
    for name in names:
        mod = types.ModuleType(name)
        mod.__path__ = []  # a package, so the dotted children import from sys.modules
        mods[name] = mod
        monkeypatch.setitem(sys.modules, name, mod)
    return mods


def _stub_class(module: types.ModuleType, name: str) -> type:
    if not hasattr(module, name):
        cls = type(name, (), {})
        cls.__module__ = module.__name__
        setattr(module, name, cls)
    return getattr(module, name)


def _stub_module_tree(m: nn.Module, mods: dict[str, types.ModuleType], root: bool = False) -> Any:
    """An object that pickles the way an Ultralytics nn.Module does: a class by name plus its __dict__."""
    home = mods["ultralytics.nn.tasks" if root else "ultralytics.nn.modules"]
    obj = _stub_class(home, type(m).__name__)()
    obj.__dict__.update(
        training=m.training,
        _parameters=OrderedDict(
            (k, None if v is None else nn.Parameter(v.detach().half(), requires_grad=v.requires_grad))
            for k, v in m._parameters.items()
        ),
        _buffers=OrderedDict(m._buffers),
        _non_persistent_buffers_set=set(m._non_persistent_buffers_set),
        _modules=OrderedDict((k, _stub_module_tree(c, mods)) for k, c in m._modules.items()),
    )
    return obj


def _write_pickle_zip(path: Path, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{path.stem}/data.pkl", data)
        zf.writestr(f"{path.stem}/version", "3\n")
    return path


class _Call:
    """Pickles as a call of ``fn(*args)``: the classic way a pickle runs code when it is loaded."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------------------------------
# Malicious files: refused, and nothing in them runs
# --------------------------------------------------------------------------------------------------


def _payloads(marker: Path) -> dict[str, tuple[Any, str]]:
    """name -> (object to pickle as a checkpoint, the global the refusal must name)."""
    touch = f"touch {marker}"
    system = f"{os.system.__module__}.system"  # posix.system here; nt.system on Windows
    return {
        "os.system": ({"model": _Call(os.system, touch)}, system),
        "builtins.eval": ({"model": _Call(builtins.eval, f"__import__('os').system({touch!r})")}, "builtins.eval"),
        "builtins.exec": ({"model": _Call(builtins.exec, f"open({str(marker)!r}, 'w').close()")}, "builtins.exec"),
        "subprocess.Popen": ({"model": _Call(subprocess.Popen, ["touch", str(marker)])}, "subprocess.Popen"),
        "nested system call": ({"train_args": {"a": [({"b": (1, _Call(os.system, touch))},)]}}, system),
        "nested bare global": ({"train_args": {"hooks": [[{"x": (os.system,)}]]}}, system),
        "functools.partial": ({"model": _Call(functools.partial(os.system, touch))}, "functools.partial"),
        "builtins.getattr": ({"model": _Call(getattr, "text", "upper")}, "builtins.getattr"),
        "importlib.import_module": ({"model": _Call(importlib.import_module, "os")}, "importlib.import_module"),
    }


@pytest.mark.parametrize("protocol", [0, 2])
@pytest.mark.parametrize(
    "variant",
    [
        "os.system",
        "builtins.eval",
        "builtins.exec",
        "subprocess.Popen",
        "nested system call",
        "nested bare global",
        "functools.partial",
        "builtins.getattr",
        "importlib.import_module",
    ],
)
def test_malicious_pickle_is_refused_and_never_runs(tmp_path: Path, variant: str, protocol: int) -> None:
    marker = tmp_path / "pwned"
    obj, target = _payloads(marker)[variant]
    path = _write_pickle_zip(tmp_path / "evil.pt", pickle.dumps(obj, protocol=protocol))
    with pytest.raises(CheckpointError) as err:
        load_ultralytics_checkpoint(path)
    assert str(err.value) == f"refusing to load {path}: it asks to call {target}"
    assert not marker.exists()


def test_the_payload_is_live(tmp_path: Path) -> None:
    """Control: a plain unpickler does run the os.system payload, so the refusals above are real."""
    marker = tmp_path / "pwned"
    obj, _ = _payloads(marker)["os.system"]
    pickle.loads(pickle.dumps(obj, protocol=2))
    assert marker.exists()


def test_reduce_inside_the_model_state_is_refused(tmp_path: Path, fake_ultralytics: dict) -> None:
    marker = tmp_path / "pwned"
    model = _stub_class(fake_ultralytics["ultralytics.nn.tasks"], "DetectionModel")()
    model.__dict__.update(
        _parameters=OrderedDict(),
        _buffers=OrderedDict(),
        _modules=OrderedDict({"0": _Call(os.system, f"touch {marker}")}),
        yaml={"nc": 1},
    )
    path = tmp_path / "evil_model.pt"
    torch.save({"model": model, "ema": None}, path, pickle_protocol=2)
    with pytest.raises(CheckpointError, match=r"it asks to call (posix|nt)\.system$"):
        load_ultralytics_checkpoint(path)
    assert not marker.exists()


def test_calls_into_ultralytics_names_only_make_records(tmp_path: Path, fake_ultralytics: dict) -> None:
    """Even a function in an allowed namespace is never imported or called: the call becomes a record."""
    marker = tmp_path / "ran"
    utils = fake_ultralytics["ultralytics.utils"]

    def boom(p: str) -> None:
        Path(p).touch()

    boom.__module__, boom.__qualname__ = utils.__name__, "boom"
    utils.boom = boom
    path = _write_pickle_zip(tmp_path / "calls.pt", pickle.dumps({"x": _Call(boom, str(marker))}, protocol=2))
    out = read_torch_zip(path)
    assert isinstance(out["x"], InertObject)
    assert out["x"].inert_name == "ultralytics.utils.boom"
    assert out["x"].inert_args == (str(marker),)
    assert not marker.exists()


def test_generic_reader_treats_ultralytics_as_inert_only_when_asked(tmp_path: Path, fake_ultralytics: dict) -> None:
    """safe_pickle knows no Ultralytics: its names are records only for a caller that lists the module."""
    from detrain.weights import safe_pickle

    cls = _stub_class(fake_ultralytics["ultralytics.nn.tasks"], "DetectionModel")
    lookalike = types.ModuleType("ultralyticsx")  # a module that merely starts with the same letters
    lookalike_cls = type("Evil", (), {})
    lookalike_cls.__module__ = "ultralyticsx"
    lookalike.Evil = lookalike_cls
    sys.modules["ultralyticsx"] = lookalike
    try:
        path = _write_pickle_zip(tmp_path / "m.pt", pickle.dumps({"model": cls()}, protocol=2))
        with pytest.raises(CheckpointError, match=r"ultralytics\.nn\.tasks\.DetectionModel"):
            safe_pickle.read_torch_zip(path)
        out = safe_pickle.read_torch_zip(path, inert_modules=("ultralytics",))
        assert out["model"].inert_name == "ultralytics.nn.tasks.DetectionModel"
        evil = _write_pickle_zip(tmp_path / "x.pt", pickle.dumps({"x": lookalike_cls()}, protocol=2))
        with pytest.raises(CheckpointError, match=r"ultralyticsx\.Evil"):
            safe_pickle.read_torch_zip(evil, inert_modules=("ultralytics",))
    finally:
        del sys.modules["ultralyticsx"]


# --------------------------------------------------------------------------------------------------
# The zip format itself
# --------------------------------------------------------------------------------------------------


def test_reads_what_torch_save_writes(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    obj = {
        "f32": base,
        "view": base[1:, ::2],  # shares the storage of f32 at an offset and stride
        "f16": torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).half(),
        "i64": torch.tensor([1, -2, 3]),
        "bool": torch.tensor([True, False]),
        "bf16": torch.ones(2, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 3),
        "param": nn.Parameter(torch.ones(2, 2)),
        "meta": OrderedDict(a=torch.Size([1, 2]), b={1, 2}, c=frozenset({3}), d=slice(1, 5, 2), e=torch.float16),
        "np": np.float64(2.5),
        "bytes": b"\x00\xff",
    }
    for protocol in (2, 4):
        path = tmp_path / f"plain{protocol}.pt"
        torch.save(obj, path, pickle_protocol=protocol)
        got = read_torch_zip(path)
        want = torch.load(path, weights_only=False)
        assert got.keys() == want.keys()
        for k in ("f32", "view", "f16", "i64", "bool", "bf16", "empty", "param"):
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
        assert got["meta"] == want["meta"]
        assert got["np"] == 2.5 and got["bytes"] == b"\x00\xff"
        assert not is_ultralytics_record(got)


def test_big_endian_records_are_swapped(tmp_path: Path) -> None:
    t = torch.tensor([1.5, -2.25, 3e8], dtype=torch.float32)
    little = tmp_path / "little.pt"
    torch.save(t, little)
    big = tmp_path / "big.pt"
    with zipfile.ZipFile(little) as src, zipfile.ZipFile(big, "w") as dst:
        for name in src.namelist():
            data = src.read(name)
            if name.endswith("/byteorder"):
                data = b"big"
            elif "/data/" in name:
                data = np.frombuffer(data, dtype="<f4").astype(">f4").tobytes()
            dst.writestr(name, data)
        if not any(n.endswith("/byteorder") for n in src.namelist()):
            dst.writestr("little/byteorder", b"big")
    assert torch.equal(read_torch_zip(big), t)


def test_missing_and_non_zip_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"^weights file not found: "):
        load_ultralytics_checkpoint(tmp_path / "absent.pt")
    text = tmp_path / "notes.pt"
    text.write_text("hello")
    with pytest.raises(CheckpointError, match="not a torch zip checkpoint"):
        load_ultralytics_checkpoint(text)


def test_a_plain_state_dict_is_not_an_ultralytics_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "sd.pt"
    torch.save({"model": {"w": torch.ones(1)}}, path)
    with pytest.raises(CheckpointError, match="no 'model' or 'ema' entry"):
        load_ultralytics_checkpoint(path)


# --------------------------------------------------------------------------------------------------
# A synthetic Ultralytics-shaped checkpoint (no shared files needed)
# --------------------------------------------------------------------------------------------------


def _synthetic_checkpoint(tmp_path: Path, mods: dict, *, with_scale: bool, ema: bool) -> tuple[Path, nn.Module]:
    from detrain.nn.model import DetectionModel

    ours = DetectionModel(scale="n", nc=3, names={0: "a", 1: "b", 2: "c"}).eval()
    root = _stub_module_tree(ours, mods, root=True)
    yaml_cfg = {k: v for k, v in ours.yaml.items() if with_scale or k != "scale"}
    root.__dict__.update(yaml=yaml_cfg, names={0: "a", 1: "b", 2: "c"}, stride=torch.tensor([8.0, 16.0, 32.0]))
    ckpt = {
        "epoch": 7,
        "model": None if ema else root,
        "ema": root if ema else None,
        "train_args": types.SimpleNamespace(imgsz=320, epochs=10),
        "date": "2024-01-01T00:00:00",
        "version": "8.1.0",
    }
    path = tmp_path / "synthetic.pt"
    torch.save(ckpt, path, pickle_protocol=2)
    with torch.no_grad():  # what the half-precision file holds, back in float32
        for p in ours.parameters():
            p.copy_(p.half().float())
    return path, ours


@pytest.mark.parametrize(("with_scale", "ema"), [(True, False), (False, True)])
def test_synthetic_checkpoint_round_trip(tmp_path: Path, fake_ultralytics: dict, with_scale: bool, ema: bool) -> None:
    path, ours = _synthetic_checkpoint(tmp_path, fake_ultralytics, with_scale=with_scale, ema=ema)
    assert is_ultralytics_record(read_torch_zip(path))
    info = load_ultralytics_checkpoint(path)
    assert list(info["state_dict"]) == list(ours.state_dict())  # same names, same order, no 'stride'
    assert info["nc"] == 3 and info["names"] == {0: "a", 1: "b", 2: "c"}
    assert info["stride"] == [8.0, 16.0, 32.0]
    assert info["imgsz"] == 320 and info["scale"] == "n" and info["epoch"] == 7
    assert info["date"] == "2024-01-01T00:00:00" and info["version"] == "8.1.0"
    model = to_detrain_model(info).eval()
    for (k, a), b in zip(model.state_dict().items(), ours.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), k
    x = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ours(x))


def test_mismatched_shapes_are_listed(tmp_path: Path, fake_ultralytics: dict) -> None:
    path, _ = _synthetic_checkpoint(tmp_path, fake_ultralytics, with_scale=True, ema=False)
    info = load_ultralytics_checkpoint(path)
    sd = dict(info["state_dict"])
    del sd["model.0.conv.weight"]
    sd["model.22.dfl.conv.weight"] = torch.zeros(1, 8, 1, 1)
    sd["model.99.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError) as err:
        to_detrain_model({**info, "state_dict": sd})
    message = str(err.value)
    assert "\n" not in message
    assert "missing model.0.conv.weight (expected shape (16, 3, 3, 3))" in message
    assert "model.22.dfl.conv.weight has shape (1, 8, 1, 1), expected (1, 16, 1, 1)" in message
    assert "unexpected model.99.weight" in message


# --------------------------------------------------------------------------------------------------
# The real YOLOv8n release file
# --------------------------------------------------------------------------------------------------

needs_yolov8n = pytest.mark.skipif(not YOLOV8N.is_file(), reason="shared/weights/yolov8n.pt is not present")


@pytest.fixture(scope="module")
def yolov8n_info() -> dict[str, Any]:
    return load_ultralytics_checkpoint(YOLOV8N)


@needs_yolov8n
def test_yolov8n_reads(yolov8n_info: dict[str, Any]) -> None:
    digest = _sha256(YOLOV8N)
    assert digest.startswith("31e20dde") and digest.endswith("f2ef95")
    assert is_ultralytics_record(read_torch_zip(YOLOV8N))
    info = yolov8n_info
    assert info["nc"] == 80 and len(info["names"]) == 80
    assert info["names"][0] == "person" and info["names"][79] == "toothbrush"
    assert info["stride"] == [8.0, 16.0, 32.0]
    assert info["scale"] == "n" and info["imgsz"] == 640
    assert "model.22.dfl.conv.weight" in info["state_dict"]


@needs_yolov8n
def test_yolov8n_detects_on_a_real_image(yolov8n_info: dict[str, Any]) -> None:
    import cv2
    from torchvision.ops import box_iou

    model = to_detrain_model(yolov8n_info).eval()
    assert set(model.state_dict()) == set(yolov8n_info["state_dict"])
    assert all(v.dtype == torch.float32 for v in model.state_dict().values() if v.is_floating_point())

    bgr = cv2.imread(str(IMAGE))
    assert bgr is not None
    h0, w0 = bgr.shape[:2]
    gain = 640 / max(h0, w0)
    resized = cv2.resize(bgr, (round(w0 * gain), round(h0 * gain)), interpolation=cv2.INTER_LINEAR)
    canvas = np.full((640, 640, 3), 114, np.uint8)
    canvas[: resized.shape[0], : resized.shape[1]] = resized[:, :, ::-1]  # RGB, padded right/bottom
    x = torch.from_numpy(canvas).permute(2, 0, 1)[None].float() / 255
    with torch.no_grad():
        out = model(x)[0]  # (84, 8400)
    scores, classes = out[4:].max(0)
    assert scores.max() > 0.5
    confident = set(classes[scores > 0.5].tolist())
    assert {0, 25} <= confident  # the labelled person and umbrella

    # The best person box lands on the labelled person (label: class 0, xywh normalised).
    best = int(torch.where(classes == 0, scores, torch.zeros_like(scores)).argmax())
    cx, cy, w, h = (out[:4, best] / gain).tolist()
    pred = torch.tensor([[cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]])
    lx, ly, lw, lh = 0.671279 * w0, 0.617945 * h0, 0.645759 * w0, 0.726859 * h0
    label = torch.tensor([[lx - lw / 2, ly - lh / 2, lx + lw / 2, ly + lh / 2]])
    assert box_iou(pred, label).item() > 0.7


@pytest.mark.parametrize(
    "data",
    [
        # OrderedDict() then BUILD {'a': 1}: setting state on anything but an inert record is refused
        b"\x80\x02ccollections\nOrderedDict\n)R}X\x01\x00\x00\x00aK\x01sb.",
        # GLOBAL ultralytics.x.Foo (a class) then BUILD (None, {'__setstate__': set}): patching a class
        b"\x80\x02cultralytics.x\nFoo\nN}X\x0c\x00\x00\x00__setstate__c__builtin__\nset\ns\x86b.",
    ],
)
def test_build_is_only_allowed_on_records(tmp_path: Path, data: bytes) -> None:
    path = _write_pickle_zip(tmp_path / "build.pt", data)
    refused = r"^refusing to load .*: it sets the state of a (type|OrderedDict) object"
    with pytest.raises(CheckpointError, match=refused):
        read_torch_zip(path)


# --------------------------------------------------------------------------------------------------
# YOLO11, and what detrain cannot build: the architecture a file records decides, never an assumed YOLOv8
# --------------------------------------------------------------------------------------------------


def _synthetic_file(tmp_path: Path, mods: dict, ours: nn.Module, yaml_cfg: dict, name: str) -> Path:
    """``ours`` pickled under Ultralytics' class names (C3k2, C2PSA, Attention ... as Ultralytics' modules), as a
    stripped release file holds it: the half-precision model, its yaml, names and stride."""
    root = _stub_module_tree(ours, mods, root=True)
    root.__dict__.update(yaml=yaml_cfg, names=dict(ours.names), stride=torch.tensor([8.0, 16.0, 32.0]))
    path = tmp_path / name
    torch.save({"epoch": -1, "model": root, "ema": None, "train_args": {"imgsz": 640}}, path, pickle_protocol=2)
    return path


def _half_rounded(model: nn.Module) -> nn.Module:
    with torch.no_grad():  # what the half-precision file holds, back in float32
        for p in model.parameters():
            p.copy_(p.half().float())
    return model


def test_a_yolo11_file_builds_yolo11_from_the_architecture_it_records(tmp_path: Path, fake_ultralytics: dict) -> None:
    from detrain import Model
    from detrain.nn.model import DetectionModel

    torch.manual_seed(0)
    ours = _half_rounded(DetectionModel("yolo11n.yaml", nc=3, names={0: "a", 1: "b", 2: "c"}).eval())
    yaml_cfg = {**ours.yaml, "yaml_file": "/home/someone/yolo11n.yaml"}
    path = _synthetic_file(tmp_path, fake_ultralytics, ours, yaml_cfg, "yolo11n_like.pt")
    read = read_torch_zip(path)  # every block class of the file is an inert record
    records = {type(r).__name__ for r in _records(read["model"])}
    assert {"C3k2", "C3k", "C2PSA", "PSABlock", "Attention", "DWConv", "Detect"} <= records
    assert all(isinstance(r, InertObject) for r in _records(read["model"]))
    loaded = Model(str(path))
    assert loaded.ckpt is not None and loaded.ckpt["source"] == "yolo11"
    assert loaded.ckpt["model"]["yaml"]["backbone"] == ours.yaml["backbone"]  # the file's own, not a packaged one
    assert "yaml_file" not in loaded.ckpt["model"]["yaml"]
    net = loaded.net.eval()
    assert net.family == "yolo11" and net.scale == "n" and net.head.depthwise_cls
    x = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(net(x), ours(x))


def test_a_yolo26_file_builds_yolo26_from_the_architecture_it_records(tmp_path: Path, fake_ultralytics: dict) -> None:
    from detrain import Model
    from detrain.nn.head_e2e import DetectE2E
    from detrain.nn.model import DetectionModel

    torch.manual_seed(0)
    ours = _half_rounded(DetectionModel("yolo26n.yaml", nc=3, names={0: "a", 1: "b", 2: "c"}).eval())
    path = _synthetic_file(tmp_path, fake_ultralytics, ours, dict(ours.yaml), "yolo26n_like.pt")
    records = {type(r).__name__ for r in _records(read_torch_zip(path)["model"])}
    assert {"C3k2", "PSABlock", "SPPF", "DetectE2E"} <= records  # the file's own class names, read as records
    loaded = Model(str(path))
    assert loaded.ckpt is not None and loaded.ckpt["source"] == "yolo26"
    net = loaded.net.eval()
    assert net.family == "yolo26" and isinstance(net.head, DetectE2E) and net.head.reg_max == 1
    x = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(net(x), ours(x))


def _records(record: InertObject) -> list[InertObject]:
    children = record.attrs().get("_modules") or {}
    return [record] + [r for child in children.values() if child is not None for r in _records(child)]


def _refusal(path: Path) -> str:
    """The one-line error every way of using ``path`` as a model ends in."""
    from detrain import Model

    with pytest.raises(CheckpointError) as err:
        Model(str(path))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}")
    return message


def test_a_file_with_a_module_detrain_does_not_know_is_refused_naming_it(
    tmp_path: Path, fake_ultralytics: dict
) -> None:
    from detrain.nn.model import DetectionModel

    ours = DetectionModel("yolo11n.yaml", nc=2)
    yaml_cfg = copy.deepcopy(ours.yaml)
    yaml_cfg["backbone"][5] = [-1, 1, "SCDown", [512, 3, 2]]  # YOLOv10's downsampling block
    path = _synthetic_file(tmp_path, fake_ultralytics, ours, yaml_cfg, "v10like.pt")
    message = _refusal(path)
    assert "cannot build the model it records: model layer 5: unknown module 'SCDown'" in message


def test_weights_that_do_not_fit_their_architecture_are_named_by_key_and_shape(
    tmp_path: Path, fake_ultralytics: dict
) -> None:
    """The architecture says YOLOv8n, the weights are YOLO11n's: named, where a load used to print 45 lines."""
    from detrain.nn.model import DetectionModel

    eleven = DetectionModel("yolo11n.yaml", nc=2)
    path = _synthetic_file(tmp_path, fake_ultralytics, eleven, DetectionModel("n.yaml", nc=2).yaml, "mixed.pt")
    message = _refusal(path)
    assert message.startswith(f"{path} does not fit the yolov8 n model with nc=2: ")
    assert "model.2.cv2.conv.weight has shape (64, 48, 1, 1), expected (32, 48, 1, 1)" in message
    assert re.search(r"\(and \d+ more\)$", message)


def test_convert_refuses_what_it_could_not_build_and_writes_nothing(
    tmp_path: Path, fake_ultralytics: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    from detrain.cli import main as cli_main
    from detrain.nn.model import DetectionModel

    ours = DetectionModel("yolo11n.yaml", nc=2)  # an end-to-end head with DFL bins: Ultralytics builds it, detrain not
    path = _synthetic_file(tmp_path, fake_ultralytics, ours, {**ours.yaml, "end2end": True}, "e2e.pt")
    out = tmp_path / "out.pt"
    with pytest.raises(SystemExit) as code:
        cli_main(["convert", str(path), str(out)])
    assert code.value.code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "model layer 23 (Detect [2]) cannot be built: an end-to-end head with reg_max 16 (DFL bins)" in err


# --------------------------------------------------------------------------------------------------
# Files Ultralytics itself writes (only where Ultralytics is importable)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ultralytics_yolo(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from _ultralytics import offline_ultralytics

    with offline_ultralytics(tmp_path_factory):
        import ultralytics
        from ultralytics import YOLO

        yield YOLO, ultralytics.__version__


def _saved_as_ultralytics_does(net: nn.Module, path: Path, version: str) -> Path:
    """A checkpoint dict as Ultralytics' trainer saves it (``save_model``): the EMA model in half precision under
    'ema', no 'model', the training arguments as a dict, metrics and metadata beside them."""
    ema = copy.deepcopy(net).half()
    ema.args = {"task": "detect", "imgsz": 320}
    ckpt = {
        "epoch": 0,
        "best_fitness": None,
        "stopper": {"best_fitness": None, "best_epoch": 0},
        "model": None,
        "ema": ema,
        "updates": 12,
        "modelopt": None,
        "optimizer": None,
        "scaler": {},
        "train_args": {"task": "detect", "model": "yolo11n.yaml", "imgsz": 320, "epochs": 1},
        "train_metrics": {"metrics/mAP50(B)": 0.0, "fitness": 0.0},
        "train_results": {},
        "date": "2025-01-01T00:00:00+00:00",
        "version": version,
        "license": "AGPL-3.0 License (https://ultralytics.com/license)",
        "docs": "https://docs.ultralytics.com",
    }
    torch.save(ckpt, path)
    return path


def test_an_ultralytics_yolo11_checkpoint_gives_ultralytics_outputs(ultralytics_yolo: Any, tmp_path: Path) -> None:
    from detrain import Model

    YOLO, version = ultralytics_yolo
    torch.manual_seed(0)
    net = YOLO("yolo11n.yaml").model
    with torch.no_grad():  # trained-looking BatchNorms, so the comparison is not of an identity
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    path = _saved_as_ultralytics_does(net, tmp_path / "yolo11n_ul.pt", version)
    ours = Model(str(path))
    assert ours.ckpt is not None and ours.ckpt["source"] == "yolo11" and ours.net.imgsz == 320
    assert ours.net.family == "yolo11" and ours.net.scale == "n" and ours.net.nc == 80
    reference = torch.load(path, weights_only=False)["ema"].float().eval()  # the same half weights, run by them
    x = torch.rand(2, 3, 320, 256, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(x)[0]
        got = ours.net.eval()(x)
    assert got.shape == want.shape == (2, 84, 1680)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _by_score(dets: torch.Tensor) -> torch.Tensor:
    """End-to-end detections (B, k, 6) with each image's rows sorted by score, best first (then by box and class):
    top-k lists rows of equal score in an order of its own."""
    rows = []
    for d in dets:
        keys = [d[:, j].numpy() for j in (5, 3, 2, 1, 0)] + [-d[:, 4].numpy()]  # np.lexsort: the last key first
        rows.append(d[torch.from_numpy(np.lexsort(keys))])
    return torch.stack(rows)


def test_an_ultralytics_yolo26_checkpoint_gives_ultralytics_outputs(ultralytics_yolo: Any, tmp_path: Path) -> None:
    from detrain import Model
    from detrain.nn.head_e2e import DetectE2E

    YOLO, version = ultralytics_yolo
    torch.manual_seed(0)
    net = YOLO("yolo26n.yaml").model
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # trained-looking: BatchNorms away from identity, every weight nudged (no ties in score)
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    path = _saved_as_ultralytics_does(net, tmp_path / "yolo26n_ul.pt", version)
    ours = Model(str(path))
    assert ours.ckpt is not None and ours.ckpt["source"] == "yolo26" and ours.net.imgsz == 320
    assert ours.net.family == "yolo26" and ours.net.scale == "n" and isinstance(ours.net.head, DetectE2E)
    reference = torch.load(path, weights_only=False)["ema"].float().eval()  # the same half weights, run by them
    x = torch.rand(2, 3, 320, 256, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference.end2end = True  # Ultralytics' NMS-free inference (its nms=False): top-300 of the one-to-one branch
        want = reference(x)[0]
        got = ours.net.eval()(x)
    assert got.shape == want.shape == (2, 300, 6)
    torch.testing.assert_close(_by_score(got), _by_score(want), rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # the one-to-many branch, decoded for NMS, on both sides
        reference.end2end = False
        ours.net.head.end2end = False
        want, got = reference(x)[0], ours.net(x)
    assert got.shape == want.shape == (2, 84, 1680)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_an_ultralytics_yolo26_file_detrain_cannot_build_is_refused_in_one_line(
    ultralytics_yolo: Any, tmp_path: Path
) -> None:
    """Ultralytics also builds YOLO26 with DFL bins (reg_max 16); detrain names the layer and what it lacks."""
    from ultralytics.nn.tasks import DetectionModel as UltralyticsModel
    from ultralytics.nn.tasks import yaml_model_load

    _, version = ultralytics_yolo
    net = UltralyticsModel({**yaml_model_load("yolo26n.yaml"), "reg_max": 16}, verbose=False)
    assert net.model[-1].reg_max == 16 and net.model[-1].one2one_cv2 is not None
    path = _saved_as_ultralytics_does(net, tmp_path / "dfl26.pt", version)
    assert _refusal(path) == (
        f"{path}: detrain cannot build the model it records: model layer 23 (Detect [80]) cannot be built: "
        "an end-to-end head with reg_max 16 (DFL bins); detrain builds it with reg_max 1"
    )


def test_a_small_file_cannot_make_detrain_build_a_huge_model(tmp_path: Path, fake_ultralytics: dict) -> None:
    """The recorded architecture is checked against the builder's bounds (a 2**24-channel layer, tens of GB, is
    refused from the yaml alone), then sized on the meta device against the file's own tensors before anything is
    allocated (a layer within the bounds that the file holds no weights for is refused too, not built)."""
    import resource

    from detrain.nn.model import MAX_REPEATS, DetectionModel

    ours = DetectionModel("yolo11n.yaml", nc=2)
    wide = copy.deepcopy(ours.yaml)
    wide["backbone"][1] = [-1, 1, "Conv", [2**26, 3, 2]]
    wide["scales"]["n"] = [0.5, 0.25, 2**30]  # no channel cap: 2**24 channels at width 0.25
    wider = copy.deepcopy(wide)
    wider["backbone"][1] = [-1, 1, "Conv", [2**15, 3, 2]]  # 8192 channels: within the bounds, not in the file
    deep = copy.deepcopy(ours.yaml)
    deep["backbone"][2] = [-1, 10**9, "C3k2", [256, False, 0.25]]
    wide_path = _synthetic_file(tmp_path, fake_ultralytics, ours, wide, "wide.pt")
    wider_path = _synthetic_file(tmp_path, fake_ultralytics, ours, wider, "wider.pt")
    deep_path = _synthetic_file(tmp_path, fake_ultralytics, ours, deep, "deep.pt")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert f"{2**24} output channels at width multiple 0.25; detrain builds at most 8192 per layer" in (
        _refusal(wide_path)
    )
    assert "model.1.conv.weight has shape (32, 16, 3, 3), expected (8192, 16, 3, 3)" in _refusal(wider_path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1 << 20  # KiB: well under 1 GB more
    assert f"model layer 2 (C3k2 [256, False, 0.25]) cannot be built: {5 * 10**8} repeats; detrain builds 0 to " in (
        _refusal(deep_path)
    )
    assert MAX_REPEATS == 32


# --------------------------------------------------------------------------------------------------
# The example Ultralytics users start from, with a YOLO26 file present locally
# --------------------------------------------------------------------------------------------------
COCO8 = Path(__file__).resolve().parents[3] / "shared" / "data" / "coco8"


def test_the_yolo26_example_trains_on_two_cpu_workers(
    tmp_path: Path, fake_ultralytics: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Model("yolo26n.pt").train(data="coco8.yaml", epochs=3, device="cpu,cpu")``: the file is an Ultralytics-shaped
    YOLO26n (its own classes pickled), coco8 lies in the datasets folder as a download would leave it; only the image
    size (64, so CI stays quick) and the run folder are added."""
    from detrain import Model
    from detrain.nn.model import DetectionModel

    if not (COCO8 / "images" / "train").is_dir():
        pytest.skip(f"{COCO8} not found")
    datasets = tmp_path / "datasets"
    shutil.copytree(COCO8, datasets / "coco8", ignore=shutil.ignore_patterns("*.cache"))
    monkeypatch.setenv("DETRAIN_DATASETS_DIR", str(datasets))
    torch.manual_seed(0)
    ours = _half_rounded(DetectionModel("yolo26n.yaml", nc=80).eval())
    weights = _synthetic_file(tmp_path, fake_ultralytics, ours, dict(ours.yaml), "yolo26n.pt")
    for name in list(fake_ultralytics):  # the workers are fresh processes: no stub modules there, nor needed
        monkeypatch.delitem(sys.modules, name)

    result = Model(str(weights)).train(
        data="coco8.yaml", epochs=3, device="cpu,cpu", imgsz=64, project=str(tmp_path / "runs"), name="example"
    )
    assert result is not None
    run = Path(result.save_dir)
    rows = (run / "results.csv").read_text().splitlines()
    assert len(rows) == 4 and "train/l1_loss" in rows[0].split(",")
    start = json.loads((run / "events.jsonl").read_text().splitlines()[0])
    assert start["kind"] == "start" and start["world_size"] == 2  # two workers, as device="cpu,cpu" asks
    best = Model(str(run / "weights" / "best.pt"))
    assert best.net.family == "yolo26" and best.net.nc == 80
