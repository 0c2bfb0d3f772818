"""AutoBatch's arithmetic, on the CPU with a fake GPU memory (tests/_fake_gpu.py): the line through the measured
peaks, the batch that fits a fraction of the available memory (and validation's global batch too), the cap below
a size that ran out of memory, the smallest fit of every rank times the planned world, the fallback off CUDA with
one line; and the real steps it measures (forward, the model's own loss, backward) on a copy of the model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _fake_gpu import FakeMemory, fake_steps

from detrain.distributed import dist
from detrain.engine.train import auto_batch
from detrain.engine.train.auto_batch import (
    GIB,
    MAX_LOCAL_BATCH,
    Line,
    LocalFit,
    agree_batch,
    fallback_batch,
    fit_line,
    fit_on,
    local_batch,
    model_steps,
    pick_batch,
)
from detrain.nn.model import DetectionModel

CPU = torch.device("cpu")


def test_the_line_through_exact_peaks_is_recovered() -> None:
    sizes = [1, 2, 4, 8, 16]
    line = fit_line(sizes, [3 * GIB + 0.25 * GIB * b for b in sizes])
    assert line is not None
    assert line.intercept == pytest.approx(3 * GIB) and line.slope == pytest.approx(0.25 * GIB)


def test_points_that_do_not_grow_and_sizes_that_ran_out_are_left_out_of_the_line() -> None:
    # 2's peak is noise below 1's; 16 ran out of memory
    line = fit_line([1, 2, 4, 8, 16], [3e8, 2.5e8, 9e8, 17e8, None])
    assert line is not None and line.slope == pytest.approx(2e8) and line.intercept == pytest.approx(1e8)
    assert fit_line([1, 2], [5e8, None]) is None  # one point is no line
    assert fit_line([1, 2, 4], [5e8, 5e8, 5e8]) is None  # no growth: nothing to extrapolate


def test_the_batch_fills_the_budget_and_validations_global_batch_fits_it_too() -> None:
    sizes = [1, 2, 4, 8, 16]
    train = [1 * GIB + 0.5 * GIB * b for b in sizes]
    val = [1 * GIB + 0.05 * GIB * b for b in sizes]
    budget = 42 * GIB
    assert local_batch(sizes, train, None, budget, world=1)[0] == 82  # (42 - 1) / 0.5
    assert local_batch(sizes, train, val, budget, world=4)[0] == 82  # validation's 4 x 82 = 328 fits 820
    assert local_batch(sizes, train, val, budget, world=16)[0] == 51  # 820 // 16: validation is the limit


def test_a_size_that_ran_out_caps_the_batch_below_it_and_the_bounds_hold() -> None:
    sizes = [1, 2, 4, 8, 16]
    train = [1 * GIB + 0.5 * GIB * b for b in sizes]
    assert local_batch(sizes, train[:3] + [None, None], None, 42 * GIB, world=1)[0] == 4
    assert local_batch(sizes, [p / 1000 for p in train], None, 42 * GIB, world=1)[0] == MAX_LOCAL_BATCH
    assert local_batch(sizes, train, None, 0.1 * GIB, world=1)[0] == 1  # not even one fits: the smallest
    assert local_batch(sizes, [None] * 5, None, 42 * GIB, world=1) is None


def test_a_fake_gpu_is_measured_at_its_sizes_and_the_fraction_of_its_available_memory_is_filled() -> None:
    memory = FakeMemory()  # 80 GiB, 70 available; 1 GiB + 0.5 GiB per image
    fit = fit_on(memory, fake_steps(), 0.6, world=1)
    assert fit == LocalFit(82, pytest.approx(42 * GIB), 70 * GIB, "fake:0 (Fake GPU)")  # type: ignore[arg-type]
    assert [b for kind, b in memory.runs if kind == "train"] == [1, 2, 4, 8, 16, 32, 64]
    small = FakeMemory(total_bytes=8 * GIB, available_bytes=7 * GIB, fixed=0.5 * GIB, per_image=0.25 * GIB)
    assert fit_on(small, fake_steps(), 0.9, world=1).images == 23  # (6.3 - 0.5) / 0.25
    assert max(b for _, b in small.runs) == 16  # a GPU under 16 GiB is probed up to 16


def test_sizes_after_the_first_that_runs_out_are_not_run() -> None:
    memory = FakeMemory(oom_above=10)
    fit = fit_on(memory, fake_steps(), 0.6, world=1)
    assert fit is not None and fit.images == 8
    assert [b for kind, b in memory.runs if kind == "train"] == [1, 2, 4, 8, 16]


def test_every_rank_takes_the_smallest_fit_times_the_planned_world(monkeypatch: pytest.MonkeyPatch) -> None:
    other = LocalFit(30, 20 * GIB, 40 * GIB, "cuda:1 (Smaller GPU)")
    monkeypatch.setattr(dist, "all_gather_object", lambda mine: [mine, other])
    said: list[str] = []
    chosen = pick_batch(-1, CPU, fake_steps, planned_world=2, n_images=10_000, say=said.append, memory=FakeMemory())
    assert chosen == 60
    assert said == [
        "AutoBatch: batch=60 (30 per worker x 2) for 60% of GPU memory: a step predicted at 20.00 of 40.00 GiB "
        "available on cuda:1 (Smaller GPU)"
    ]


def test_a_fraction_fills_that_share_and_the_dataset_caps_the_batch() -> None:
    said: list[str] = []
    assert pick_batch(0.3, CPU, fake_steps, 1, 10_000, said.append, FakeMemory()) == 40  # (21 - 1) / 0.5
    assert "for 30% of GPU memory" in said[0]
    assert pick_batch(-1, CPU, fake_steps, 4, 50, said.append, FakeMemory()) == 48  # 12 images per rank
    assert agree_batch([LocalFit(5, 0, 0, "a")], 8, 3) == 8  # at least one image per rank


def test_off_cuda_the_batch_is_16_split_over_the_world_with_one_line() -> None:
    def never() -> Any:
        raise AssertionError("nothing to measure on a CPU")

    said: list[str] = []
    assert pick_batch(-1, CPU, never, 1, 100, said.append) == 16
    assert pick_batch(0.5, CPU, never, 3, 100, said.append) == 18
    assert said == [
        "AutoBatch: batch=-1 needs a CUDA device; this cpu run uses batch=16",
        "AutoBatch: batch=0.5 needs a CUDA device; this cpu run uses batch=18",
    ]
    assert [fallback_batch(w) for w in (1, 2, 5, 16, 24)] == [16, 16, 20, 16, 24]


def test_a_rank_that_measures_nothing_sends_every_rank_to_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "all_gather_object", lambda mine: [mine, None])
    said: list[str] = []
    assert pick_batch(-1, CPU, fake_steps, 2, 1000, said.append, FakeMemory()) == 16
    assert said == [
        "AutoBatch: batch=-1 measured no usable batch (every size ran out of memory, or memory did not grow "
        "with it); using batch=16"
    ]


@pytest.mark.parametrize("yaml", ["n.yaml", "yolo26n.yaml"])
def test_the_real_steps_run_forward_loss_and_backward_on_a_copy(yaml: str) -> None:
    from detrain.engine.build import build_model

    model, _ = build_model(yaml, nc=3, verbose=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    steps = model_steps(model, (96, 64), objects=5, dtypes=(torch.bfloat16, None), device=CPU)
    seen: list[torch.Tensor] = []
    handle = steps_net_hook(steps, seen)
    steps.train(2)
    assert steps.val is not None
    steps.val(3)
    handle.remove()
    assert [t.shape[:1] + t.shape[2:] for t in seen] == [(2, 48, 48), (3, 32, 32)]  # the first conv halves the size
    assert seen[0].dtype == torch.bfloat16 and seen[1].dtype == torch.float32
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # BatchNorm statistics too
    assert all(p.grad is None for p in model.parameters())


def steps_net_hook(steps: auto_batch.ProbeSteps, seen: list[torch.Tensor]) -> Any:
    """A hook on the first convolution of the copy the steps run (found through the closure)."""
    cells = {c.cell_contents for c in (steps.train.__closure__ or ()) if isinstance(c.cell_contents, torch.nn.Module)}
    net = next(m for m in cells if isinstance(m, DetectionModel))
    first = next(m for m in net.modules() if isinstance(m, torch.nn.Conv2d))
    return first.register_forward_hook(lambda module, args, out: seen.append(out))


def test_line_arithmetic() -> None:
    assert Line(1e8, 2e8).images_within(4.1e9) == 20 and Line(1e8, 2e8).images_within(0) == 0
