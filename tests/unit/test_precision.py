"""Throughput defaults on CUDA, checked on the CPU: cuDNN's kernel timing when the run is not deterministic, the AMP
check's fall-back to float32 (its comparison run for real under CPU autocast, the CUDA device faked where only
the decision is under test), and validation's forward under autocast with the scoring in float32."""

from __future__ import annotations

import os

import pytest
import torch

from detrain.engine.evaluate.validator import predict_batch
from detrain.engine.train import precision
from detrain.engine.train.precision import AMP_TOLERANCE, Precision, autocast_difference, choose_precision
from detrain.engine.train.reproduce import seed_everything
from detrain.nn.model import DetectionModel
from detrain.system.process_env import CUBLAS_WORKSPACE

CUDA = torch.device("cuda")  # a device object only: nothing runs on it where it is used below


@pytest.fixture
def torch_flags(monkeypatch: pytest.MonkeyPatch):
    """Put back the process-wide switches seed_everything sets."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE))
    saved = (
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    yield
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[:2]
    torch.use_deterministic_algorithms(saved[2], warn_only=saved[3])


def test_cudnn_times_its_kernels_only_when_the_run_is_not_deterministic(torch_flags: None) -> None:
    seed_everything(0, deterministic=False)
    assert torch.backends.cudnn.benchmark
    seed_everything(0, deterministic=True)
    assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic


def test_the_check_compares_a_real_forward_and_sees_float16_overflow() -> None:
    model = DetectionModel(nc=2)
    assert autocast_difference(model, torch.device("cpu"), torch.bfloat16, 64) < AMP_TOLERANCE  # rounding only
    with torch.no_grad():
        model.model[1].bn.weight.mul_(1e6)  # activations far beyond float16's 65504
    assert autocast_difference(model, torch.device("cpu"), torch.float16, 64) == float("inf")
    assert autocast_difference(model, torch.device("cpu"), torch.bfloat16, 64) < AMP_TOLERANCE  # bf16's range holds
    assert model.training  # the check ran in eval mode and gave the mode back


@pytest.mark.parametrize(
    ("bf16", "differences", "expected", "lines"),
    [
        (True, {torch.bfloat16: 0.004, torch.float16: 0.0005}, Precision(torch.bfloat16, torch.float16), []),
        (True, {torch.bfloat16: 0.3, torch.float16: 0.0005}, Precision(None, torch.float16), ["training runs"]),
        (True, {torch.bfloat16: 0.004, torch.float16: float("inf")}, Precision(torch.bfloat16, None), ["validation"]),
        (False, {torch.float16: 0.2}, Precision(), ["training and validation run in float32"]),
    ],
)
def test_amp_falls_back_to_float32_with_one_line_where_the_check_disagrees(
    monkeypatch: pytest.MonkeyPatch, bf16: bool, differences: dict, expected: Precision, lines: list[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: bf16)
    monkeypatch.setattr(precision, "autocast_difference", lambda model, device, dtype, imgsz: differences[dtype])
    said: list[str] = []
    assert choose_precision(DetectionModel(nc=2), CUDA, True, 64, said.append) == expected
    assert len(said) == len(lines) and all(words in line for words, line in zip(lines, said))
    assert all(line.startswith("AMP check: a ") and "\n" not in line for line in said)


def test_no_autocast_and_no_check_off_cuda_or_with_amp_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: object) -> float:
        raise AssertionError("checked")

    monkeypatch.setattr(precision, "autocast_difference", never)
    assert choose_precision(DetectionModel(nc=2), torch.device("cpu"), True, 64, print) == Precision()
    assert choose_precision(DetectionModel(nc=2), CUDA, False, 64, print) == Precision()


def test_validation_runs_the_forward_under_autocast_and_the_postprocess_in_float32() -> None:
    model = DetectionModel(nc=2).eval()
    seen: list[torch.dtype] = []
    model.model[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    imgs = torch.randint(0, 255, (2, 3, 64, 64), dtype=torch.uint8)
    with torch.no_grad():
        plain = predict_batch(model, imgs, torch.device("cpu"), 0.0, 0.7, 10)
        mixed = predict_batch(model, imgs, torch.device("cpu"), 0.0, 0.7, 10, amp_dtype=torch.bfloat16)
    assert seen == [torch.float32, torch.bfloat16]
    assert all(d.dtype == torch.float32 for d in plain + mixed)
