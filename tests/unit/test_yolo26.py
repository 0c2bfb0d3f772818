"""YOLO26: its yaml builds under Ultralytics' names and shapes at every scale with the end-to-end head, its new block
forms (SPPF with n pools, a linear cv1 and a residual; C3k2 with attention) compute what Ultralytics' do, it runs in
training and inference, and what the builder does not follow is one clear error.

The Ultralytics comparisons run only where Ultralytics is importable (``PYTHONPATH=$PWD:/opt/ulib``); the pinned
figures are Ultralytics 8.4.190's own (the summaries in its yolo26.yaml), so the rest holds without it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from _ultralytics import offline_ultralytics
from torch import nn

from detrain.engine.build import architecture
from detrain.errors import CheckpointError, ConfigError
from detrain.nn.blocks11 import C3k, C3k2, PSABlock
from detrain.nn.head_e2e import DetectE2E
from detrain.nn.info import model_info
from detrain.nn.loss_e2e import E2EHeadMaps
from detrain.nn.model import DetectionModel, build_layers, bundled_scale, family, load_model_yaml, packaged_architecture
from detrain.nn.modules import BN_EPS, SPPF, Bottleneck, Detect

# Ultralytics 8.4.190's parameter counts for the 80-class YOLO26 (its yolo26.yaml summaries).
PARAMS = {"n": 2_572_280, "s": 10_009_784, "m": 21_896_248, "l": 26_299_704, "x": 58_993_368}
# Our GFLOPs at 640 (both head branches; Ultralytics publishes 6.1, 22.8, 75.4, 93.8, 209.5).
GFLOPS = {"n": 6.08, "s": 22.78, "m": 75.01, "l": 93.38, "x": 208.91}
# yolo26n from Ultralytics 8.4.190: state-dict entries and a few key -> shape pairs of each new part
N_KEYS = 708
N_SHAPES = {
    "model.9.cv1.conv.weight": (128, 256, 1, 1),  # SPPF: 256 -> 128, pooled 3 times
    "model.9.cv2.conv.weight": (256, 512, 1, 1),  # 4 x 128 in
    "model.13.m.0.m.0.cv1.conv.weight": (32, 32, 3, 3),  # the neck's C3k2 use C3k at every scale
    "model.22.m.0.0.cv1.conv.weight": (64, 128, 3, 3),  # C3k2 attention: a half-width Bottleneck ...
    "model.22.m.0.1.attn.qkv.conv.weight": (256, 128, 1, 1),  # ... then a PSABlock (2 heads of 64)
    "model.22.m.0.1.ffn.1.conv.weight": (128, 256, 1, 1),
    "model.23.cv2.0.2.weight": (4, 16, 1, 1),  # reg_max 1: 4 distances, no DFL
    "model.23.one2one_cv2.2.2.weight": (4, 16, 1, 1),  # the one-to-one branch
    "model.23.one2one_cv3.0.0.0.conv.weight": (64, 1, 3, 3),  # depthwise class branch, twice
    "model.23.one2one_cv3.1.2.bias": (80,),
}


@pytest.fixture(scope="module")
def n_model() -> DetectionModel:
    return DetectionModel("yolo26n.yaml")


@pytest.fixture(scope="module")
def tiny() -> DetectionModel:
    torch.manual_seed(0)
    return DetectionModel("yolo26n.yaml", nc=3)


@pytest.fixture(scope="module")
def ul(tmp_path_factory):
    with offline_ultralytics(tmp_path_factory):
        from ultralytics import YOLO
        from ultralytics.nn.modules import block
        from ultralytics.utils.torch_utils import get_flops

        yield YOLO, block, get_flops


def _trained_looking(model: nn.Module, seed: int = 0) -> nn.Module:
    """BatchNorms away from identity (with YOLO's eps) and every weight nudged: a comparison of real arithmetic,
    without the ties in score that a freshly initialised head has (equal scores leave top-k's order to the
    implementation)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eps = BN_EPS  # what a model's initialize_weights gives a lone Ultralytics block too
                m.running_mean.copy_(torch.rand(m.running_mean.shape, generator=gen) - 0.5)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen) + 0.5)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


# -- names, shapes, counts ------------------------------------------------------------------------------------------


def test_yolo26n_has_ultralytics_keys_and_shapes(n_model: DetectionModel) -> None:
    sd = n_model.state_dict()
    assert len(sd) == N_KEYS
    assert {k: tuple(sd[k].shape) for k in N_SHAPES} == N_SHAPES
    assert not any(".dfl." in k for k in sd)
    assert sum(p.numel() for p in n_model.parameters()) == PARAMS["n"]
    assert n_model.family == "yolo26" and n_model.scale == "n" and len(n_model.model) == 24
    assert isinstance(n_model.head, DetectE2E) and n_model.reg_max == n_model.head.reg_max == 1


