"""How long validation spends per image in each stage: preprocess (the batch to the device, as floats),
inference (the model's forward) and postprocess (NMS or the end-to-end head's top-k), in milliseconds, as
Ultralytics' ``metrics.speed`` reports them. Scoring the detections is not counted, and detrain's validator
computes no loss, so ``loss`` is 0. On CUDA the device is synchronised around each stage (one wait per stage
and batch), so a stage's time is its own and not the queue's.

>>> speed = ValSpeed(torch.device("cpu"))
>>> with speed.stage("inference", images=4):
...     _ = torch.zeros(8).sum()
>>> ms = speed.per_image_ms()
>>> sorted(ms), ms["inference"] > 0, ms["loss"]
(['inference', 'loss', 'postprocess', 'preprocess'], True, 0.0)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

STAGES = ("preprocess", "inference", "loss", "postprocess")


class ValSpeed:
    """Seconds per stage and the images they covered, over one rank's validation."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.images = 0

    @contextlib.contextmanager
    def stage(self, name: str, images: int = 0) -> Iterator[None]:
        """Time the block as stage ``name``; ``images``: how many images it handled (count them in one stage)."""
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - start
            self.images += images

    def per_image_ms(self) -> dict[str, float]:
        """Milliseconds per image for each stage (0 before any image)."""
        n = max(self.images, 1)
        return {name: 1000.0 * s / n if self.images else 0.0 for name, s in self.seconds.items()}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
