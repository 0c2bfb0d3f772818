"""The non-finite bookkeeping (detrain.engine.train.nonfinite), the save guard against non-finite weights and
last.pt's generation (last.prev.pt) with resume's fallback to it."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from detrain.engine.train.nonfinite import FLAGS, NonFinite, finite_items, gradient_norm
from detrain.engine.train.state import resume_state
from detrain.errors import CheckpointError, DetrainError
from detrain.nn.model import DetectionModel
from detrain.system import tempfiles
from detrain.weights.checkpoint import PREVIOUS, load_checkpoint, model_meta, save_checkpoint

NAN, INF = float("nan"), float("inf")


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []

    def write(self, kind: str, **fields: object) -> None:
        self.seen.append((kind, fields))


def _batch(nf: NonFinite, loss: float, world: list[float] | None = None, norm: float | None = None) -> list[float]:
    """One batch through note -> attach -> (a simulated all-reduce mean over ``world``'s losses) -> read (of the
    host numbers, as the trainer's one read of the step gives them)."""
    nf.note_loss(torch.tensor(loss))
    if norm is not None:
        nf.note_gradients(torch.tensor(norm))
    mine = nf.attach(torch.tensor([1.0, 2.0, 3.0]))
    assert mine.shape == (3 + FLAGS,) and mine[:3].tolist() == [1.0, 2.0, 3.0]  # the items are untouched
    others = [
        torch.cat((torch.ones(3), torch.tensor([float(not torch.isfinite(torch.tensor(x))), 0.0]))) for x in world or []
    ]
    reduced = torch.stack([mine, *others]).mean(0)
    return nf.read(reduced.tolist(), 1 + len(others))


def test_a_finite_step_is_not_skipped_and_resets_the_row() -> None:
    nf = NonFinite(limit=3)
    _batch(nf, 1.0, world=[NAN])
    assert nf.skip(0, 0, 4) and nf.in_a_row == 1 and nf.epoch_skipped == 1
    _batch(nf, 1.0, world=[2.0])
    assert not nf.skip(0, 1, 4) and nf.in_a_row == 0 and nf.epoch_skipped == 1


def test_any_rank_s_nan_skips_the_update_and_counts_the_ranks() -> None:
    events = Events()
    nf = NonFinite(limit=0, events=events)
    _batch(nf, 1.0, world=[NAN, INF, 1.0])
    assert nf.skip(1, 2, 8)
    assert events.seen == [("nonfinite", {"epoch": 2, "batch": 3, "what": "loss", "ranks": 2, "in_a_row": 1})]


def test_gradients_alone_skip_too() -> None:
    nf = NonFinite(limit=0, events=Events())
    _batch(nf, 1.0, norm=INF)
    assert nf.skip(0, 0, 1) and nf.events.seen[0][1]["what"] == "gradients"  # type: ignore[union-attr]


def test_an_accumulated_update_with_one_bad_batch_is_skipped_whole() -> None:
    nf = NonFinite(limit=0)
    _batch(nf, NAN)  # the first of two batches gathered for one update
    _batch(nf, 1.0, norm=1.0)  # the update's own batch: finite
    assert nf.skip(0, 1, 4)
    _batch(nf, 1.0)
    _batch(nf, 1.0, norm=1.0)
    assert not nf.skip(0, 3, 4)  # the flags went with the update they skipped


def test_the_limit_stops_on_the_nth_in_a_row_and_zero_never_does() -> None:
    nf = NonFinite(limit=2)
    _batch(nf, NAN)
    assert nf.skip(0, 0, 4)
    _batch(nf, NAN)
    with pytest.raises(
        DetrainError,
        match=r"2 updates in a row had a non-finite loss \(nonfinite_limit=2\), the last at epoch 1, batch 2/4",
    ):
        nf.skip(0, 1, 4)
    never = NonFinite(limit=0)
    for i in range(50):
        _batch(never, NAN)
        assert never.skip(0, i, 50)


def test_a_nan_batch_stays_out_of_the_epoch_mean() -> None:
    mean = torch.tensor([1.0, 2.0])
    assert torch.equal(finite_items(torch.tensor([3.0, INF]), mean), mean)
    assert torch.equal(finite_items(torch.tensor([3.0, 4.0]), mean), torch.tensor([3.0, 4.0]))


def test_gradient_norm_is_clip_s_norm_and_sees_infinities() -> None:
    net = nn.Linear(3, 2)
    net(torch.ones(1, 3)).sum().backward()
    unclipped = gradient_norm(net.parameters(), 0.0)
    assert torch.isclose(unclipped, torch.cat([p.grad.reshape(-1) for p in net.parameters()]).norm())
    assert torch.isclose(gradient_norm(net.parameters(), 0.5), unclipped)  # returns the norm before clipping
    assert torch.cat([p.grad.reshape(-1) for p in net.parameters()]).norm() <= 0.5 + 1e-6
    net.bias.grad[0] = INF
    assert not torch.isfinite(gradient_norm(net.parameters(), 10.0))


# ------------------------------------------------------------------ checkpoints


def _state(epoch: int, poison: bool = False) -> dict:
    net = DetectionModel(nc=1, names={0: "a"})
    state = {k: v.clone() for k, v in net.state_dict().items()}
    if poison:
        state["model.0.conv.weight"][0, 0, 0, 0] = NAN
    return {
        "model": {**model_meta(net, 64), "state_dict": state},
        "ema": None,
        "epoch": epoch,
        "optimizer": {},
        "train_args": {},
    }


def test_a_checkpoint_with_nan_weights_is_never_written(tmp_path: Path) -> None:
    path = save_checkpoint(_state(0), tmp_path / "last.pt")
    with pytest.raises(
        CheckpointError, match=r"refusing to write .*last.pt: weight model.0.conv.weight of its 'model'"
    ):
        save_checkpoint(_state(1, poison=True), path)
    assert load_checkpoint(path)["epoch"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_last_pt_keeps_the_generation_before(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    save_checkpoint(_state(0), path, keep_previous=PREVIOUS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]  # nothing before the first
    save_checkpoint(_state(1), path, keep_previous=PREVIOUS)
    save_checkpoint(_state(2), path, keep_previous=PREVIOUS)
    assert load_checkpoint(path)["epoch"] == 2 and load_checkpoint(tmp_path / PREVIOUS)["epoch"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.prev.pt", "last.pt"]


def test_without_hard_links_the_generation_is_a_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_links(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    path = save_checkpoint(_state(0), tmp_path / "last.pt")
    monkeypatch.setattr(tempfiles.os, "link", no_links)
    save_checkpoint(_state(1), path, keep_previous=PREVIOUS)
    assert load_checkpoint(tmp_path / PREVIOUS)["epoch"] == 0
    assert os.stat(tmp_path / PREVIOUS).st_nlink == 1


def _damage(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:1000])


def test_resume_falls_back_to_the_generation_before(tmp_path: Path) -> None:
    weights = tmp_path / "run" / "weights"
    weights.mkdir(parents=True)
    save_checkpoint(_state(0), weights / "last.pt", keep_previous=PREVIOUS)
    save_checkpoint(_state(1), weights / "last.pt", keep_previous=PREVIOUS)
    _damage(weights / "last.pt")
    path, ckpt = resume_state._load_or_previous(weights / "last.pt", report=True)
    assert path == weights / PREVIOUS and ckpt["epoch"] == 0
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], Path(e["damaged"]).name, Path(e["instead"]).name) for e in events] == [
        ("checkpoint_fallback", "last.pt", PREVIOUS)
    ]
    _damage(weights / PREVIOUS)
    with pytest.raises(CheckpointError, match=r"last\.pt"):  # neither loads: last.pt's own reason
        resume_state._load_or_previous(weights / "last.pt", report=False)


def test_a_damaged_mid_pt_is_passed_over_beside_a_last_pt(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    save_checkpoint(_state(0), weights / "mid.pt")
    _damage(weights / "mid.pt")
    assert resume_state._load_candidate(weights / "mid.pt", False, True, {}) is None
    with pytest.raises(CheckpointError):
        resume_state._load_candidate(weights / "mid.pt", False, False, {})