@pytest.mark.parametrize("scale", list(PARAMS))
def test_every_scale_counts_as_ultralytics_does(scale: str) -> None:
    model = DetectionModel(f"yolo26{scale}.yaml")
    info = model_info(model, 640)
    assert info.params == PARAMS[scale] and info.scale == scale and info.stride == (8, 16, 32)
    assert info.gflops == pytest.approx(GFLOPS[scale], abs=0.005)
    assert model.family == "yolo26"


@pytest.mark.parametrize("scale", list(PARAMS))
def test_every_scale_equals_ultralytics_key_by_key(ul, scale: str) -> None:
    YOLO, _, get_flops = ul
    theirs = YOLO(f"yolo26{scale}.yaml").model
    ours = DetectionModel(f"yolo26{scale}.yaml")
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [
        (k, v.shape) for k, v in theirs.state_dict().items()
    ]
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters()) == PARAMS[scale]
    # thop also counts BatchNorm and cannot see the attention's matrix products: within 3% at every scale
    assert model_info(ours, 640).gflops == pytest.approx(get_flops(theirs, 640), rel=0.03)


def test_training_maps_of_both_branches_equal_ultralytics(ul) -> None:
    """The whole network against Ultralytics' own: every layer's output (the head's raw maps of both branches, in
    training mode), so a difference deep in the body shows where it is, not attenuated by the layers after it."""
    YOLO, _, _ = ul
    torch.manual_seed(0)
    theirs = _trained_looking(YOLO("yolo26n.yaml").model)
    ours = DetectionModel("yolo26n.yaml")
    ours.load_state_dict(theirs.state_dict())
    x = torch.rand(2, 3, 96, 64, generator=torch.Generator().manual_seed(1))
    # BatchNorm in eval (same statistics on both sides), the heads in training mode: the raw maps of both branches
    theirs.eval().model[-1].training = True
    ours.eval().head.training = True
    outputs: dict[str, list] = {"ours": [], "theirs": []}
    hooks = [
        layer.register_forward_hook(lambda _m, _i, out, side=side: outputs[side].append(out))
        for side, net in (("ours", ours), ("theirs", theirs))
        for layer in list(net.model)[:-1]
    ]
    try:
        with torch.no_grad():
            want, got = theirs(x), ours(x)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(outputs["ours"]) == len(outputs["theirs"]) == 23
    for i, (a, b) in enumerate(zip(outputs["ours"], outputs["theirs"])):
        scale = float(b.abs().max()) or 1.0
        assert float((a - b).abs().max()) <= 1e-5 * scale + 1e-6, f"layer {i}"
    assert isinstance(got, E2EHeadMaps)
    for branch in ("one2many", "one2one"):
        maps = getattr(got, branch)
        boxes = torch.cat([m[:, :4].flatten(2) for m in maps], 2)
        scores = torch.cat([m[:, 4:].flatten(2) for m in maps], 2)
        torch.testing.assert_close(boxes, want[branch]["boxes"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(scores, want[branch]["scores"], rtol=1e-4, atol=1e-4)


# -- the new block forms against Ultralytics' modules ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("c1", "c2", "n", "shortcut"), [(32, 32, 3, True), (32, 32, 2, True), (32, 48, 3, True), (32, 32, 3, False)]
)
def test_sppf_yolo26_form_equals_ultralytics(ul, c1: int, c2: int, n: int, shortcut: bool) -> None:
    _, block, _ = ul
    torch.manual_seed(0)
    theirs = _trained_looking(block.SPPF(c1, c2, 5, n, shortcut)).eval()
    ours = SPPF(c1, c2, 5, n, shortcut, cv1_act=False).eval()
    ours.load_state_dict(theirs.state_dict())
    assert isinstance(ours.cv1.act, nn.Identity) and ours.add == (shortcut and c1 == c2)
    x = torch.randn(2, c1, 9, 7)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_sppf_legacy_form_equals_ultralytics_legacy_row(ul) -> None:
    """A two-argument yaml row (YOLOv8, YOLO11) keeps cv1's SiLU: Ultralytics puts it back for such rows."""
    _, block, _ = ul
    theirs = _trained_looking(block.SPPF(32, 32, 5)).eval()
    theirs.cv1.act = nn.SiLU()
    ours = SPPF(32, 32, 5).eval()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(1, 32, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("c", "n", "c3k"), [(128, 1, False), (256, 2, True), (64, 1, False)])
def test_c3k2_attention_form_equals_ultralytics(ul, c: int, n: int, c3k: bool) -> None:
    _, block, _ = ul
    torch.manual_seed(0)
    theirs = _trained_looking(block.C3k2(c, c, n, c3k, 0.5, True)).eval()
    ours = C3k2(c, c, n, c3k, 0.5, attn=True).eval()
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [
        (k, v.shape) for k, v in theirs.state_dict().items()
    ]
    ours.load_state_dict(theirs.state_dict())
    heads = max(c // 2 // 64, 1)
    assert all(isinstance(m[1], PSABlock) and m[1].attn.num_heads == heads for m in ours.m)
    x = torch.randn(2, c, 6, 5)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-4)


# -- the builder's YOLO26 rules -------------------------------------------------------------------------------------


def test_sppf_rows_with_more_than_channels_and_kernel_build_the_yolo26_form() -> None:
    d, _ = load_model_yaml("yolo11.yaml")
    for args, act, pools, add in (
        ([1024, 5], nn.SiLU, 3, False),
        ([1024, 5, 3], nn.Identity, 3, False),
        ([1024, 5, 2, True], nn.Identity, 2, True),
    ):
        d["backbone"][9] = [-1, 1, "SPPF", args]
        sppf = build_layers(d, "n", 80)[0][9]
        assert (type(sppf.cv1.act), sppf.n, sppf.add) == (act, pools, add), args
    yolo26 = DetectionModel("yolo26n.yaml").model[9]
    assert isinstance(yolo26.cv1.act, nn.Identity) and yolo26.n == 3 and yolo26.add


def test_c3k2_attention_wins_over_c3k_at_every_scale() -> None:
    d, _ = load_model_yaml("yolo26.yaml")
    for scale in ("n", "m", "x"):
        layers = build_layers(d, scale, 80)[0]
        inner = layers[22].m[0]
        assert layers[22].attn and not layers[22].c3k, scale
        assert [type(b) for b in inner] == [Bottleneck, PSABlock], scale
        assert isinstance(layers[13].m[0], C3k) and not layers[13].attn  # the other neck blocks: C3k
    assert type(build_layers(d, "n", 80)[0][2].m[0]) is Bottleneck  # c3k False below m, as in YOLO11


def test_the_head_is_end_to_end_exactly_when_the_yaml_says_so() -> None:
    d, _ = load_model_yaml("yolo26.yaml")
    assert isinstance(DetectionModel(d, scale="n").head, DetectE2E)
    plain = DetectionModel({**d, "end2end": False}, scale="n")  # YOLO26's body with a one-to-many head only
    assert type(plain.head) is Detect and plain.head.reg_max == 1 and plain.family == "yolo11"
    assert not any("one2one" in k for k in plain.state_dict())


def test_families_and_bundled_names() -> None:
    assert family(load_model_yaml("yolo26s.yaml")[0]) == "yolo26" != family(load_model_yaml("yolo11s.yaml")[0])
    assert bundled_scale("yolo26x.yaml") == "x" and bundled_scale("yolo27n.yaml") is None
    assert packaged_architecture("yolo26m.yaml").name == "yolo26.yaml"
    assert architecture("yolo26l.yaml") == (str(packaged_architecture("yolo26l.yaml")), "l")
    model = DetectionModel("yolo26s.yaml", nc=2)
    assert model.scale == "s" and model.yaml["scale"] == "s" and model.model[0].conv.out_channels == 32
    assert DetectionModel("yolo26.yaml").scale == "n"  # the packaged architecture names the default scale


def _yolo26_with(**changes) -> dict:
    d, _ = load_model_yaml("yolo26.yaml")
    return {**d, **changes}


def _row(d: dict, part: str, i: int, spec: list) -> dict:
    rows = list(d[part])
    rows[i] = spec
    return {**d, part: rows}


def _v8_end2end() -> dict:
    d, _ = load_model_yaml("yolov8.yaml")
    return {**d, "end2end": True, "reg_max": 1}


@pytest.mark.parametrize(
    ("d", "message"),
    [
        (
            _yolo26_with(reg_max=16),
            r"^model layer 23 \(Detect \[3\]\) cannot be built: an end-to-end head with reg_max ",
        ),
        (_v8_end2end(), r"^model layer 22 \(Detect \[3\]\) cannot be built: an end-to-end head with YOLOv8's class"),
        (_yolo26_with(end2end="yes"), r"^model yaml: end2end must be True or False, got 'yes'$"),
        (_yolo26_with(activation="nn.ReLU()"), r"^model yaml sets activation: 'nn.ReLU\(\)' \(a custom activation"),
        (_row(_yolo26_with(), "backbone", 9, [-1, 1, "SPPF", [1024, 5, 3, True, 1]]), r"^model layer 9 .*at most 4"),
        (_row(_yolo26_with(), "backbone", 9, [-1, 1, "SPPF", [1024, 5, 0, True]]), r"^model layer 9 .*0 pooling"),
        (_row(_yolo26_with(), "head", 11, [-1, 1, "C3k2", [1024, True, 0.5, True, 2]]), r"^model layer 22 .*at most 4"),
    ],
    ids=["reg-max-16", "v8-head", "end2end-text", "activation", "sppf-args", "sppf-no-pools", "c3k2-args"],
)
def test_what_the_builder_does_not_follow_is_one_clear_error(d: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        DetectionModel(d, scale="n", nc=3)
    assert "\n" not in str(err.value)


# -- it runs --------------------------------------------------------------------------------------------------------


def test_train_and_eval_outputs(tiny: DetectionModel) -> None:
    x = torch.rand(2, 3, 64, 64)
    out = tiny.train()(x)
    assert isinstance(out, E2EHeadMaps)
    assert [tuple(m.shape) for m in out.one2one] == [(2, 7, 8, 8), (2, 7, 4, 4), (2, 7, 2, 2)]
    assert [m.shape for m in out.one2many] == [m.shape for m in out.one2one]
    tiny.eval()
    with torch.no_grad():
        dets = tiny(x)
    assert dets.shape == (2, 84, 6)  # min(max_det, anchors): 8x8 + 4x4 + 2x2 anchors, fewer than 300
    assert bool((dets[..., 4].diff(dim=1) <= 0).all()) and set(dets[..., 5].unique().tolist()) <= {0.0, 1.0, 2.0}


def test_backward_reaches_every_trainable_parameter(tiny: DetectionModel) -> None:
    model = copy.deepcopy(tiny).train()
    out = model(torch.rand(2, 3, 64, 64))
    sum(m.float().pow(2).mean() for m in [*out.one2many, *out.one2one]).backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert missing == []


def test_fuse_and_channels_last_give_the_same_outputs(tiny: DetectionModel) -> None:
    model = _trained_looking(copy.deepcopy(tiny)).eval()
    model.head.end2end = False  # the dense decoded output: every anchor compared, no top-k order in the way
    x = torch.rand(1, 3, 96, 64)
    with torch.no_grad():
        want = model(x)
        last = copy.deepcopy(model).to(memory_format=torch.channels_last)
        torch.testing.assert_close(last(x.contiguous(memory_format=torch.channels_last)), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model.fuse()(x), want, rtol=1e-4, atol=1e-4)


def test_reset_classes_swaps_both_branches_final_class_convs_only(tiny: DetectionModel) -> None:
    model = copy.deepcopy(tiny)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.reset_classes(5, {i: str(i) for i in range(5)})
    after = model.state_dict()
    changed = {k for k in before if before[k].shape != after[k].shape or not torch.equal(before[k], after[k])}
    finals = {
        f"model.23.{branch}.{i}.2.{p}"
        for branch in ("cv3", "one2one_cv3")
        for i in range(3)
        for p in ("weight", "bias")
    }
    assert changed == finals
    assert model.head.one2one_cv3[0][2].out_channels == model.head.cv3[2][2].out_channels == 5 and model.head.no == 9
    rebuilt = DetectionModel(model.yaml)  # the yaml records what a fresh model needs to have the same shapes
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in after.items()}


# -- weights across families ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "target", "hint"),
    [("yolo26n.yaml", "yolo11n.yaml", "yolo11n.pt"), ("yolo11n.yaml", "yolo26n.yaml", "yolo26n.pt")],
)
def test_pretrained_weights_of_another_family_are_an_error(tmp_path: Path, source: str, target: str, hint: str) -> None:
    """YOLO26 and YOLO11 share their backbone's names and shapes; a silent copy would still start from another
    network."""
    from detrain.engine.train.pretrained import load_pretrained
    from detrain.weights.checkpoint import model_meta, save_checkpoint

    other = DetectionModel(source, nc=3)
    state = {"model": {**model_meta(other, 64), "state_dict": other.state_dict()}, "ema": None}
    path = save_checkpoint(state, tmp_path / "w.pt")
    model = DetectionModel(target, nc=3)
    with pytest.raises(CheckpointError) as err:
        load_pretrained(model, str(path))
    theirs, ours = family(other.yaml), family(model.yaml)
    assert str(err.value).startswith(
        f"pretrained weights {path} hold a {theirs} model, but the model to train is {ours}"
    )
    assert f"such as {hint}" in str(err.value) and "\n" not in str(err.value)
