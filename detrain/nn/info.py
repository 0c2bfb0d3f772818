"""Model size and cost: parameter counts and GFLOPs at an image size."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


def model_info(model: nn.Module, imgsz: int | tuple[int, int] = 640) -> dict[str, float | int]:
    """Parameters, trainable parameters, layer count and GFLOPs of one forward at ``imgsz`` (batch 1).

    GFLOPs follow the usual 2 x multiply-accumulates convention (convolutions and matmuls). The forward
    runs at a small size and is scaled by area, which is exact for a fully convolutional model whose input
    is a multiple of its largest stride (``imgsz`` is rounded up to one, as the letterbox would).

    >>> from detrain.nn.model import DetectionModel
    >>> info = model_info(DetectionModel(scale="n"), 640)
    >>> info["params"], round(info["gflops"], 1)
    (3157200, 8.7)
    """
    params = sum(p.numel() for p in model.parameters())
    gradients = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # Identity placeholders (a fused-away BatchNorm) are not layers
    layers = sum(not isinstance(m, nn.Identity) for m in model.modules())
    h, w = (imgsz, imgsz) if isinstance(imgsz, int) else imgsz
    stride = int(max(getattr(model, "stride", torch.tensor([32.0])).max().item(), 32))
    h, w = math.ceil(h / stride) * stride, math.ceil(w / stride) * stride
    probe = 2 * stride  # smallest input that still gives every level at least a 2x2 map
    ref = next(model.parameters())
    memory_format = (
        torch.channels_last
        if ref.dim() == 4 and ref.is_contiguous(memory_format=torch.channels_last) and not ref.is_contiguous()
        else torch.contiguous_format
    )
    x = torch.zeros(1, 3, probe, probe, device=ref.device, dtype=ref.dtype).to(memory_format=memory_format)
    was_training = model.training
    model.eval()  # BN running statistics must not move
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(x)
    finally:
        model.train(was_training)
    gflops = counter.get_total_flops() * (h * w) / (probe * probe) / 1e9
    return {"params": params, "gradients": gradients, "layers": layers, "gflops": gflops}
