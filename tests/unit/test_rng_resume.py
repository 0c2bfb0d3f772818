"""Resuming a GPU run's random state on a machine that sees fewer GPUs (8 -> 4, or one under srun's per-task
binding): each rank keeps and restores its own device's CUDA generator only. CUDA is faked: a machine of N
generators behind torch.cuda's RNG functions, which fail as the real ones do for a device that is not there."""

from __future__ import annotations

import io

import pytest
import torch

from detrain.engine.train.reproduce import rng_state, set_rng_state


class FakeGpus:
    """N CUDA generators (their states) and the current device, behind torch.cuda's RNG functions."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, n: int, current: int = 0) -> None:
        self.states = [torch.full((16,), 100 + i, dtype=torch.uint8) for i in range(n)]
        self.current = current
        for module in (torch.cuda, torch.cuda.random):  # torch.cuda's names, and those its *_all functions call
            monkeypatch.setattr(module, "device_count", lambda: n)
            monkeypatch.setattr(module, "get_rng_state", self.get)
            monkeypatch.setattr(module, "set_rng_state", self.set)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)

    def _index(self, device: int | str | torch.device) -> int:
        index = device if isinstance(device, int) else torch.device(device).index
        index = self.current if index is None else index
        if index >= len(self.states):  # torch.cuda.default_generators[idx]: a tuple of the visible devices
            raise IndexError("tuple index out of range")
        return index

    def get(self, device: int | str | torch.device = "cuda") -> torch.Tensor:
        return self.states[self._index(device)].clone()

    def set(self, state: torch.Tensor, device: int | str | torch.device = "cuda") -> None:
        self.states[self._index(device)] = state.clone()


def _through_a_checkpoint(state: dict) -> dict:
    """What torch.save then torch.load(weights_only=True) of a checkpoint gives back."""
    buf = io.BytesIO()
    torch.save({"rng": state}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)["rng"]


def test_a_rank_of_an_8_gpu_run_resumes_on_a_machine_with_fewer(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeGpus(monkeypatch, 8, current=3)  # rank 3 of a run on 8 GPUs
    saved = _through_a_checkpoint(rng_state())
    for visible, current in ((4, 3), (1, 0)):  # 8 -> 4 GPUs; a requeue with CUDA_VISIBLE_DEVICES=0 per task
        gpus = FakeGpus(monkeypatch, visible, current)
        set_rng_state(saved)
        assert gpus.states[current].tolist() == [103] * 16  # its own device's generator, as it was
        assert all(s.tolist() == [100 + i] * 16 for i, s in enumerate(gpus.states) if i != current)


def test_an_older_checkpoint_with_every_device_state_still_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeGpus(monkeypatch, 4)
    old = rng_state() | {"cuda": [torch.full((16,), 50 + i, dtype=torch.uint8) for i in range(4)]}
    saved = _through_a_checkpoint(old)
    gpus = FakeGpus(monkeypatch, 4, current=2)  # the same layout: the rank's own device gets its own state
    set_rng_state(saved)
    assert [s[0].item() for s in gpus.states] == [100, 101, 52, 103]
    gpus = FakeGpus(monkeypatch, 8, current=5)  # no entry for this device: its generator keeps its seed
    set_rng_state(saved)
    assert [s[0].item() for s in gpus.states] == [100 + i for i in range(8)]
