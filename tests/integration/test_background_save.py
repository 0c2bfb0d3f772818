"""Saves off the training loop's path (detrain/engine/train/state/writer.py), in a real run: checkpoints are written
by rank 0's writer thread while the loop goes on, yet when train() returns the last epoch's last.pt and best.pt are
whole on disk (and the end event's sha256 are theirs); a write that fails at the last save ends the run with the
one line a synchronous save gave, the previous last.pt intact.

Every run is tiny (64 px, 8 images, scale n, workers=0, one process), and each write is slowed down by a second so
that a run that forgot its writer would return before the files are there.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from _processes import one_thread  # noqa: F401 (a fixture)

from detrain import Model
from detrain.data.synthetic import generate_shapes
from detrain.engine.train.state import checkpointer
from detrain.errors import CheckpointError

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(
    epochs=2,
    imgsz=64,
    batch=8,
    nbs=8,
    device="cpu",
    workers=0,
    warmup_epochs=0,
    close_mosaic=0,
    plots=False,
    verbose=False,
    exist_ok=True,
    name="run",
)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = generate_shapes(tmp_path_factory.mktemp("bg") / "shapes", n_train=8, n_val=2, imgsz=64, seed=0)
    return root / "data.yaml"


@pytest.fixture
def slow_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every checkpoint write takes a second longer; (thread name, file name) of each, in order."""
    real = checkpointer.save_checkpoint
    writes: list[tuple[str, str]] = []

    def slow(state, path, keep_previous=None):
        time.sleep(1.0)
        writes.append((threading.current_thread().name, Path(path).name))
        return real(state, path, keep_previous=keep_previous)

    monkeypatch.setattr(checkpointer, "save_checkpoint", slow)
    return writes


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_train_returns_with_the_last_epochs_checkpoints_whole(data: Path, tmp_path: Path, slow_writes) -> None:
    Model("n.yaml").train(data=str(data), project=str(tmp_path / "runs"), **TINY)
    weights = tmp_path / "runs" / "run" / "weights"
    assert _load(weights / "last.pt")["epoch"] == TINY["epochs"] - 1  # the last epoch's, written before the return
    assert _load(weights / "best.pt")["model"]["state_dict"]  # whole: it loads
    assert _load(weights / "last.prev.pt")["epoch"] == TINY["epochs"] - 2
    assert sorted(p.name for p in weights.iterdir()) == ["best.pt", "last.prev.pt", "last.pt"]  # no temporary file
    # written by the writer's thread, not the loop's
    assert {name for name, _ in slow_writes} == {"detrain-checkpoint-writer"}, slow_writes
    assert [f for _, f in slow_writes if f == "last.pt"] == ["last.pt"] * TINY["epochs"]
    end = json.loads((weights.parent / "events.jsonl").read_text().splitlines()[-1])
    assert end["kind"] == "end" and end["status"] == "completed"
    for name in ("last.pt", "best.pt"):  # the end event records the files as they are once the writer finished
        assert end["weights"][name] == hashlib.sha256((weights / name).read_bytes()).hexdigest(), name


def test_a_full_disk_at_the_last_save_ends_the_run_with_its_line_and_the_previous_last_pt(
    data: Path, tmp_path: Path, slow_writes, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_save = torch.save

    def full_at_epoch_2(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("epoch") == 1 and "optimizer" in obj:  # epoch 2's last.pt
            f.write(b"PK\x03\x04 half a checkpoint")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_at_epoch_2)
    with pytest.raises(CheckpointError) as e:
        Model("n.yaml").train(data=str(data), project=str(tmp_path / "runs"), **TINY)
    weights = tmp_path / "runs" / "run" / "weights"
    assert (
        str(e.value) == f"cannot write {weights / 'last.pt'}: No space left on device; the previous last.pt is intact"
    )
    assert _load(weights / "last.pt")["epoch"] == 0  # the previous generation, whole
    assert not [p.name for p in weights.iterdir() if p.name.endswith(".tmp")]
    end = json.loads((weights.parent / "events.jsonl").read_text().splitlines()[-1])
    assert end["status"] == "failed" and "No space left on device" in end["error"], end
