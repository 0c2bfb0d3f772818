"""BatchNorm synchronised over ranks for CPU (gloo) workers, where torch's ``nn.SyncBatchNorm`` refuses to run
(it and DDP accept only GPU modules).

In training mode each layer normalises with the batch statistics of the *global* batch: the per-channel sums
are all-reduced (mean first, then the centred squares: the same two-pass statistics a single process
computes), and their gradients are all-reduced in backward, so W ranks of B/W images compute what one rank
of B images would. Outside training, or in a single process, it is a plain ``nn.BatchNorm2d``.

>>> from torch import nn
>>> m = convert_sync_batchnorm_cpu(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
>>> type(m[1]).__name__
'CPUSyncBatchNorm2d'
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from detrain.distributed import dist


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; the gradient of a sum over ranks is the sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return dist.all_reduce_sum(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return dist.all_reduce_sum(grad)


class CPUSyncBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose training statistics cover every rank's images (same parameters and buffers)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_distributed()):
            return super().forward(x)
        dims = (0, 2, 3)
        c = x.shape[1]
        n_local = x.numel() // c
        stats = _AllReduceSum.apply(torch.cat([x.sum(dims), x.new_tensor([float(n_local)])]))
        n = stats[-1]
        mean = stats[:c] / n
        xc = x - mean.view(1, c, 1, 1)
        var = _AllReduceSum.apply((xc * xc).sum(dims)) / n
        y = xc * torch.rsqrt(var + self.eps).view(1, c, 1, 1)
        if self.weight is not None:
            y = y * self.weight.view(1, c, 1, 1) + self.bias.view(1, c, 1, 1)
        tracked = self.num_batches_tracked
        if (
            self.track_running_stats
            and self.running_mean is not None
            and self.running_var is not None
            and tracked is not None
        ):
            with torch.no_grad():
                tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(tracked)
                total = float(n)
                unbiased = var.detach() * (total / max(total - 1.0, 1.0))
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(unbiased, alpha=m)
        return y


def convert_sync_batchnorm_cpu(module: nn.Module) -> nn.Module:
    """Turn every plain ``nn.BatchNorm2d`` in ``module`` into ``CPUSyncBatchNorm2d`` in place (the parameter
    and buffer tensors stay the same objects, so optimizers and EMA keys are unaffected); returns ``module``."""
    for m in module.modules():
        if type(m) is nn.BatchNorm2d:
            m.__class__ = CPUSyncBatchNorm2d
    return module
