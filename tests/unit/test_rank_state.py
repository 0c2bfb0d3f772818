"""Per-rank state travels to rank 0 as bytes laid out by the structure every rank shares (engine/train/state/
rank_state.py): the generators and buffers come back exactly, and a rank whose structure differs is refused."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from detrain.engine.train.reproduce import rng_state
from detrain.engine.train.state import rank_state
from detrain.nn.model import DetectionModel


def _same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b and type(a) is type(b)


def test_another_ranks_generators_and_buffers_come_back_exactly() -> None:
    model = DetectionModel("n.yaml", nc=3)
    model.train()
    model(torch.rand(2, 3, 64, 64))  # BatchNorm statistics of its own
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # the cached Gaussian is a float here, None on a fresh generator
    theirs = {"rng": rng_state(), "buffers": {k: v.clone() for k, v in model.state_dict().items() if "running" in k}}
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    ours = {"rng": rng_state(), "buffers": {k: torch.zeros_like(v) for k, v in theirs["buffers"].items()}}
    assert ours["rng"]["python"][2] is None and theirs["rng"]["python"][2] is not None
    packed = rank_state.pack(theirs)
    assert packed.dtype == torch.uint8 and packed.numel() == rank_state.packed_size(ours)
    _same(rank_state.unpack(packed, ours), theirs)  # read with rank 0's own structure


def test_a_rank_whose_structure_differs_is_refused() -> None:
    like = {"a": torch.zeros(3), "b": 1}
    with pytest.raises(ValueError, match="structures differ"):
        rank_state.unpack(rank_state.pack({"a": torch.zeros(4), "b": 1}), like)
    with pytest.raises(ValueError, match="structures differ"):
        rank_state.unpack(rank_state.pack({"a": torch.zeros(2), "b": 1}), like)
    with pytest.raises(TypeError):
        rank_state.pack({"a": object()})
