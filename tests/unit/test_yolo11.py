"""YOLO11: its blocks and head build under Ultralytics' names and shapes at every scale, train and infer like YOLOv8,
and the builder's YOLO11 rules (C3k inner blocks at m/l/x, the depthwise class branch) and refusals hold.

The Ultralytics comparisons run only where Ultralytics is importable (``PYTHONPATH=$PWD:/opt/ulib``); the pinned
figures are Ultralytics' own (the summaries in its yolo11.yaml), so the rest holds without it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml
from _ultralytics import offline_ultralytics

from detrain.engine.build import architecture
from detrain.errors import ConfigError
from detrain.nn.blocks11 import C2PSA, Attention, C3k, C3k2
from detrain.nn.info import model_info
from detrain.nn.model import (
    DetectionModel,
    build_layers,
    bundled_scale,
    family,
    load_model_yaml,
    packaged_architecture,
)
from detrain.nn.modules import Bottleneck, Conv, Detect, DWConv

# Ultralytics 8.4.190's parameter counts for the 80-class YOLO11 (its yolo11.yaml summaries).
PARAMS = {"n": 2_624_080, "s": 9_458_752, "m": 20_114_688, "l": 25_372_160, "x": 56_966_176}
# Our GFLOPs at 640 (convolutions and the attention's matrix products, 2 FLOPs per multiply-accumulate).
GFLOPS = {"n": 6.54, "s": 21.59, "m": 68.10, "l": 87.15, "x": 195.27}
# yolo11n from Ultralytics 8.4.190: state-dict entries and a few key -> shape pairs of each new part
N_KEYS = 499
N_SHAPES = {
    "model.2.m.0.cv1.conv.weight": (8, 16, 3, 3),  # C3k2's half-width Bottleneck
    "model.8.m.0.m.0.cv1.conv.weight": (64, 64, 3, 3),  # C3k inside C3k2 (c3k=True)
    "model.10.m.0.attn.qkv.conv.weight": (256, 128, 1, 1),  # C2PSA -> PSABlock -> Attention
    "model.10.m.0.attn.pe.conv.weight": (128, 1, 3, 3),  # depthwise positional term
    "model.10.m.0.ffn.1.conv.weight": (128, 256, 1, 1),
    "model.23.cv3.0.0.0.conv.weight": (64, 1, 3, 3),  # the head's depthwise class branch
    "model.23.cv3.0.0.1.conv.weight": (80, 64, 1, 1),
    "model.23.cv3.2.1.1.conv.weight": (80, 80, 1, 1),
    "model.23.cv3.0.2.weight": (80, 80, 1, 1),
    "model.23.cv2.0.0.conv.weight": (64, 64, 3, 3),  # the box branch is YOLOv8's
}


@pytest.fixture(scope="module")
def n_model() -> DetectionModel:
    return DetectionModel("yolo11n.yaml")


@pytest.fixture(scope="module")
def tiny() -> DetectionModel:
    torch.manual_seed(0)
    return DetectionModel("yolo11n.yaml", nc=3)


@pytest.fixture(scope="module")
def ultralytics(tmp_path_factory):
    with offline_ultralytics(tmp_path_factory):
        from ultralytics import YOLO
        from ultralytics.utils.torch_utils import get_flops

        yield YOLO, get_flops


# -- names, shapes, counts ------------------------------------------------------------------------------------------


def test_yolo11n_has_ultralytics_keys_and_shapes(n_model: DetectionModel) -> None:
    sd = n_model.state_dict()
    assert len(sd) == N_KEYS
    assert {k: tuple(sd[k].shape) for k in N_SHAPES} == N_SHAPES
    assert sum(p.numel() for p in n_model.parameters()) == PARAMS["n"] == 2_624_080
    assert n_model.family == "yolo11" and n_model.scale == "n" and len(n_model.model) == 24


@pytest.mark.parametrize("scale", list(PARAMS))
def test_every_scale_counts_as_ultralytics_does(scale: str) -> None:
    info = model_info(DetectionModel(f"yolo11{scale}.yaml"), 640)
    assert info.params == PARAMS[scale] and info.scale == scale and info.stride == (8, 16, 32)
    assert info.gflops == pytest.approx(GFLOPS[scale], abs=0.005)


@pytest.mark.parametrize("scale", list(PARAMS))
def test_every_scale_equals_ultralytics_key_by_key(ultralytics, scale: str) -> None:
    """Same keys in the same order with the same shapes; the same cost under Ultralytics' own FLOP counter."""
    YOLO, get_flops = ultralytics
    theirs = YOLO(f"yolo11{scale}.yaml").model
    ours = DetectionModel(f"yolo11{scale}.yaml")
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [
        (k, v.shape) for k, v in theirs.state_dict().items()
    ]
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters()) == PARAMS[scale]
    # thop counts what it has hooks for: their DFL is a 1x1 conv (16 x 4 x 8400 multiply-accumulates at 640), ours a
    # weighted sum; everything else must cost exactly the same.
    dfl_gflops = 2 * 16 * 4 * 8400 / 1e9
    their_gflops = get_flops(theirs, 640)
    assert their_gflops > 0 and get_flops(ours, 640) == pytest.approx(their_gflops - dfl_gflops, abs=1e-6)
    # our own count leaves out BatchNorm (thop counts it) and adds the attention's matrix products (thop cannot
    # see them): within 2.5% of Ultralytics' figure at every scale
    assert model_info(ours, 640).gflops == pytest.approx(their_gflops, rel=0.025)


