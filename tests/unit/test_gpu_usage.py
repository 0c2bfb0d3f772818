"""GpuUsage's utilisation samples, with torch.cuda's NVML query and memory counters replaced (no GPU here): the
epoch's first sample comes a second into the epoch, not at its first step, when NVML still reports the idle
validation and loader start before it."""

from __future__ import annotations

import pytest
import torch

from detrain.engine.telemetry import gpu_usage
from detrain.engine.telemetry.gpu_usage import GpuUsage

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_samples_start_a_second_into_the_epoch_and_average(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    readings = iter([80.0, 60.0, 90.0])
    monkeypatch.setattr(gpu_usage.time, "monotonic", clock)
    monkeypatch.setattr(torch.cuda, "utilization", lambda device=None: next(readings))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 << 30)
    usage = GpuUsage(torch.device("cuda", 0))
    usage.begin_epoch()
    usage.poll()  # the epoch's first step: nothing taken yet
    clock.now += 0.5
    usage.poll()
    assert usage.utils == []
    clock.now += 0.6
    usage.poll()
    clock.now += 1.0
    usage.poll()
    assert usage.sample() == (3 << 30, 70.0)
    usage.begin_epoch()  # a short epoch: one sample at its end
    assert usage.sample() == (3 << 30, 90.0)


def test_without_nvml_only_the_memory_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_nvml(device=None) -> float:
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "utilization", no_nvml)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1 << 20)
    usage = GpuUsage(torch.device("cuda", 0))
    usage.begin_epoch()
    assert usage.sample() == (1 << 20, None) and not usage.util_ok
    assert GpuUsage(torch.device("cpu")).sample() == (None, None)
