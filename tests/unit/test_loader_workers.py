"""workers=auto: each rank's loader takes its share of the cores it may run on, whatever the machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from detrain.config.cfg import make_cfg
from detrain.data.prepare import build_train_loader, build_val_loader, load_split
from detrain.data.synthetic import generate_shapes
from detrain.distributed.launch.devices import loader_workers
from detrain.distributed.world import World


def _cores(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)


def test_auto_shares_the_cores_among_the_node_s_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    _cores(monkeypatch, 40)  # a 40-core node
    assert [loader_workers("auto", ranks) for ranks in (1, 2, 8, 64)] == [16, 16, 5, 1]  # at most 16, at least 1
    assert loader_workers(3, 8) == 3 and loader_workers(0, 1) == 0  # a number is kept
    _cores(monkeypatch, 2)
    assert loader_workers("auto", 1) == 2


def test_the_loaders_take_the_share(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = generate_shapes(tmp_path / "shapes", n_train=4, n_val=2, imgsz=64, seed=0)
    cfg = make_cfg({"data": str(root / "data.yaml"), "imgsz": 64})
    assert cfg.distributed.workers == "auto"  # the default
    data = load_split(cfg.inputs.data, "train", cfg, verbose=False)
    _cores(monkeypatch, 6)
    three_ranks = World(local_world_size=3)
    assert build_train_loader(data, cfg, 2, World(local_world_size=3), 1).num_workers == 2
    assert build_val_loader(data, cfg, 2, three_ranks).num_workers == 2
    two = make_cfg({"data": str(root / "data.yaml"), "imgsz": 64, "workers": 1})
    assert build_train_loader(data, two, 2, World(), 1).num_workers == 1
