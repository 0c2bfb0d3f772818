"""One CUDA device's memory peak and utilisation over an epoch (nothing on other devices).

The peak is ``torch.cuda.max_memory_allocated`` since the epoch began (the tensors this process allocated, what
runs out first); utilisation is ``torch.cuda.utilization`` (NVML's share of time a kernel ran), polled at most
once a second during the epoch and averaged. It needs NVML's Python bindings (``pynvml``, or amdsmi on ROCm);
without them the utilisation is left out (None) and only the memory is reported.
"""

from __future__ import annotations

import time

import torch

POLL_S = 1.0  # utilisation samples: at most one a second (an NVML query costs tens of microseconds)


class GpuUsage:
    """Memory peak and mean utilisation of ``device`` per epoch; inert (all None) unless it is a CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device if device.type == "cuda" else None
        self.util_ok = self.device is not None
        self.utils: list[float] = []
        self.last_poll = time.monotonic()

    def begin_epoch(self) -> None:
        self.utils = []
        # the first sample a second in: NVML reports the last sampling period, which at the epoch's first step is
        # the validation and loader start before it (0 % on an H200 in 1 s epochs, 2026-11-27)
        self.last_poll = time.monotonic()
        if self.device is not None:
            torch.cuda.reset_peak_memory_stats(self.device)

    def poll(self) -> None:
        """Take a utilisation sample if a second has passed since the last one (call it every step)."""
        now = time.monotonic()
        if self.util_ok and now - self.last_poll >= POLL_S:
            self.last_poll = now
            self._take()

    def _take(self) -> None:
        try:
            self.utils.append(float(torch.cuda.utilization(self.device)))
        except Exception:  # noqa: BLE001 - no pynvml/amdsmi, or NVML not usable here: memory only, and stop asking
            self.util_ok = False

    def sample(self) -> tuple[int | None, float | None]:
        """(peak bytes allocated this epoch, mean utilisation %) - (None, None) off CUDA."""
        if self.device is None:
            return None, None
        if not self.utils and self.util_ok:
            self._take()
        peak = int(torch.cuda.max_memory_allocated(self.device))
        return peak, (sum(self.utils) / len(self.utils) if self.utils else None)
