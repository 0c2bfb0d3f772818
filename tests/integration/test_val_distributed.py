"""metrics: distributed validation over 2 ranks gives exactly the single-process numbers.

``detrain val`` runs through ``run_task`` with ``device=cpu`` (in this process) and ``device=cpu,cpu`` (two
spawned gloo workers) on the same small dataset and checkpoint: every metric must be equal, the ranks must
have seen disjoint shards that together hold every image once, and ``predictions.json`` must be the same file.
Scoring that file on two ranks must give the same numbers again.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from _val_data import NAMES, make_dataset

from detrain.config.cfg import make_cfg
from detrain.metrics import SUMMARY_KEYS
from detrain.run.task import run_task
from detrain.weights.checkpoint import model_meta, save_checkpoint

N_VAL = 10


def _checkpoint(path: Path) -> Path:
    """A scale-n model whose head is nudged so that it detects (scores ~0.5, boxes ~3 strides wide)."""
    from detrain.nn.model import DetectionModel

    torch.manual_seed(0)
    model = DetectionModel(cfg="yolov8.yaml", scale="n", nc=len(NAMES), names=dict(enumerate(NAMES)))
    head = model.model[-1]
    with torch.no_grad():
        for seq in head.cv3:
            seq[2].bias.zero_()
        bins = torch.arange(head.reg_max, dtype=torch.float32)
        for seq in head.cv2:
            seq[2].weight.mul_(0.05)
            seq[2].bias.copy_((-2.0 * (bins - 1.5) ** 2).repeat(4))
    return save_checkpoint({"model": {**model_meta(model, 64), "state_dict": model.state_dict()}, "ema": None}, path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _val(base: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return run_task("val", make_cfg({**base, **kw}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("val_dist")
    yaml_file = make_dataset(root / "ds", n_val=N_VAL)
    base = {
        "model": str(_checkpoint(root / "w.pt")),
        "data": str(yaml_file),
        "imgsz": 64,
        "batch": 4,
        "workers": 0,
        "save_json": True,
        "plots": False,
        "verbose": False,
        "project": str(root / "runs"),
        "master_port": _free_port(),
    }
    one = _val(base, device="cpu", name="one")
    two = _val(base, device="cpu,cpu", name="two")
    return {"base": base, "one": one, "two": two}


def test_two_ranks_give_the_single_process_numbers(runs: dict[str, Any]) -> None:
    one, two = runs["one"], runs["two"]
    assert one["n_images"] == two["n_images"] == N_VAL
    assert one["ar100"] > 0  # some detections match: the comparison is not of zeros only
    for key in (*SUMMARY_KEYS, "precision", "recall", "fitness", "conf"):
        assert two[key] == one[key], key
    assert two["per_class"] == one["per_class"]


def test_ranks_saw_disjoint_shards_without_duplicates(runs: dict[str, Any]) -> None:
    one, two = runs["one"], runs["two"]
    assert one["images_per_rank"] == [N_VAL]
    per_rank = two["images_per_rank"]
    assert len(per_rank) == 2 and min(per_rank) > 0
    assert sum(per_rank) == two["n_images"] == N_VAL  # every image once: n_images counts unique ids
    a, b = (Path(r["save_dir"]) / "predictions.json" for r in (one, two))
    assert a.read_bytes() == b.read_bytes()
    metrics_a, metrics_b = (json.loads((Path(r["save_dir"]) / "metrics.json").read_text()) for r in (one, two))
    for m in (metrics_a, metrics_b):
        m.pop("images_per_rank")
    assert metrics_a == metrics_b


def test_scoring_the_file_on_two_ranks_gives_the_same_numbers(runs: dict[str, Any]) -> None:
    one = runs["one"]
    predictions = str(Path(one["save_dir"]) / "predictions.json")
    scored = _val(runs["base"], device="cpu,cpu", name="scored", predictions=predictions, master_port=_free_port())
    for key in (*SUMMARY_KEYS, "precision", "recall", "fitness", "conf", "n_images"):
        assert scored[key] == one[key], key
    assert sum(scored["images_per_rank"]) == N_VAL
    assert not (Path(scored["save_dir"]) / "predictions.json").exists()  # the input is not rewritten
