"""``amp=true|false|bf16|fp16|fp32``: the dtype each asks for (:func:`precision.train_dtype`) and what the run then
trains and validates in (:func:`precision.choose_precision`), on a faked CUDA device where only the decision is
under test; off CUDA float32 throughout, with one line where a dtype was asked for by name."""

from __future__ import annotations

import pytest
import torch

from detrain.engine.train import precision
from detrain.engine.train.precision import Precision, choose_precision, train_dtype
from detrain.nn.model import DetectionModel

CUDA = torch.device("cuda")  # a device object only: nothing runs on it
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("amp", "bf16", "expected", "line"),
    [
        (True, True, torch.bfloat16, None),
        (True, False, torch.float16, None),
        ("bf16", True, torch.bfloat16, None),
        (
            "bf16",
            False,
            torch.float16,
            "amp=bf16: this GPU has no bfloat16; training in float16 with a gradient scaler",
        ),
        ("fp16", True, torch.float16, None),  # asked for by name: float16 even where bfloat16 is there
        ("fp16", False, torch.float16, None),
        (False, True, None, None),
    ],
)
def test_each_amp_value_asks_for_its_dtype_on_cuda(
    monkeypatch: pytest.MonkeyPatch, amp: bool | str, bf16: bool, expected: torch.dtype | None, line: str | None
) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: bf16)
    said: list[str] = []
    assert train_dtype(amp, CUDA, said.append) == expected
    assert said == ([line] if line else [])


@pytest.mark.parametrize(("amp", "lines"), [(True, 0), (False, 0), ("bf16", 1), ("fp16", 1)])
def test_off_cuda_every_value_runs_in_float32_and_a_named_dtype_says_so(amp: bool | str, lines: int) -> None:
    said: list[str] = []
    assert train_dtype(amp, CPU, said.append) is None
    assert len(said) == lines
    assert all(
        s == f"amp={amp}: mixed precision runs on CUDA only; this cpu run trains and validates in float32" for s in said
    )


@pytest.mark.parametrize(
    ("amp", "expected"),
    [
        ("fp16", Precision(torch.float16, torch.float16)),
        ("bf16", Precision(torch.bfloat16, torch.float16)),
        (True, Precision(torch.bfloat16, torch.float16)),
    ],
)
def test_the_run_trains_in_the_named_dtype_and_validates_in_float16(
    monkeypatch: pytest.MonkeyPatch, amp: bool | str, expected: Precision
) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    checked: list[torch.dtype] = []

    def difference(model: object, device: object, dtype: torch.dtype, imgsz: int) -> float:
        checked.append(dtype)
        return 0.001

    monkeypatch.setattr(precision, "autocast_difference", difference)
    said: list[str] = []
    assert choose_precision(DetectionModel(nc=2), CUDA, amp, 64, said.append) == expected
    assert set(checked) == {expected.train, torch.float16} and said == []  # each dtype checked against float32


def test_a_named_dtype_that_fails_its_check_falls_back_to_float32_with_its_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(precision, "autocast_difference", lambda model, device, dtype, imgsz: float("inf"))
    said: list[str] = []
    assert choose_precision(DetectionModel(nc=2), CUDA, "fp16", 64, said.append) == Precision()
    assert len(said) == 1 and said[0].startswith("AMP check: a float16 forward differs from float32")


def test_off_cuda_nothing_is_checked_and_a_named_dtype_gets_its_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: object) -> float:
        raise AssertionError("checked")

    monkeypatch.setattr(precision, "autocast_difference", never)
    said: list[str] = []
    assert choose_precision(DetectionModel(nc=2), CPU, "bf16", 64, said.append) == Precision()
    assert said == ["amp=bf16: mixed precision runs on CUDA only; this cpu run trains and validates in float32"]