# -- the builder's YOLO11 rules -------------------------------------------------------------------------------------


def test_c3k2_uses_c3k_at_m_l_x_and_its_own_flag_below() -> None:
    d, _ = load_model_yaml("yolo11.yaml")
    for scale, flags in (("n", [False, False, True, True]), ("m", [True, True, True, True])):
        layers, _, _ = build_layers(d, scale, 80)
        kinds = [isinstance(layers[i].m[0], C3k) for i in (2, 4, 6, 8)]
        assert kinds == flags, scale
        assert [layers[i].c3k for i in (2, 4, 6, 8)] == flags
    assert type(DetectionModel("yolo11n.yaml").model[13].m[0]) is Bottleneck


def test_the_head_is_depthwise_exactly_when_the_yaml_has_c3k2(n_model: DetectionModel) -> None:
    head = n_model.head
    assert isinstance(head, Detect) and head.depthwise_cls
    first = head.cv3[0][0]
    assert isinstance(first[0], DWConv) and first[0].conv.groups == 64 and isinstance(first[1], Conv)
    v8 = DetectionModel("yolov8n.yaml").head
    assert not v8.depthwise_cls and isinstance(v8.cv3[0][0], Conv) and v8.cv3[0][0].conv.groups == 1
    d, _ = load_model_yaml("yolo11.yaml")
    for part in ("backbone", "head"):  # every C3k2 a C2f of the same width
        d[part] = [[f, n, "C2f", a[:2]] if m == "C3k2" else [f, n, m, a] for f, n, m, a in d[part]]
    mixed = DetectionModel(d, scale="n")
    assert not mixed.head.depthwise_cls and mixed.family == "yolo11"  # C2PSA alone: YOLO11's blocks, YOLOv8's head


