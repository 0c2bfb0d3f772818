"""The detrain command: help, usage errors (exit 2, one line), convert, checks."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
YOLOV8N = SHARED / "weights" / "yolov8n.pt"


def detrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "detrain.cli", *args], capture_output=True, text=True, timeout=300)


def test_help_lists_commands_and_keys():
    out = detrain("--help").stdout
    for command in ("train", "val", "predict", "info", "export", "convert", "checks"):
        assert command in out
    keys = detrain("train", "--help").stdout
    assert "epochs=100" in keys and "number of epochs to train" in keys


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("train", "epoch=3"), "unknown argument 'epoch'; did you mean 'epochs'?"),
        (("val", "imgsz=8193"), "invalid value for 'imgsz': 8193"),
        (("predict", "model=n.yaml", "source=/no/such/dir"), "source '/no/such/dir' does not exist"),
        (("val", "model=/no/such.pt", "data=shapes.yaml"), "weights file not found: /no/such.pt"),
        (
            ("predict", "model=s.pt", "weights_sha256=abc"),
            "invalid value for 'weights_sha256': 'abc'; expected '' or a",
        ),
        (("train", "data=/no/such.yaml", "device=cpu,cpu"), "dataset yaml '/no/such.yaml' not found"),
        # raised in the spawned workers (a yaml that exists but is no dataset): still one line, without elastic's
        # copy of the traceback above it
        (("train", f"data={ROOT / 'cfg' / 'default.yaml'}", "device=cpu,cpu"), "the key 'names:' is missing"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(args, message):
    proc = detrain(*args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"error: {proc.stderr.strip()[7:]}" and message in proc.stderr
    assert "\n" not in proc.stderr.strip()


def test_weights_sha256_is_checked_before_the_weights_are_read(tmp_path):
    weights = tmp_path / "w.pt"
    weights.write_bytes(b"not weights at all")
    proc = detrain("export", f"model={weights}", "weights_sha256=" + "0" * 64)
    assert proc.returncode == 2, proc.stderr
    sha = hashlib.sha256(b"not weights at all").hexdigest()
    expected = f"error: {weights} has sha256 {sha}, expected {'0' * 64} (weights_sha256): not loading it"
    assert proc.stderr.strip() == expected
    assert weights.read_bytes() == b"not weights at all"


def test_checks_reports_the_environment():
    out = detrain("checks").stdout
    assert "torch" in out and "gloo" in out and "nccl" in out


@pytest.mark.skipif(not YOLOV8N.is_file(), reason="needs ../shared/weights/yolov8n.pt")
def test_convert_writes_a_weights_only_checkpoint_that_predicts_the_same(tmp_path):
    out = tmp_path / "n-detrain.pt"
    proc = detrain("convert", str(YOLOV8N), str(out))
    assert proc.returncode == 0, proc.stderr
    ckpt = torch.load(out, map_location="cpu", weights_only=True)
    assert ckpt["model"]["nc"] == 80 and ckpt["model"]["names"][0] == "person"
    from detrain import Model

    x = torch.rand(1, 3, 128, 128)
    a, b = Model(str(YOLOV8N)).net.eval(), Model(str(out)).net.eval()
    assert torch.equal(a(x), b(x))
