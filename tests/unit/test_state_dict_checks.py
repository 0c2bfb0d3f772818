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

YOLOV8N = Path(__file__).resolve().parents[2].parent / "shared" / "weights" / "yolov8n.pt"


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


def _views_of_one_storage(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every floating-point weight a view of one flat tensor as long as the largest: what torch saves
    of it is that one tensor, yet the model it describes is whole."""
    largest = max(t.numel() for t in state.values())
    flat = torch.full((largest,), 0.5)
    return {k: flat[: v.numel()].view(v.shape) if v.is_floating_point() else v.clone() for k, v in state.items()}


@pytest.mark.parametrize("where", ["model", "ema"])
def test_weights_that_are_views_of_one_storage_are_refused(net: DetectionModel, tmp_path: Path, where: str) -> None:
    """Security finding: weights saved as views of one storage made a 19 MB file build a 267-million-parameter
    model (2.8 GB). Here the YOLOv8n's 3.2 million weights come from a file storing 295,000 of them (1.2 MB)."""
    state = _state(net)
    views = _views_of_one_storage(state["model"]["state_dict"])
    if where == "ema":
        state["ema"] = {"state_dict": views, "updates": 1}
    else:
        state["model"]["state_dict"] = views
    path = _saved(state, tmp_path / "views.pt")
    if where == "model":  # the file: 1.2 MB, the model it describes: 12 MB of float32 weights
        assert path.stat().st_size < 1.3e6 < 1.2e7 < sum(t.numel() * t.element_size() for t in views.values())
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    first = "model.6.m.1.cv1.conv.weight"  # the first key whose bytes the file has already given to others
    assert _one_line(err) == (
        f"{path}: weight {first} of its '{where}' shares its stored bytes with other weights (overlapping views of "
        "one stored tensor): its weights need 11.5 MiB where the file stores 1.1 MiB; detrain loads only weights "
        "stored apart"
    )


def test_an_ultralytics_file_whose_weights_overlap_is_refused(tmp_path: Path) -> None:
    """Forged opcode by opcode: two Ultralytics parameters over the one 4-element storage ``data/0``."""
    params = dict_({"w": storage_tensor("0", 4, (4,)), "v": storage_tensor("0", 4, (2, 2))})
    model = ultralytics_model(_parameters=params, names=list_(str_("a")), yaml=dict_({"scale": str_("n")}))
    path = write_torch_zip(tmp_path / "ul_views.pt", checkpoint(model), {"0": b"\x00\x3c" * 4})
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert _one_line(err).startswith(f"{path}: weight v of its 'model' shares its stored bytes with other weights")
    alone = dict_({"w": storage_tensor("0", 4, (4,)), "v": storage_tensor("1", 4, (2, 2))})
    model = ultralytics_model(_parameters=alone, names=list_(str_("a")), yaml=dict_({"scale": str_("n")}))
    path = write_torch_zip(tmp_path / "ul_apart.pt", checkpoint(model), {"0": b"\x00\x3c" * 4, "1": b"\x00\x3c" * 4})
    assert load_checkpoint(path)["model"]["state_dict"]["v"].tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_weights_sharing_a_storage_without_overlapping_still_load(net: DetectionModel, tmp_path: Path) -> None:
    """Slices of one tensor (as a fused layer split into parts would be saved) share a storage, not bytes."""
    state = _state(net)
    weights = state["model"]["state_dict"]
    flat = torch.cat([weights["model.0.bn.weight"], weights["model.0.bn.bias"]])
    weights["model.0.bn.weight"], weights["model.0.bn.bias"] = flat[:16], flat[16:]
    path = _saved(state, tmp_path / "slices.pt")
    ckpt = load_checkpoint(path)
    loaded = ckpt["model"]["state_dict"]
    storages = {loaded[k].untyped_storage().data_ptr() for k in ("model.0.bn.weight", "model.0.bn.bias")}
    assert len(storages) == 1
    model = model_from_checkpoint(ckpt, source=str(path))
    assert torch.equal(model.state_dict()["model.0.bn.bias"], net.state_dict()["model.0.bn.bias"])


def test_detrain_and_ultralytics_checkpoints_still_load_and_build(net: DetectionModel, tmp_path: Path) -> None:
    """What save_checkpoint writes (model and EMA) and the YOLOv8n release file share no storage, and cost what
    ``detrain info`` says (well under the bound)."""
    from detrain.nn.info import MAX_GFLOPS, check_cost
    from detrain.weights.checkpoint import save_checkpoint

    state = _state(net)
    state["ema"] = {"state_dict": copy.deepcopy(state["model"]["state_dict"]), "updates": 5}
    path = save_checkpoint(state, tmp_path / "best.pt")
    model = model_from_checkpoint(load_checkpoint(path), source=str(path))
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in model.state_dict().items())
    if YOLOV8N.is_file():
        model = model_from_checkpoint(load_checkpoint(YOLOV8N), source=str(YOLOV8N))
        assert round(check_cost(model, 640, [8, 16, 32]), 1) == 8.7 < MAX_GFLOPS


def test_a_model_costing_too_much_an_image_is_refused_before_it_is_built(
    net: DetectionModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cost of one image at the size the file records is bounded like the parameter count: a YOLOv8n that
    records imgsz=32768 would cost 21 TFLOPs an image (an export at its training size); with the bound lowered to
    5 GFLOPs, the same model at 640 (8.1 with 2 classes) is refused and at 320 (2.0) loads."""
    import detrain.nn.info as info
    import detrain.weights.checkpoint as checkpoint_module

    def built(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("weights were loaded into a model before its cost was refused")

    state = _state(net)
    state["model"]["imgsz"] = 32768
    path = _saved(state, tmp_path / "huge.pt")
    with pytest.raises(CheckpointError, match=r"records imgsz=32768 is outside 1 to 8192"):
        load_checkpoint(path)  # a file's recorded size is bounded as imgsz= is (issue 37 item 7) ...
    ckpt = torch.load(path, weights_only=True)  # ... and a checkpoint built in memory is bounded by its cost
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint_module, "load_weights", built)
        with pytest.raises(CheckpointError) as err:
            model_from_checkpoint(ckpt, source=str(path))
    assert _one_line(err) == (
        f"{path}: detrain cannot build the model it records: at imgsz=32768 it costs 21,188.4 GFLOPs an image, more "
        "than the 10,000 detrain runs (YOLOv8x: 258 at 640)"
    )
    monkeypatch.setattr(info, "MAX_GFLOPS", 5)
    for imgsz, refused in ((640, True), (320, False)):
        state["model"]["imgsz"] = imgsz
        ckpt = load_checkpoint(_saved(state, tmp_path / f"at{imgsz}.pt"))
        if refused:
            with pytest.raises(CheckpointError, match=r"at imgsz=640 it costs 8\.1 GFLOPs an image, more than the 5 "):
                model_from_checkpoint(ckpt)
        else:
            assert model_from_checkpoint(ckpt).imgsz == imgsz
    state["model"]["imgsz"] = 10**9
    with pytest.raises(CheckpointError, match=r"it records imgsz=1000000000, more than the 65536 detrain runs a model"):
        model_from_checkpoint(torch.load(_saved(state, tmp_path / "absurd.pt"), weights_only=True))