def test_families_and_bundled_names() -> None:
    assert family(load_model_yaml("yolo11s.yaml")[0]) == "yolo11"
    assert family(load_model_yaml("yolov8s.yaml")[0]) == family({}) == "yolov8"
    assert family({**load_model_yaml("yolo11s.yaml")[0], "end2end": True}) == "yolo26"  # see test_yolo26.py
    assert bundled_scale("yolo11x.yaml") == "x" and bundled_scale("yolo12n.yaml") is None
    assert packaged_architecture("yolo11m.yaml").name == "yolo11.yaml"
    assert packaged_architecture("m.yaml").name == packaged_architecture().name == "yolov8.yaml"
    assert architecture("yolo11l.yaml") == (str(packaged_architecture("yolo11l.yaml")), "l")
    model = DetectionModel("yolo11s.yaml", nc=2)
    assert model.scale == "s" and model.yaml["scale"] == "s" and model.model[0].conv.out_channels == 32
    assert DetectionModel("yolo11.yaml").scale == "n"  # the packaged architecture names the default scale


def test_a_yolo11_yaml_on_disk_builds_from_its_own_file(tmp_path: Path) -> None:
    d, _ = load_model_yaml("yolo11.yaml")
    path = tmp_path / "custom.yaml"
    path.write_text(yaml.safe_dump({**d, "scale": "s"}, sort_keys=False))
    assert architecture(str(path)) == (str(path), "s")
    assert sum(p.numel() for p in DetectionModel(path).parameters()) == PARAMS["s"]


def _yolo11_with(**changes) -> dict:
    d, _ = load_model_yaml("yolo11.yaml")
    return {**d, **changes}


def _layer(d: dict, i: int, spec: list) -> dict:
    backbone = list(d["backbone"])
    backbone[i] = spec
    return {**d, "backbone": backbone}


