"""The trainer asks :mod:`detrain.engine.train.precision` once for its dtypes and validates in the one it gets: a
tiny CPU run (64 px, 8 images, one epoch) with the answer CUDA would give (bfloat16 stands in for float16, which
CPU autocast runs the same way), and the real answer on the CPU: float32 throughout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from detrain import Model
from detrain.data.synthetic import generate_shapes
from detrain.engine.train import trainer
from detrain.engine.train.precision import Precision

TINY = dict(epochs=1, imgsz=64, batch=8, nbs=8, device="cpu", workers=0, warmup_epochs=0, close_mosaic=0, val=True)
TINY |= dict(plots=False, verbose=False, exist_ok=True, name="run")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return (
        generate_shapes(tmp_path_factory.mktemp("amp") / "shapes", n_train=8, n_val=2, imgsz=64, seed=0) / "data.yaml"
    )


def _validations(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The ``amp_dtype`` of every validation the trainer runs."""
    seen: list[Any] = []
    original = trainer.validate

    def validate(*args: Any, **kwargs: Any) -> dict[str, Any]:
        seen.append(kwargs.get("amp_dtype"))
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer, "validate", validate)
    return seen


@pytest.mark.parametrize(
    ("answer", "expected"), [(None, [None]), (Precision(None, torch.bfloat16), [torch.bfloat16])], ids=["cpu", "cuda"]
)
def test_training_time_validation_runs_in_the_checked_dtype(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: Precision | None, expected: list[Any]
) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny convolutions run faster on one thread of a busy machine
    if answer is not None:
        monkeypatch.setattr(trainer, "choose_precision", lambda *args: answer)
    seen = _validations(monkeypatch)
    try:
        Model("n.yaml").train(data=str(data), **TINY, project=str(tmp_path))
    finally:
        torch.set_num_threads(threads)
    assert seen == expected  # the one validation (val=true, one epoch), in the dtype the check kept
