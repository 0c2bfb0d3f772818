"""Atomic checkpoints that load with weights_only=True, and the models they hold."""

from __future__ import annotations

import pytest
import torch

from detrain.errors import CheckpointError
from detrain.nn.model import DetectionModel
from detrain.weights import checkpoint
from detrain.weights.checkpoint import load_checkpoint, model_from_checkpoint, model_meta, save_checkpoint


def _ckpt(model: DetectionModel) -> dict:
    return {"model": {**model_meta(model, 128), "state_dict": model.state_dict()}, "ema": None, "epoch": 0}


def test_round_trip_with_weights_only(tmp_path):
    model = DetectionModel(scale="n", nc=3, names={0: "a", 1: "b", 2: "c"}).eval()
    path = save_checkpoint(_ckpt(model), tmp_path / "w" / "last.pt")
    raw = torch.load(path, map_location="cpu", weights_only=True)  # nothing but data in it
    assert raw["format"] == "detrain-checkpoint" and raw["model"]["names"][2] == "c"
    loaded = model_from_checkpoint(load_checkpoint(path)).eval()
    x = torch.rand(1, 3, 64, 64)
    assert torch.equal(loaded(x), model(x))
    assert loaded.imgsz == 128 and loaded.names == {0: "a", 1: "b", 2: "c"}


def test_a_failed_save_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    model = DetectionModel(scale="n", nc=1)
    path = save_checkpoint(_ckpt(model), tmp_path / "last.pt")
    before = path.read_bytes()

    def broken_save(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", broken_save)
    with pytest.raises(CheckpointError, match=r"cannot write .*last\.pt: disk full; the previous last\.pt is intact"):
        save_checkpoint(_ckpt(model), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_missing_and_foreign_files_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match=r"weights file not found: .*nope\.pt"):
        load_checkpoint(tmp_path / "nope.pt")
    torch.save({"some": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a detrain checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a zip at all")
    with pytest.raises(CheckpointError, match="cannot load weights file"):
        load_checkpoint(tmp_path / "junk.pt")
