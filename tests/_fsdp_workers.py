"""Worker of tests/integration/test_fsdp.py: the same few steps of a tiny model under DDP and under fully_shard
in one 2-rank group, with what each rank then holds (spawned workers import their entry by name)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from detrain.distributed import dist, parallel
from detrain.distributed.world import World
from detrain.engine.train import accumulation
from detrain.engine.train.ema import ModelEMA
from detrain.engine.train.nonfinite import gradient_norm
from detrain.engine.train.recipe import optim
from detrain.errors import ConfigError


class Tiny(nn.Module):
    """A layer list as a DetectionModel has (``model``), with a BatchNorm whose statistics each rank updates from
    its own images, and a first dimension (5) that 2 ranks split unevenly."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.ModuleList(
            [nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()), nn.Conv2d(8, 5, 1)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model:
            x = layer(x)
        return x


def _cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def _train(kind: str, world: World) -> dict[str, Any]:
    """Four batches, an update every second one (the first of each pair under gradient_sync(False)), clipping, the
    EMA; then a batch whose gradients wait (pending), averaged as at an epoch's end; what a checkpoint would hold,
    and the optimizer state loaded back and gathered again."""
    torch.manual_seed(dist.rank())  # each rank's own init: wrap must give every rank rank 0's
    bare = Tiny()
    ema = ModelEMA(bare)
    model = parallel.wrap(bare, world, torch.device("cpu"), sync_bn=False, kind=kind)
    ema.ema.load_state_dict(parallel.full_state_dict(model))
    params = list(bare.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, **optim.kernel_options(params))
    g = torch.Generator().manual_seed(100 + dist.rank())  # each rank's own images
    for step in range(5):
        update = step % 2 == 1
        with parallel.gradient_sync(model, update):
            model(torch.randn(2, 3, 8, 8, generator=g)).square().mean().backward()
        if update:
            gradient_norm(bare.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            ema.update(model)
    accumulation.average_over_ranks(bare)  # step 4's gradients wait for an update
    ema.gather(model)
    whole = parallel.gathered_state(model, opt, pending=True)
    if whole is None:  # DDP: every rank holds them whole
        whole = {
            "model": _cpu(bare.state_dict()),
            "optimizer": opt.state_dict(),
            "pending_grads": accumulation.saved(bare),
        }
    opt.load_state_dict(parallel.local_optimizer_state(model, opt, whole["optimizer"]))
    again = parallel.gathered_state(model, opt, pending=False)
    try:
        parallel.check_optimizer(model, "MuSGD")
        refused = None
    except ConfigError as e:
        refused = str(e)
    return {
        "musgd": refused,
        "model": whole["model"],
        "ema": _cpu(ema.ema.state_dict()),
        "buffers": {k: v.clone() for k, v in bare.named_buffers()},  # this rank's own
        "momentum": [s["momentum_buffer"].cpu() for s in whole["optimizer"]["state"].values()],
        "grads": whole["pending_grads"],
        "reloaded": None if again is None else [s["momentum_buffer"] for s in again["optimizer"]["state"].values()],
    }


def ddp_and_fsdp(args: dict[str, Any], world: World) -> list[dict[str, Any]]:
    """Every rank's :func:`_train` under DDP and under fsdp (rank 0 returns them all)."""
    dist.setup(world, timeout_s=60.0)
    mine = {kind: _train(kind, world) for kind in ("ddp", "fsdp")}
    return dist.all_gather_object(mine)
