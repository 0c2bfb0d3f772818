"""Which precision a CUDA run trains and validates in, checked once on the real model before the first step.

``amp=true`` on CUDA trains under autocast in bfloat16 where the GPU has it, else float16 with a gradient scaler;
``amp=bf16`` and ``amp=fp16`` ask for that dtype (bfloat16 on a GPU without it: float16, with a line);
training-time validation runs under autocast in float16 (inference needs no scaler, and float16's 11-bit mantissa
keeps box distances within about 0.05 % where bfloat16 rounds them by up to 0.4 %). Before training starts, one
forward of the model on a fixed smooth image in each of those dtypes is compared with one in float32
(:func:`autocast_difference`): a GPU, driver or kernel that gets mixed precision wrong (values that overflow, or
disagree beyond rounding) would otherwise train or score garbage without a word. Where a dtype disagrees on any
rank, every rank runs that part in float32 instead, and the run says so in one line. Off CUDA nothing changes:
no autocast, no check (CPU runs stay bit-identical); a dtype asked for by name (``amp=bf16``) says in one line
that the run is in float32 (CPU autocast would be slower than float32 on most CPUs, and changes the results).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from detrain.distributed import dist

# the largest relative difference (L2 norm of the difference over that of the float32 output, per output tensor)
# accepted between an autocast forward and the float32 one: rounding alone gives about 0.005 in bfloat16 and 0.0005
# in float16 on YOLOv8n/s and YOLO11n (CPU autocast, a real image and this smooth one); broken kernels give
# non-finite values or differences of order 1
AMP_TOLERANCE = 0.05


@dataclass(frozen=True)
class Precision:
    """The autocast dtypes of a run: ``train`` for the training steps, ``val`` for training-time validation; None
    means float32 (every device but CUDA, ``amp=false``, or a dtype the check found wrong)."""

    train: torch.dtype | None = None
    val: torch.dtype | None = None


def train_dtype(amp: bool | str, device: torch.device, say: Callable[[str], None] | None = None) -> torch.dtype | None:
    """The autocast dtype ``amp`` asks for on ``device``, before any check: None (float32) off CUDA or with
    ``amp=false``; bfloat16 for ``amp=bf16``, or for ``amp=true`` where the GPU has it; else float16. ``say``
    gets one line where a named dtype is not what the run uses.

    >>> train_dtype(True, torch.device("cpu")), train_dtype("fp16", torch.device("cpu"), print)
    amp=fp16: mixed precision runs on CUDA only; this cpu run trains and validates in float32
    (None, None)
    """
    if not amp:
        return None
    if device.type != "cuda":
        if isinstance(amp, str) and say is not None:
            say(f"amp={amp}: mixed precision runs on CUDA only; this {device.type} run trains and validates in float32")
        return None
    if amp == "fp16":
        return torch.float16
    if torch.cuda.is_bf16_supported():
        return torch.bfloat16
    if amp == "bf16" and say is not None:
        say("amp=bf16: this GPU has no bfloat16; training in float16 with a gradient scaler")
    return torch.float16


def choose_precision(
    model: nn.Module, device: torch.device, amp: bool | str, imgsz: int, say: Callable[[str], None]
) -> Precision:
    """The run's :class:`Precision`: with ``amp`` on CUDA, the dtype it asks for (:func:`train_dtype`) for
    training and float16 for validation, each kept only where :func:`autocast_difference` is within
    :data:`AMP_TOLERANCE` on every rank; ``say`` gets one line per dtype that falls back to float32."""
    train = train_dtype(amp, device, say)
    if train is None:
        return Precision()
    dtypes = sorted({train, torch.float16}, key=str)
    mine = [autocast_difference(model, device, dtype, imgsz) for dtype in dtypes]
    # collective: every rank's differences, so that all ranks train and validate in the same precision
    worst = dict(zip(dtypes, map(max, zip(*dist.all_gather_object(mine), strict=True)), strict=True))
    for dtype in dtypes:
        if worst[dtype] > AMP_TOLERANCE:
            uses = [u for d, u in ((train, "training"), (torch.float16, "validation")) if d == dtype]
            say(
                f"AMP check: a {str(dtype).removeprefix('torch.')} forward differs from float32 (relative difference "
                f"{worst[dtype]:.3g} > {AMP_TOLERANCE:g}); {' and '.join(uses)} run{'s' * (len(uses) == 1)} in float32"
            )
    ok = {dtype: worst[dtype] <= AMP_TOLERANCE for dtype in dtypes}
    return Precision(train if ok[train] else None, torch.float16 if ok[torch.float16] else None)


def autocast_difference(model: nn.Module, device: torch.device, dtype: torch.dtype, imgsz: int) -> float:
    """The largest relative difference (per output tensor: the L2 norm of the difference over that of the float32
    output) between the raw outputs of one forward of ``model`` under autocast in ``dtype`` and one in float32, on
    a fixed smooth image of ``imgsz``; ``inf`` where the autocast output is not finite. Both run in eval mode (the
    running statistics stay untouched), and the model's mode is restored.

    Example:
        >>> from detrain.nn.model import DetectionModel
        >>> autocast_difference(DetectionModel(nc=2), torch.device("cpu"), torch.bfloat16, 64) < AMP_TOLERANCE
        True
    """
    was_training = model.training
    image = _smooth_image(imgsz).to(device).contiguous(memory_format=torch.channels_last)
    try:
        model.eval()
        with torch.no_grad():
            reference = _tensors(model(image, decode=False))
            with torch.autocast(device.type, dtype=dtype):
                mixed = _tensors(model(image, decode=False))
    finally:
        model.train(was_training)
    worst = 0.0
    for low, ref in zip(mixed, reference, strict=True):
        if not torch.isfinite(low).all():
            return float("inf")
        worst = max(worst, float((low.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)))
    return worst


def _smooth_image(imgsz: int) -> torch.Tensor:
    """A (1, 3, imgsz, imgsz) image in [0, 1], the same every time: seeded noise at 1/32 of the size, upsampled, so
    that activations look like a photo's rather than white noise's."""
    coarse = torch.rand(1, 3, max(1, imgsz // 32), max(1, imgsz // 32), generator=torch.Generator().manual_seed(0))
    return F.interpolate(coarse, size=(imgsz, imgsz), mode="bilinear", align_corners=False)


def _tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor of a model's raw output (a tensor, or lists, tuples and dicts of them), in order."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if not isinstance(output, (list, tuple)):
        return []
    return [t for part in output for t in _tensors(part)]