@pytest.mark.parametrize(
    ("d", "message"),
    [
        (
            _yolo11_with(end2end=True),
            r"^model layer 23 \(Detect \[80\]\) cannot be built: an end-to-end head with reg_max 16",
        ),
        (_yolo11_with(activation="nn.ReLU()"), r"^model yaml sets activation: 'nn.ReLU\(\)' \(a custom activation"),
        (_layer(_yolo11_with(), 9, [-1, 1, "SPPF", [1024, 5, 3, True, 1]]), r"^model layer 9 \(SPPF .*at most 4 arg"),
        (_layer(_yolo11_with(), 2, [-1, 2, "C3k2", [256, False, 0.25, True, 1]]), r"^model layer 2 \(C3k2 .*at most 4"),
        (_layer(_yolo11_with(), 10, [-1, 2, "C2PSA", [512]]), r"^model layer 10 \(C2PSA .*keeps its width"),
        (_layer(_yolo11_with(), 3, [-1, 1, "SCDown", [256, 3, 2]]), r"^model layer 3: unknown module 'SCDown'"),
        (
            _layer(_yolo11_with(), 3, [-1, 1, "Conv", ["wide", 3, 2]]),
            r"^model layer 3 \(Conv \['wide', 3, 2\]\) cannot",
        ),
        (_layer(_yolo11_with(), 3, [-1, "two", "Conv", [256, 3, 2]]), r"^model layer 3 \(Conv .*cannot be built"),
        (_layer(_yolo11_with(), 3, [-1, 1, "Conv", []]), r"^model layer 3 \(Conv \[\]\) cannot be built"),
        (_yolo11_with(reg_max="16"), r"^model yaml: reg_max must be a whole number of DFL bins"),
        (_yolo11_with(scales=None, depth_multiple="x"), r"^model yaml: depth_multiple and width_multiple must be"),
        (_yolo11_with(head="layers"), r"^model yaml: 'backbone' and 'head' must be lists of layers$"),
    ],
    ids=[
        "end2end",
        "activation",
        "sppf-args",
        "c3k2-args",
        "c2psa-width",
        "unknown",
        "text-width",
        "text-n",
        "no-args",
        "reg-max-text",
        "multiple-text",
        "head-text",
    ],
)
def test_what_the_builder_does_not_follow_is_one_clear_error(d: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        DetectionModel(d, scale="n")
    assert "\n" not in str(err.value)


# -- it runs as YOLOv8 does -----------------------------------------------------------------------------------------


def test_train_and_eval_outputs(tiny: DetectionModel) -> None:
    x = torch.rand(2, 3, 64, 64)
    maps = tiny.train()(x)
    assert [tuple(m.shape) for m in maps] == [(2, 67, 8, 8), (2, 67, 4, 4), (2, 67, 2, 2)]
    tiny.eval()
    with torch.no_grad():
        out = tiny(x)
    assert out.shape == (2, 7, 84) and float(out[:, 4:].min()) >= 0 and float(out[:, 4:].max()) <= 1


def test_backward_reaches_every_trainable_parameter(tiny: DetectionModel) -> None:
    model = copy.deepcopy(tiny).train()
    sum(m.float().pow(2).mean() for m in model(torch.rand(2, 3, 64, 64))).backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert missing == []


def test_fuse_and_channels_last_give_the_same_outputs(tiny: DetectionModel) -> None:
    model = copy.deepcopy(tiny).eval()
    with torch.no_grad():  # BatchNorm statistics away from identity, so fusing has work to do
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    x = torch.rand(1, 3, 96, 64)
    with torch.no_grad():
        want = model(x)
        last = copy.deepcopy(model).to(memory_format=torch.channels_last)
        torch.testing.assert_close(last(x.contiguous(memory_format=torch.channels_last)), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model.fuse()(x), want, rtol=1e-4, atol=1e-4)


def test_channels_last_training_step_runs(tiny: DetectionModel) -> None:
    """The trainer moves models to channels_last: the attention must not assume a contiguous qkv map."""
    model = copy.deepcopy(tiny).train().to(memory_format=torch.channels_last)
    x = torch.rand(2, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    sum(m.float().mean() for m in model(x)).backward()
    assert model.model[10].m[0].attn.qkv.conv.weight.grad is not None


def test_reset_classes_keeps_the_depthwise_head(tiny: DetectionModel) -> None:
    model = copy.deepcopy(tiny)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.reset_classes(5, {i: str(i) for i in range(5)})
    after = model.state_dict()
    changed = {k for k in before if before[k].shape != after[k].shape or not torch.equal(before[k], after[k])}
    assert changed == {f"model.23.cv3.{i}.2.{p}" for i in range(3) for p in ("weight", "bias")}
    assert model.head.cv3[0][2].out_channels == 5 and model.head.depthwise_cls
    rebuilt = DetectionModel(model.yaml)  # the yaml records what a fresh model needs to have the same shapes
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in after.items()}


def test_attention_matches_a_plain_reading_of_it() -> None:
    """Per head: softmax over keys of q.k / sqrt(key_dim), values weighted by it, plus the depthwise term."""
    torch.manual_seed(1)
    attn = Attention(128, num_heads=2).eval()
    x = torch.randn(1, 128, 3, 5)
    qkv = attn.qkv(x).reshape(1, 2, 32 + 32 + 64, 15)
    heads = []
    for h in range(2):
        q, k, v = qkv[0, h, :32], qkv[0, h, 32:64], qkv[0, h, 64:]
        w = torch.softmax(q.T @ k / 32**0.5, dim=-1)  # (query pixel, key pixel)
        heads.append(v @ w.T)
    v_all = qkv[:, :, 64:].reshape(1, 128, 3, 5)
    want = attn.proj(torch.cat(heads).reshape(1, 128, 3, 5) + attn.pe(v_all))
    with torch.no_grad():
        torch.testing.assert_close(attn(x), want, rtol=1e-5, atol=1e-5)


def test_c2psa_and_c3k2_shapes() -> None:
    assert C2PSA(256, 256, n=2)(torch.zeros(1, 256, 2, 2)).shape == (1, 256, 2, 2)
    block = C3k2(32, 64, n=2, c3k=False, e=0.25)
    assert block.c == 16 and [type(m) for m in block.m] == [Bottleneck, Bottleneck]
    assert block.m[0].cv1.conv.out_channels == 8  # half the width of its input (Ultralytics' e=0.5 Bottleneck)
