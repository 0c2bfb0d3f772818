"""Weights that do not fit, or are not finite (issue 25, item 1): every checkpoint detrain loads (its own, an
Ultralytics import, a ``pretrained=`` file, a resumed run's model and EMA) is one CheckpointError line naming the
tensor: NaN or infinite weights used to load silently and fail training deep in the assigner, a tensor of another
shape or kind ended in torch's multi-line report, class names keyed by text in a traceback.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from _pickle_forge import checkpoint, dict_, list_, storage_tensor, str_, ultralytics_model, write_torch_zip

from detrain import __version__
from detrain.errors import CheckpointError
from detrain.nn.model import DetectionModel
from detrain.weights.checkpoint import (
    FORMAT,
    check_finite,
    load_checkpoint,
    load_weights,
    model_from_checkpoint,
    model_meta,
)


@pytest.fixture(scope="module")
def net() -> DetectionModel:
    torch.manual_seed(0)
    return DetectionModel(nc=2, names={0: "cat", 1: "dog"})


def _state(net: DetectionModel) -> dict[str, Any]:
    meta = copy.deepcopy(model_meta(net, 64))  # the yaml too: a test changes it
    return {"model": {**meta, "state_dict": copy.deepcopy(net.state_dict())}, "ema": None}


def _saved(state: dict[str, Any], path: Path) -> Path:
    """The file as a damaged disk or another program would leave it: torch.save, past save_checkpoint's refusal
    of non-finite weights."""
    torch.save({"format": FORMAT, "version": __version__, **state}, path)
    return path


def _one_line(err: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(err.value)
    assert "\n" not in message and len(message) < 500, message
    return message


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_a_detrain_checkpoint_with_a_non_finite_weight_is_refused_naming_it(
    net: DetectionModel, tmp_path: Path, value: float, dtype: torch.dtype
) -> None:
    state = _state(net)
    weights = state["model"]["state_dict"]
    weights["model.4.m.0.cv1.conv.weight"] = weights["model.4.m.0.cv1.conv.weight"].to(dtype)
    weights["model.4.m.0.cv1.conv.weight"][0, 0, 0, 0] = value
    path = _saved(state, tmp_path / "nan.pt")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert _one_line(err) == (
        f"{path}: weight model.4.m.0.cv1.conv.weight of its 'model' holds NaN or infinite values (a damaged file or a "
        "diverged run); detrain loads only finite weights"
    )


def test_a_non_finite_ema_weight_is_refused_too(net: DetectionModel, tmp_path: Path) -> None:
    state = _state(net)
    ema = copy.deepcopy(state["model"]["state_dict"])
    ema["model.22.cv3.0.2.bias"][1] = float("nan")  # a class bias: the first thing the assigner would meet
    state["ema"] = {"state_dict": ema, "updates": 3}
    path = _saved(state, tmp_path / "ema.pt")
    with pytest.raises(CheckpointError, match=r"weight model\.22\.cv3\.0\.2\.bias of its 'ema' holds NaN") as err:
        load_checkpoint(path)
    _one_line(err)


def test_an_ultralytics_file_with_a_nan_weight_is_refused(tmp_path: Path) -> None:
    """Forged opcode by opcode: a half-precision weight whose bytes are NaN (0x7e00) in an Ultralytics record."""
    params = dict_({"w": storage_tensor("0", 4, (4,))})
    model = ultralytics_model(_parameters=params, names=list_(str_("a")), yaml=dict_({"scale": str_("n")}))
    nan = b"\x00\x3c" * 3 + b"\x00\x7e"  # 1.0, 1.0, 1.0, NaN
    path = write_torch_zip(tmp_path / "ul_nan.pt", checkpoint(model), {"0": nan})
    with pytest.raises(CheckpointError, match=r"weight w of its 'model' holds NaN or infinite values") as err:
        load_checkpoint(path)
    _one_line(err)
    write_torch_zip(tmp_path / "ul_ok.pt", checkpoint(model), {"0": b"\x00\x3c" * 4})
    assert load_checkpoint(tmp_path / "ul_ok.pt")["model"]["state_dict"]["w"].tolist() == [1.0] * 4


def test_a_pretrained_file_with_nan_weights_is_refused_before_anything_is_copied(
    net: DetectionModel, tmp_path: Path
) -> None:
    from detrain.engine.train.pretrained import load_pretrained

    state = _state(net)
    state["model"]["state_dict"]["model.0.bn.running_var"][:] = float("inf")
    path = _saved(state, tmp_path / "pre.pt")
    model = DetectionModel(nc=2)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(CheckpointError, match=r"weight model\.0\.bn\.running_var of its 'model' holds NaN"):
        load_pretrained(model, str(path))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    ("key", "tensor", "fragment"),
    [
        ("model.0.conv.weight", torch.zeros(8, 3, 3, 3), "model.0.conv.weight has shape (8, 3, 3, 3), expected (16,"),
        ("model.22.dfl.conv.weight", torch.zeros(1, 10**4, 1, 1), "has shape (1, 10000, 1, 1), expected (1, 16, 1,"),
        ("model.0.bn.weight", torch.zeros(16, dtype=torch.int64), "holds torch.int64, expected a floating-point"),
        ("model.0.bn.num_batches_tracked", torch.tensor(0.5), "holds torch.float32, expected an integer type"),
    ],
    ids=["shape", "dfl-bins", "int-for-float", "float-for-int"],
)
def test_a_weight_of_another_shape_or_kind_is_one_line_naming_the_key(
    net: DetectionModel, tmp_path: Path, key: str, tensor: torch.Tensor, fragment: str
) -> None:
    state = _state(net)
    state["model"]["state_dict"][key] = tensor
    path = _saved(state, tmp_path / "shape.pt")
    with pytest.raises(CheckpointError) as err:
        model_from_checkpoint(load_checkpoint(path), source=str(path))
    message = _one_line(err)
    assert message.startswith(f"{path} does not fit the yolov8 n model with nc=2: ") and fragment in message


def test_a_resumed_run_loads_its_model_and_ema_through_the_same_check(net: DetectionModel) -> None:
    """What the trainer calls for ``resume=``: torch's own report would be a multi-line traceback."""
    model = DetectionModel(nc=2)
    state = copy.deepcopy(net.state_dict())
    load_weights(model, state, "last.pt")
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    state["model.22.cv2.0.2.weight"] = torch.zeros(64, 64, 3, 3)
    del state["model.0.bn.bias"]
    state["model.99.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError) as err:
        load_weights(model, state, "last.pt (its EMA)")
    assert _one_line(err) == (
        "last.pt (its EMA) does not fit the yolov8 n model with nc=2: missing model.0.bn.bias (expected shape (16,)); "
        "model.22.cv2.0.2.weight has shape (64, 64, 3, 3), expected (64, 64, 1, 1); unexpected model.99.weight"
    )


@pytest.mark.parametrize(
    ("names", "fragment"),
    [({"cat": 0, "dog": 1}, "key 'cat' is not one"), ({0: "cat", 5: "dog"}, "key 5 is not one")],
    ids=["text-keys", "gap"],
)
def test_a_checkpoint_whose_class_names_are_not_indices_is_one_line(
    net: DetectionModel, tmp_path: Path, names: dict[Any, Any], fragment: str
) -> None:
    state = _state(net)
    state["model"]["names"] = names
    path = _saved(state, tmp_path / "names.pt")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    message = _one_line(err)
    assert message.startswith(f"{path}: its class names must map the indices 0 to 1 to names") and fragment in message


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda y: y["scales"].update(n=[0.33, 1e6, 1024]), "depth and width multiples of [0.33, 1000000.0]"),
        (lambda y: y.update(reg_max=10**6), "reg_max must be a whole number of DFL bins (1 to 64)"),
        (lambda y: y["backbone"][2].__setitem__(1, 10**7), "model layer 2 (C2f [128, True]) cannot be built: 3300000"),
        (lambda y: y["backbone"][0].__setitem__(3, [64, "3", 2]), "argument 2 (kernel) must be a whole number"),
    ],
    ids=["width", "reg-max", "repeats", "kernel-text"],
)
def test_a_checkpoint_whose_yaml_asks_too_much_is_refused_before_any_allocation(
    net: DetectionModel, tmp_path: Path, change: Any, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state(net)
    change(state["model"]["yaml"])
    path = _saved(state, tmp_path / "yaml.pt")
    ckpt = load_checkpoint(path)

    def built(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a layer was built before the yaml was refused")

    monkeypatch.setattr(torch.nn.Conv2d, "__init__", built)  # the first thing any of these models allocates
    with pytest.raises(CheckpointError) as err:
        model_from_checkpoint(ckpt, source=str(path))
    message = _one_line(err)
    assert message.startswith(f"{path}: detrain cannot build the model it records: ") and fragment in message


def test_the_finiteness_check_passes_finite_and_integer_tensors(net: DetectionModel) -> None:
    weights = {"w": torch.zeros(10_000_000)}  # three YOLOv8n's worth
    check_finite({"model": {"state_dict": weights}, "ema": {"state_dict": weights}}, "big.pt")
    check_finite({"model": {"state_dict": {"n": torch.tensor(7)}}}, "ints.pt")  # integer tensors: nothing to check
