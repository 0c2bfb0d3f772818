"""DetectionModel: YOLOv8 names/shapes per scale, train/eval outputs, fuse, channels_last, reset_classes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

from detrain.errors import ConfigError
from detrain.nn.model import DetectionModel, load_model_yaml
from detrain.nn.modules import C2f, Conv, Detect, Upsample, conv2d

# Taken from the official YOLOv8 checkpoints / reference implementation (nc=80): parameter count
# (DFL's fixed weight included), number of state-dict entries, and a few key -> shape pairs.
EXPECTED = {
    "n": (
        3_157_200,
        355,
        {
            "model.0.conv.weight": (16, 3, 3, 3),
            "model.21.cv2.conv.weight": (256, 384, 1, 1),
            "model.9.cv2.conv.weight": (256, 512, 1, 1),
            "model.22.cv3.2.1.conv.weight": (80, 80, 3, 3),
        },
    ),
    "s": (
        11_166_560,
        355,
        {
            "model.0.conv.weight": (32, 3, 3, 3),
            "model.21.cv2.conv.weight": (512, 768, 1, 1),
            "model.9.cv2.conv.weight": (512, 1024, 1, 1),
            "model.22.cv3.2.1.conv.weight": (128, 128, 3, 3),
        },
    ),
    "m": (
        25_902_640,
        475,
        {
            "model.0.conv.weight": (48, 3, 3, 3),
            "model.21.cv2.conv.weight": (576, 1152, 1, 1),
            "model.9.cv2.conv.weight": (576, 1152, 1, 1),
            "model.22.cv3.2.1.conv.weight": (192, 192, 3, 3),
        },
    ),
    "l": (
        43_691_520,
        595,
        {
            "model.0.conv.weight": (64, 3, 3, 3),
            "model.21.cv2.conv.weight": (512, 1280, 1, 1),
            "model.9.cv2.conv.weight": (512, 1024, 1, 1),
            "model.22.cv3.2.1.conv.weight": (256, 256, 3, 3),
        },
    ),
    "x": (
        68_229_648,
        595,
        {
            "model.0.conv.weight": (80, 3, 3, 3),
            "model.21.cv2.conv.weight": (640, 1600, 1, 1),
            "model.9.cv2.conv.weight": (640, 1280, 1, 1),
            "model.22.cv2.0.2.weight": (64, 80, 1, 1),
        },
    ),
}

# YOLOv8n checkpoint keys that exercise every kind of nesting.
N_KEYS = {
    "model.0.bn.running_mean": (16,),
    "model.0.bn.num_batches_tracked": (),
    "model.2.cv1.conv.weight": (32, 32, 1, 1),
    "model.2.cv2.conv.weight": (32, 48, 1, 1),
    "model.2.m.0.cv1.bn.running_mean": (16,),
    "model.2.m.0.cv2.conv.weight": (16, 16, 3, 3),
    "model.4.m.1.cv2.bn.weight": (32,),
    "model.9.cv1.conv.weight": (128, 256, 1, 1),
    "model.12.cv2.conv.weight": (128, 192, 1, 1),
    "model.22.cv2.0.0.conv.weight": (64, 64, 3, 3),
    "model.22.cv2.0.2.weight": (64, 64, 1, 1),
    "model.22.cv2.2.2.bias": (64,),
    "model.22.cv3.0.0.conv.weight": (80, 64, 3, 3),
    "model.22.cv3.2.2.weight": (80, 80, 1, 1),
    "model.22.dfl.conv.weight": (1, 16, 1, 1),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The test machine's few cores are shared; OpenMP threads spinning against other processes make
    # tiny convolutions tens of times slower than a single thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny() -> DetectionModel:
    torch.manual_seed(0)
    return DetectionModel(scale="n", nc=3)


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("scale", list(EXPECTED))
def test_param_counts_and_keys_match_yolov8(scale: str) -> None:
    params, entries, keys = EXPECTED[scale]
    model = DetectionModel(scale=scale, nc=80)
    shapes = _shapes(model)
    assert sum(p.numel() for p in model.parameters()) == params
    assert len(shapes) == entries
    for key, shape in keys.items():
        assert shapes[key] == shape, key
    assert model.stride.tolist() == [8.0, 16.0, 32.0]


def test_yolov8n_key_names() -> None:
    shapes = _shapes(DetectionModel(scale="n"))
    for key, shape in N_KEYS.items():
        assert shapes[key] == shape, key
    assert all(k.startswith("model.") for k in shapes)
    assert max(int(k.split(".")[1]) for k in shapes) == 22


def test_attributes(tiny: DetectionModel) -> None:
    assert tiny.nc == 3 and tiny.reg_max == 16 and tiny.scale == "n"
    assert tiny.names == {0: "0", 1: "1", 2: "2"}
    assert tiny.yaml["nc"] == 3 and tiny.yaml["scale"] == "n"
    assert [layer.i for layer in tiny.model] == list(range(23))
    assert tiny.model[11].f == [-1, 6] and tiny.model[22].f == [15, 18, 21]
    bn = tiny.model[0].bn
    assert (bn.eps, bn.momentum) == (1e-3, 0.03)
    assert not tiny.head.dfl.conv.weight.requires_grad
    assert torch.equal(tiny.head.dfl.conv.weight.flatten(), torch.arange(16.0))


def test_bias_init(tiny: DetectionModel) -> None:
    import math

    for branch, s in zip(tiny.head.cv3, (8, 16, 32)):
        assert torch.allclose(branch[2].bias, torch.full((3,), math.log(5 / 3 / (640 / s) ** 2)))
    for branch in tiny.head.cv2:
        assert torch.all(branch[2].bias == 1.0)


def test_train_and_eval_shapes(tiny: DetectionModel) -> None:
    x = torch.rand(2, 3, 64, 96)
    tiny.train()
    maps = tiny(x)
    assert [tuple(m.shape) for m in maps] == [(2, 67, 8, 12), (2, 67, 4, 6), (2, 67, 2, 3)]
    tiny.eval()
    with torch.no_grad():
        out = tiny(x)
        raw = tiny(x, decode=False)
    assert out.shape == (2, 7, 8 * 12 + 4 * 6 + 2 * 3)
    assert torch.allclose(tiny.decode(raw), out)
    scores = out[:, 4:]
    assert scores.min() >= 0 and scores.max() <= 1
    assert (out[:, 2:4] > 0).all()  # widths and heights


def test_decode_geometry() -> None:
    head = Detect(nc=1, ch=(16, 16, 16), strides=(8, 16, 32))
    # zero DFL logits -> uniform bins -> every distance is 7.5 cells
    maps = [torch.zeros(1, 65, 2, 2), torch.zeros(1, 65, 1, 1), torch.zeros(1, 65, 1, 1)]
    out = head.decode(maps)
    assert torch.allclose(out[0, :4, 0], torch.tensor([4.0, 4.0, 15 * 8, 15 * 8]))  # first cell centre (0.5, 0.5) * 8
    assert torch.allclose(out[0, :2, 5], torch.tensor([16.0, 16.0]))  # the single stride-32 cell
    assert torch.allclose(out[0, 4], torch.full((6,), 0.5))


def test_anchors_are_cached(tiny: DetectionModel) -> None:
    maps = [torch.zeros(1, 67, 4, 4), torch.zeros(1, 67, 2, 2), torch.zeros(1, 67, 1, 1)]
    a1, _ = tiny.head.anchors(maps)
    a2, _ = tiny.head.anchors(maps)
    assert a1 is a2
    a3, _ = tiny.head.anchors([torch.zeros(1, 67, 8, 8), torch.zeros(1, 67, 4, 4), torch.zeros(1, 67, 2, 2)])
    assert a3.shape == (2, 84)


def test_backward_reaches_every_trainable_parameter(tiny: DetectionModel) -> None:
    model = copy.deepcopy(tiny).train()
    loss = sum(m.float().pow(2).mean() for m in model(torch.rand(1, 3, 64, 64)))
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing


def test_fuse_matches_unfused_eval() -> None:
    torch.manual_seed(1)
    model = DetectionModel(scale="n", nc=2).train()
    with torch.no_grad():  # a few steps of BN statistics, so fusing folds non-trivial values
        for _ in range(3):
            model(torch.rand(2, 3, 64, 64))
    model.eval()
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        ref = model(x)
        fused = copy.deepcopy(model).fuse()
        out = fused(x)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in fused.modules())
    torch.testing.assert_close(out[:, 4:], ref[:, 4:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[:, :4], ref[:, :4], atol=1e-3, rtol=1e-4)  # pixels, up to ~100
    assert fused.fuse() is fused  # idempotent


def test_channels_last_matches_contiguous(tiny: DetectionModel) -> None:
    model = copy.deepcopy(tiny).train()
    x = torch.rand(2, 3, 64, 64)
    ref = model(x)
    cl = copy.deepcopy(model).to(memory_format=torch.channels_last)
    out = cl(x.contiguous(memory_format=torch.channels_last))
    assert out[0].is_contiguous(memory_format=torch.channels_last)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    sum(m.sum() for m in out).backward()
    cl.eval()
    with torch.no_grad():
        assert cl(x.contiguous(memory_format=torch.channels_last)).shape == (2, 7, 84)
        fused = copy.deepcopy(cl).fuse()
        assert fused.model[0].conv.weight.is_contiguous(memory_format=torch.channels_last)


def test_reset_classes_keeps_other_weights(tiny: DetectionModel) -> None:
    model = copy.deepcopy(tiny)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.reset_classes(5, {i: f"c{i}" for i in range(5)})
    after = model.state_dict()
    replaced = {f"model.22.cv3.{i}.2.{p}" for i in range(3) for p in ("weight", "bias")}
    assert set(after) == set(before)
    for key, value in before.items():
        if key in replaced:
            assert after[key].shape[0] == 5
        else:
            assert torch.equal(after[key], value), key
    assert model.nc == 5 and model.head.nc == 5 and model.names[4] == "c4"
    model.eval()
    with torch.no_grad():
        assert model(torch.rand(1, 3, 64, 64)).shape == (1, 9, 84)


def test_reset_classes_rebuilds_from_yaml() -> None:
    model = DetectionModel(scale="n", nc=80).reset_classes(2)  # keeps the 80-wide class branch
    assert model.yaml["head_cls_channels"] == 80
    rebuilt = DetectionModel(model.yaml)
    assert _shapes(rebuilt) == _shapes(model)
    rebuilt.load_state_dict(model.state_dict())


def test_yaml_resolution(tmp_path: Path) -> None:
    d, scale = load_model_yaml("yolov8s.yaml")
    assert scale == "s" and d["scales"]["s"] == [0.33, 0.50, 1024]
    assert DetectionModel("yolov8s.yaml", nc=1).scale == "s"
    custom = tmp_path / "mine.yaml"
    d["nc"] = 4
    custom.write_text(yaml.safe_dump(d))
    model = DetectionModel(str(custom), scale="n")
    assert model.nc == 4 and isinstance(model.model[2], C2f)
    assert DetectionModel(names={0: "a", 1: "b"}).nc == 2


def test_ultralytics_style_yaml_dict() -> None:
    # the single-scale form carried inside YOLOv8 checkpoints: depth/width multiples, nn.Upsample args
    d, _ = load_model_yaml("yolov8.yaml")
    d.pop("scales")
    d.update(depth_multiple=0.33, width_multiple=0.25)
    for spec in d["head"]:
        if spec[2] == "Upsample":
            spec[2], spec[3] = "nn.Upsample", ["None", 2, "nearest"]
        if spec[2] == "Detect":
            spec[3] = ["nc"]
    assert _shapes(DetectionModel(d)) == _shapes(DetectionModel(scale="n"))


@pytest.mark.parametrize(
    "kwargs",
    [{"scale": "q"}, {"cfg": "nope.yaml"}, {"nc": 2, "names": {0: "a"}}, {"nc": 0}],
)
def test_config_errors(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        DetectionModel(**kwargs)


def test_conv_fuse_is_a_plain_conv() -> None:
    conv = Conv(3, 8, 3).eval()
    conv.bn.running_mean.uniform_(-1, 1)
    conv.bn.running_var.uniform_(0.5, 2)
    x = torch.rand(1, 3, 8, 8)
    ref = conv(x)
    conv.fuse_()
    torch.testing.assert_close(conv(x), ref, atol=1e-5, rtol=1e-5)


def test_channels_last_gradients_match_contiguous(tiny: DetectionModel) -> None:
    """The channels_last fast paths (1x1 convs as matmuls, the upsample backward, dense C2f halves) change
    nothing beyond float rounding, forward or backward (training-mode BatchNorm magnifies rounding to ~1e-4
    of the largest gradient; a real mistake shows at order one)."""
    torch.manual_seed(0)
    x = torch.rand(2, 3, 64, 64)
    grads, maps = [], []
    for layout in (torch.contiguous_format, torch.channels_last):
        model = copy.deepcopy(tiny).train().to(memory_format=layout)
        out = model(x.contiguous(memory_format=layout))
        weights = [torch.linspace(-1, 1, m.numel()).reshape(m.shape) for m in out]
        sum((m * w).sum() for m, w in zip(out, weights)).backward()
        maps.append([m.detach() for m in out])
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    for a, b in zip(*maps):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-3 * g.abs().max().item(), rtol=1e-3, msg=name)


@pytest.mark.parametrize("bias", [False, True])
def test_pointwise_conv_as_matmul(bias: bool) -> None:
    conv = torch.nn.Conv2d(6, 5, 1, bias=bias)
    x = torch.randn(2, 6, 4, 3).contiguous(memory_format=torch.channels_last).requires_grad_()
    y = conv2d(conv, x)
    assert y.is_contiguous(memory_format=torch.channels_last)
    g = torch.randn_like(y)
    y.backward(g)
    grads = [x.grad.clone(), conv.weight.grad.clone()]
    x.grad = None
    conv.zero_grad()
    ref = conv(x)
    ref.backward(g)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(grads[0], x.grad)
    torch.testing.assert_close(grads[1], conv.weight.grad)
    strided = torch.nn.Conv2d(6, 5, 1, stride=2)
    assert conv2d(strided, x).shape == strided(x).shape  # not a plain 1x1: torch's own convolution


@pytest.mark.parametrize("factor", [2.0, 3.0])  # 3: torch's own path, which must still be taken
def test_upsample_backward_reads_a_strided_gradient(factor: float) -> None:
    x = torch.randn(2, 4, 3, 5).contiguous(memory_format=torch.channels_last).requires_grad_()
    up = Upsample(scale_factor=factor)
    y = up(x)
    torch.testing.assert_close(y, torch.nn.Upsample(scale_factor=factor)(x), rtol=0, atol=0)
    # the gradient a following Concat hands back: a channel slice of a wider channels_last tensor
    wide = torch.randn(2, 7, *y.shape[2:]).contiguous(memory_format=torch.channels_last)
    y.backward(wide[:, 1:5])
    ours = x.grad.clone()
    x.grad = None
    torch.nn.Upsample(scale_factor=factor)(x).backward(wide[:, 1:5])
    torch.testing.assert_close(ours, x.grad)
    assert ours.is_contiguous(memory_format=torch.channels_last)
