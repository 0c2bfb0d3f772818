"""Model.info() / detrain info: layer table, parameter counts, GFLOPs cross-checked by hand, CLI errors."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from detrain import Model
from detrain.errors import ConfigError
from detrain.nn.info import model_info
from detrain.nn.model import DetectionModel
from detrain.weights.checkpoint import model_meta, save_checkpoint

SHARED = Path(__file__).resolve().parents[3] / "shared"
YOLOV8N = SHARED / "weights" / "yolov8n.pt"


def detrain(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "detrain.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def conv_flops(c_in: int, c_out: int, k: int, h: int, w: int) -> int:
    """2 x multiply-accumulates of a k x k convolution producing an (h, w) map: written out, not measured."""
    return 2 * c_out * c_in * k * k * h * w


@pytest.fixture(scope="module")
def n_model() -> DetectionModel:
    return DetectionModel(scale="n")


def test_n_counts_match_ultralytics_published_figures(n_model: DetectionModel) -> None:
    info = model_info(n_model, 640)
    assert (info.layers, info.params, info.gradients) == (23, 3_157_200, 3_157_200 - 16)  # 16: the fixed DFL weight
    assert info.fused_params == 3_151_904  # YOLOv8n's published (fused) parameter count
    fused = copy.deepcopy(n_model).eval().fuse()
    assert info.fused_params == sum(p.numel() for p in fused.parameters())  # the shortcut agrees with a real fuse
    assert info.stride == (8, 16, 32) and info.imgsz == (640, 640) and info.nc == 80 and info.scale == "n"
    assert abs(info.gflops - 8.7) < 0.05  # YOLOv8n: 8.7 GFLOPs at 640
    assert info.modules == len(list(n_model.modules()))
    # a fused model costs the same convolutions and reports its own (smaller) count as params
    fused_info = model_info(fused, 640)
    assert fused_info.gflops == info.gflops and fused_info.params == fused_info.fused_params == info.fused_params


def test_flops_are_counted_by_hand_for_the_stem_and_the_head(n_model: DetectionModel) -> None:
    info = model_info(n_model, (320, 640))
    assert info.table[0].gflops * 1e9 == conv_flops(3, 16, 3, 160, 320)  # Conv(3, 16, k=3, s=2) -> 160 x 320
    # Detect at scale n: per level (c_in, map) a box branch 3x3 c->64, 3x3 64->64, 1x1 64->64 and a class
    # branch 3x3 c->80, 3x3 80->80, 1x1 80->80; decoding is elementwise (not counted)
    head = 0
    for c, s in ((64, 8), (128, 16), (256, 32)):
        h, w = 320 // s, 640 // s
        head += conv_flops(c, 64, 3, h, w) + conv_flops(64, 64, 3, h, w) + conv_flops(64, 64, 1, h, w)
        head += conv_flops(c, 80, 3, h, w) + conv_flops(80, 80, 3, h, w) + conv_flops(80, 80, 1, h, w)
    assert info.table[22].gflops * 1e9 == head
    assert info.gflops == pytest.approx(sum(row.gflops for row in info.table), rel=1e-12)
    for zero in (10, 11, 13, 14, 17, 20):  # Upsample and Concat do no multiply-adds
        assert info.table[zero].gflops == 0
    assert model_info(n_model, 640).gflops == pytest.approx(2 * info.gflops, rel=1e-12)  # twice the pixels


def test_the_layer_table_shows_built_arguments(n_model: DetectionModel) -> None:
    table = model_info(n_model, 64).table
    assert [(r.index, r.source, r.repeats, r.module, r.args) for r in (table[0], table[4], table[11], table[22])] == [
        (0, -1, 1, "Conv", [3, 16, 3, 2]),
        (4, -1, 2, "C2f", [64, 64, 2, True]),
        (11, [-1, 6], 1, "Concat", [1]),
        (22, [15, 18, 21], 1, "Detect", [80, [64, 128, 256]]),
    ]
    assert table[9].args == [256, 256, 5] and table[10].args == [2.0, "nearest"]
    assert sum(r.params for r in table) == sum(p.numel() for p in n_model.parameters())


def test_the_model_is_left_as_it_was(n_model: DetectionModel) -> None:
    model = copy.deepcopy(n_model).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model_info(model, 64)
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BN statistics untouched
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())  # no hooks left behind
    assert next(model.parameters()).device.type == "cpu"


def test_s_yaml_through_the_api() -> None:
    info = Model("s.yaml").info(imgsz=640, verbose=False)
    assert (info.params, info.fused_params) == (11_166_560, 11_156_544)  # YOLOv8s: 11,156,544 fused
    assert abs(info.gflops - 28.6) < 0.05 and info.scale == "s"


@pytest.mark.skipif(not YOLOV8N.is_file(), reason="needs ../shared/weights/yolov8n.pt")
def test_ultralytics_yolov8n_weights() -> None:
    info = Model(str(YOLOV8N)).info(imgsz=640, verbose=False)
    assert (info.params, info.fused_params) == (3_157_200, 3_151_904)
    assert abs(info.gflops - 8.7) < 0.05
    assert info.nc == 80 and info.names[0] == "person" and info.names[79] == "toothbrush"
    assert info.stride == (8, 16, 32)


@pytest.mark.parametrize("imgsz", [100, 0, 16])
def test_image_size_that_is_not_a_multiple_of_the_stride_is_refused(n_model: DetectionModel, imgsz: int) -> None:
    with pytest.raises(ConfigError, match="imgsz"):
        model_info(n_model, imgsz)


@pytest.mark.parametrize(("imgsz", "used"), [(100, 128), (16, 32)])
def test_the_api_rounds_an_image_size_up_to_the_stride_as_every_command(
    imgsz: int, used: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert Model("n.yaml").info(imgsz=imgsz, verbose=False).imgsz == (used, used)
    assert capsys.readouterr().out.strip() == (
        f"warning: imgsz={imgsz} is not a multiple of the largest stride 32; using imgsz={used}"
    )
    with pytest.raises(ConfigError, match="'imgsz': 0"):
        Model("n.yaml").info(imgsz=0, verbose=False)


def test_verbose_prints_the_table_and_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    Model("n.yaml").info(imgsz=64, verbose=True)
    out = capsys.readouterr().out
    assert "module" in out and "Detect" in out and "[80, [64, 128, 256]]" in out
    assert "n.yaml: scale n: 23 layers" in out and "3,157,200 parameters (3,151,904 fused)" in out


def test_cli_summary_table_and_hostile_class_names(tmp_path: Path) -> None:
    """Class names come from a weights file: rich markup in them is printed as it is, never interpreted."""
    names = {0: "[bold red]boom[/bold red]", 1: "[/]", 2: "plain"}
    model = DetectionModel(scale="n", nc=3, names=names)
    weights = save_checkpoint(
        {"model": {**model_meta(model, 64), "state_dict": model.state_dict()}, "ema": None}, tmp_path / "w.pt"
    )
    proc = detrain("info", f"model={weights}", "imgsz=320", "verbose=false")
    assert proc.returncode == 0, proc.stderr
    assert "0 [bold red]boom[/bold red], 1 [/], 2 plain" in proc.stdout
    assert "3 classes" in proc.stdout and "GFLOPs at 320" in proc.stdout and "arguments" not in proc.stdout


def test_cli_yolo11n_counts_as_ultralytics_does() -> None:
    """2,624,080 parameters: Ultralytics 8.4.190's yolo11n; the table shows the YOLO11 blocks' built arguments."""
    proc = detrain("info", "model=yolo11n.yaml", "imgsz=640")
    assert proc.returncode == 0, proc.stderr
    assert "yolo11n.yaml: scale n: 24 layers" in proc.stdout and "2,624,080 parameters" in proc.stdout
    assert "6.5 GFLOPs at 640" in proc.stdout
    assert "C3k2" in proc.stdout and "[32, 64, 1, False]" in proc.stdout  # layer 2: 1 half-width Bottleneck
    assert "C2PSA" in proc.stdout and "[256, 256, 1]" in proc.stdout and "[80, [64, 128, 256]]" in proc.stdout


def test_cli_yolo26n_counts_as_ultralytics_does() -> None:
    """2,572,280 parameters: Ultralytics 8.4.190's yolo26n; the table shows YOLO26's SPPF, attention C3k2 and head."""
    proc = detrain("info", "model=yolo26n.yaml", "imgsz=640")
    assert proc.returncode == 0, proc.stderr
    assert "yolo26n.yaml: scale n: 24 layers" in proc.stdout and "2,572,280 parameters" in proc.stdout
    assert "6.1 GFLOPs at 640" in proc.stdout  # Ultralytics publishes 6.1 too
    assert "[256, 256, 5, 3, True]" in proc.stdout  # SPPF: 3 pools, residual
    assert "[384, 256, 1, False, 'attn']" in proc.stdout  # layer 22: C3k2 with attention
    assert "[80, [64, 128, 256], 'end2end']" in proc.stdout


def test_the_end_to_end_head_is_counted_by_hand_with_both_branches() -> None:
    """YOLO26n's head at 320 x 640: per level (c_in, map) and per branch (one-to-many, one-to-one) a box branch
    3x3 c->16, 3x3 16->16, 1x1 16->4 and a class branch depthwise 3x3 c, 1x1 c->80, depthwise 3x3 80, 1x1 80->80,
    1x1 80->80: both branches run in training, and Ultralytics' published GFLOPs count both."""
    info = model_info(DetectionModel("yolo26n.yaml"), (320, 640))
    branch = 0
    for c, s in ((64, 8), (128, 16), (256, 32)):
        h, w = 320 // s, 640 // s
        branch += conv_flops(c, 16, 3, h, w) + conv_flops(16, 16, 3, h, w) + conv_flops(16, 4, 1, h, w)
        branch += conv_flops(1, c, 3, h, w) + conv_flops(c, 80, 1, h, w)  # depthwise: one input channel per filter
        branch += conv_flops(1, 80, 3, h, w) + conv_flops(80, 80, 1, h, w) + conv_flops(80, 80, 1, h, w)
    assert info.table[23].gflops * 1e9 == 2 * branch
    assert info.gflops == pytest.approx(sum(row.gflops for row in info.table), rel=1e-12)


def test_cli_prints_the_layer_table_by_default() -> None:
    table = detrain("info", "model=n.yaml", "imgsz=64")  # verbose=true by default: the per-layer table
    assert table.returncode == 0, table.stderr
    assert "arguments" in table.stdout and "[3, 16, 3, 2]" in table.stdout and "unnamed (0-79)" in table.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("model=/no/such.pt",), "weights file not found: /no/such.pt"),
        (("model=garbage.pt",), "garbage.pt"),
        (("model=n.yaml", "imgsz=8193"), "invalid value for 'imgsz': 8193"),
        (("model=n.yaml", "imgsz=../../etc"), "invalid value for 'imgsz'"),
        (("model=no_such.yaml",), "model 'no_such.yaml' not found"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    (tmp_path / "garbage.pt").write_bytes(b"PK\x03\x04 not a zip at all" * 10)
    proc = detrain("info", *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
