"""The training arguments of the tests that compare runs step for step (1 and 2 workers, DDP and fsdp, MuSGD's
world-size invariance): augmentation off, no warmup, one update of all 16 images of a batch, BatchNorm synchronised
over the workers, so that every run takes the same steps from the same weights and data. Each test adds its own
(epochs, optimizer, run folder)."""

from __future__ import annotations

EXACT: dict[str, object] = dict(
    imgsz=64,
    batch=16,
    nbs=16,
    workers=0,
    warmup_epochs=0,
    close_mosaic=0,
    optimizer="SGD",
    seed=0,
    deterministic=True,
    mosaic=0.0,
    fliplr=0.0,
    hsv_h=0.0,
    hsv_s=0.0,
    hsv_v=0.0,
    translate=0.0,
    scale=0.0,
    val=False,
    plots=False,
    verbose=False,
    sync_bn=True,
)
