"""Gradients waiting across an epoch's end: averaged over ranks, saved, and added back on resume.

The trainer's cadence (updates counted over the run, as Ultralytics counts them) is compared with Ultralytics'
own in tests/integration/test_parity_recipe.py; an exact resume with gradients waiting in the checkpoint is in
tests/integration/test_train_e2e.py::test_resume_continues_exactly.
"""

from __future__ import annotations

import _dist_workers as workers
import pytest
import torch
from torch import nn

from detrain.distributed.launch.launcher import launch, parse_device
from detrain.engine.train import accumulation


def _backward(net: nn.Module, x: torch.Tensor) -> None:
    net(x).square().sum().backward()


def test_saved_gradients_added_to_a_later_batch_equal_one_accumulation() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    straight = nn.Linear(3, 2)
    resumed = nn.Linear(3, 2)
    resumed.load_state_dict(straight.state_dict())
    _backward(straight, a)
    kept = accumulation.saved(straight)  # what the checkpoint holds after batch a
    _backward(straight, b)
    _backward(resumed, b)  # the resumed run only sees batch b, then adds the checkpoint's gradients
    accumulation.add_saved(resumed, kept)
    for p, q in zip(straight.parameters(), resumed.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_saved_gradients_for_an_unknown_parameter_are_refused() -> None:
    with pytest.raises(KeyError, match="nope"):
        accumulation.add_saved(nn.Linear(3, 2), {"nope": torch.zeros(1)})


def test_pending_batches_counts_since_the_last_update() -> None:
    assert accumulation.pending_batches(last_batch=5, last_update=5) == 0
    assert accumulation.pending_batches(last_batch=5, last_update=3) == 2


def test_two_ranks_hold_the_mean_of_their_gradients() -> None:
    got = launch(workers.pending_grads, {}, parse_device("cpu,cpu"))
    assert got["weight"] == [[1.5] * 3] * 2  # (1 + 2) / 2
    assert got["bias"] == [2.0, 2.0]  # (4 + 0) / 2: a missing gradient counts as zeros
