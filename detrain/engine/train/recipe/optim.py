"""Optimizer, learning-rate schedule and warmup: the recipe YOLO users know, as plain functions.

SGD, Adam and AdamW train over three parameter groups built here; MuSGD over its own eight
(:mod:`detrain.engine.train.recipe.musgd`), which warm up per group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from detrain.config.cfg import Cfg
from detrain.distributed.parallel import probe
from detrain.engine.train.recipe.musgd import MuSGD, apply_group_warmup, build_musgd
from detrain.nn.modules import BN_MOMENTUM

NOMINAL_BATCH = 64  # images per update that lr0 and weight_decay are given for (nbs=auto)
AUTO_LONG_RUN = 10_000  # optimizer=auto: above this many updates MuSGD, else AdamW
AUTO_LONG = ("MuSGD", 0.01, 0.9)  # optimizer=auto for long runs: name, lr0, momentum (Ultralytics 8.4's choice)


def planned_updates(cfg: Cfg, n_images: int) -> int:
    """Updates of the run as ``optimizer=auto`` counts them (Ultralytics' rule): one per ``nbs`` images (64 with
    ``nbs=auto``, never fewer images than a batch) for ``epochs`` epochs.

    >>> from detrain.config.cfg import make_cfg
    >>> planned_updates(make_cfg({"epochs": 30}), 400)
    210
    """
    return math.ceil(n_images / max(cfg.train.batch_images, weight_decay_batch(cfg))) * cfg.train.epochs


def auto_choice(cfg: Cfg, nc: int, updates: int) -> tuple[str, float, float]:
    """(optimizer, lr0, momentum) the run trains with: as given, or for ``optimizer=auto`` AdamW at a
    class-count-fit rate for short runs (``updates`` up to 10,000), where SGD has no time to settle, and MuSGD at
    lr0 0.01 and momentum 0.9 for long ones, whatever ``lr0`` and ``momentum`` say and whatever the model family:
    Ultralytics 8.4's choice, so an auto run trains as it would there.

    >>> from detrain.config.cfg import make_cfg
    >>> auto_choice(make_cfg(), nc=8, updates=210), auto_choice(make_cfg(), nc=8, updates=20_000)
    (('AdamW', 0.000833, 0.9), ('MuSGD', 0.01, 0.9))
    """
    if cfg.train.optimizer != "auto":
        return cfg.train.optimizer, cfg.train.lr0, cfg.train.momentum
    if updates > AUTO_LONG_RUN:
        return AUTO_LONG
    return "AdamW", round(0.002 * 5 / (4 + nc), 6), 0.9


def weight_decay_batch(cfg: Cfg) -> int:
    """The batch ``weight_decay`` is given for: ``nbs``, or 64 with ``nbs=auto``."""
    return NOMINAL_BATCH if cfg.train.nbs == "auto" else int(cfg.train.nbs)


def updates_every_batch(cfg: Cfg, optimizer: str, from_weights: bool) -> bool:
    """Whether every batch makes an update (``nbs=auto`` for a short run from scratch that ``optimizer=auto``
    trains with AdamW; see :func:`images_per_update`)."""
    return (
        cfg.train.nbs == "auto"
        and cfg.train.optimizer == "auto"
        and optimizer in ("AdamW", "Adam")
        and not from_weights
    )


def images_per_update(cfg: Cfg, optimizer: str, from_weights: bool) -> int:
    """How many images an optimizer update gathers (gradients accumulate over the batches up to it).

    A number in ``nbs`` is kept. ``nbs=auto`` is 64 (YOLO's nominal batch), except for short runs from scratch
    that ``optimizer=auto`` trains with AdamW: there every batch updates. AdamW normalises the gradient's scale,
    so gathering 64 images only divides the number of updates, and a short run is short of updates (30 epochs
    of 400 images at batch 16: about 190 updates instead of 750; measured in docs/learning.md). Fine-tuning from
    weights keeps 64: there more updates on a small set wear away what the weights knew.

    >>> from detrain.config.cfg import make_cfg
    >>> images_per_update(make_cfg(), "AdamW", from_weights=False), images_per_update(make_cfg(), "AdamW", True)
    (16, 64)
    """
    if cfg.train.nbs != "auto":
        return int(cfg.train.nbs)
    return cfg.train.batch_images if updates_every_batch(cfg, optimizer, from_weights) else NOMINAL_BATCH


#: the batch a run takes by default (Ultralytics' too): AdamW from scratch updates on every one of them
DEFAULT_BATCH = 16


def lr_reference_images(cfg: Cfg, optimizer: str, from_weights: bool) -> int:
    """The update size lr0 is used with at the default batch: 16 images where every batch updates (AdamW from
    scratch under ``optimizer=auto``), else the nominal batch (``nbs``, 64 with ``nbs=auto``). ``lr_scale`` counts
    from it.

    >>> from detrain.config.cfg import make_cfg
    >>> [lr_reference_images(make_cfg(), name, from_weights=False) for name in ("AdamW", "SGD", "MuSGD")]
    [16, 64, 64]
    >>> lr_reference_images(make_cfg(), "AdamW", True), lr_reference_images(make_cfg({"nbs": 32}), "SGD", False)
    (64, 32)
    """
    return DEFAULT_BATCH if updates_every_batch(cfg, optimizer, from_weights) else weight_decay_batch(cfg)


def lr_scale_rule(cfg: Cfg, optimizer: str) -> str:
    """How lr0 follows the update's size (``lr_scale``): ``auto`` is the square root for optimizers with Adam's
    moments (the textbook rule for them, whose step is normalised by the gradient's spread, and the rate the
    stochastic-differential view of Adam keeps an update's noise with) and linear for SGD and MuSGD. Measured for
    AdamW from scratch (YOLOv8n, 4,096 shapes images, 10 epochs, docs/learning.md "Scaling out"), counted from
    batch 16's updates: 2 x lr0 at batch 64 ended at mAP50-95 0.816 against 0.782 at 1 x; at batch 256, 4 x ended
    ahead of 2 x and 8 x. ``linear``, ``sqrt`` and ``none`` force a rule.

    >>> from detrain.config.cfg import make_cfg
    >>> none = make_cfg({"lr_scale": "none"})
    >>> lr_scale_rule(make_cfg(), "SGD"), lr_scale_rule(make_cfg(), "AdamW"), lr_scale_rule(none, "SGD")
    ('linear', 'sqrt', 'none')
    """
    if cfg.train.lr_scale != "auto":
        return cfg.train.lr_scale
    return "sqrt" if optimizer in ADAPTIVE else "linear"


def lr_scale_factor(cfg: Cfg, optimizer: str, update_images: int, from_weights: bool = False) -> float:
    """The factor on lr0 for updates of ``update_images`` images: 1 up to the update size lr0 is used with at the
    default batch (:func:`lr_reference_images`: 16 for AdamW from scratch, else ``nbs``, 64 with ``nbs=auto``),
    then linear or square root in the ratio (:func:`lr_scale_rule`). Below it nothing changes, so every run of
    today's batches trains as it did. AdamW from scratch at a global batch of 64: 2 x lr0; at 256: 4 x; at 1,024:
    8 x. SGD at 256: 4 x.

    >>> from detrain.config.cfg import make_cfg
    >>> [lr_scale_factor(make_cfg(), "AdamW", n) for n in (16, 64, 256, 1024)]
    [1.0, 2.0, 4.0, 8.0]
    >>> [lr_scale_factor(make_cfg(), "SGD", n) for n in (16, 64, 256, 1024)]
    [1.0, 1.0, 4.0, 16.0]
    >>> none = make_cfg({"lr_scale": "none"})
    >>> lr_scale_factor(make_cfg(), "AdamW", 256, from_weights=True), lr_scale_factor(none, "SGD", 1024)
    (2.0, 1.0)
    """
    ratio = max(update_images / lr_reference_images(cfg, optimizer, from_weights), 1.0)
    rule = lr_scale_rule(cfg, optimizer)
    return 1.0 if rule == "none" else ratio if rule == "linear" else math.sqrt(ratio)


#: optimizers with Adam's two moments: ``momentum`` is their beta1 (as Ultralytics builds them; torch's own classes)
ADAPTIVE = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam")

#: the images a forward pass of Ultralytics' default batch sees: BatchNorm's momentum (0.03) is set for it
BN_REFERENCE_IMAGES = 16


def batchnorm_momentum(cfg: Cfg, step_images: int) -> float:
    """BatchNorm's momentum for forward passes of ``step_images`` images over all ranks: YOLO's 0.03 up to 16
    images, then as many images remembered as 0.03 remembers at 16 (``1 - 0.97 ** (step_images / 16)``), unless
    ``lr_scale=none`` (Ultralytics' recipe: 0.03 whatever the batch).

    The running statistics are what validation and every saved model normalise with; training-mode BatchNorm
    normalises with the batch's own. At 0.03 they average the last 33 forward passes: at batch 16 that is 530
    images and a fraction of an epoch, at a global batch of 256 two epochs of 16 updates, during which the weights
    have moved on. Measured (YOLOv8n from scratch, 4,096 shapes images, batch 256, docs/learning.md "Scaling out"):
    the same training losses to the fifth digit, and mAP50-95 0.228 against 0.000 after 3 epochs.

    >>> from detrain.config.cfg import make_cfg
    >>> [round(batchnorm_momentum(make_cfg(), n), 3) for n in (8, 16, 64, 256, 1024)]
    [0.03, 0.03, 0.115, 0.386, 0.858]
    >>> batchnorm_momentum(make_cfg({"lr_scale": "none"}), 256)
    0.03
    """
    if cfg.train.lr_scale == "none" or step_images <= BN_REFERENCE_IMAGES:
        return BN_MOMENTUM
    return 1.0 - (1.0 - BN_MOMENTUM) ** (step_images / BN_REFERENCE_IMAGES)


def ghost_images(cfg: Cfg, local_batch: int) -> int:
    """The images each BatchNorm layer normalises over in a rank's training forward pass of ``local_batch``
    images: ``bn_images`` when it cuts the pass into runs, else 0 (the whole pass).

    One worker of batch 256 at ``bn_images=16`` normalises as 16 workers of 16 do (their gradient average as its
    one). Not the default: measured at a global batch of 256 (YOLOv8n from scratch, 4,096 shapes images, 10 epochs,
    docs/learning.md "Scaling out"), 16 ranks of 16 learned as much per epoch as one process of 256, neither ahead.

    >>> from detrain.config.cfg import make_cfg
    >>> [ghost_images(make_cfg({"bn_images": 16}), n) for n in (16, 17, 256)], ghost_images(make_cfg(), 256)
    ([0, 16, 16], 0)
    """
    images = int(cfg.train.bn_images)
    return images if 0 < images < local_batch else 0


def set_batchnorm_momentum(model: nn.Module, momentum: float) -> None:
    """Every BatchNorm layer's momentum (SyncBatchNorm's too) to ``momentum``."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.momentum = momentum


def build_optimizer(
    model: nn.Module, cfg: Cfg, nc: int, total_iterations: int, weight_decay: float, lr_factor: float = 1.0
) -> tuple[torch.optim.Optimizer, str, float]:
    """Three parameter groups: weights with decay, BatchNorm weights and biases without; the optimizer, lr0
    and momentum of :func:`auto_choice` for ``total_iterations`` planned updates. MuSGD builds its own eight
    groups (:func:`detrain.engine.train.recipe.musgd.build_musgd`: Muon for matrices and filters, the head's class
    branches at 3x lr0). ``lr_factor`` multiplies the chosen lr0 (:func:`lr_scale_factor`). Returns (optimizer,
    name, lr0 actually used).
    """
    name, lr, momentum = auto_choice(cfg, nc, total_iterations)
    lr = lr * lr_factor if lr_factor != 1.0 else lr
    if name == "MuSGD":
        return build_musgd(model, lr, momentum, weight_decay), name, lr
    decay, no_decay_bn, biases = [], [], []
    norm_types = tuple(v for k, v in nn.__dict__.items() if "Norm" in k and isinstance(v, type))
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if pname == "bias":
                biases.append(p)
            elif isinstance(module, norm_types):
                no_decay_bn.append(p)
            else:
                decay.append(p)
    groups = [
        {"params": biases, "weight_decay": 0.0},
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay_bn, "weight_decay": 0.0},
    ]
    # all groups go to the constructor: that is where a fused optimizer checks its parameters and declares
    # that it takes GradScaler's scale and inf flags itself
    # fused kernels exist for SGD, Adam and AdamW only; the others take torch's default (foreach where it can)
    kernel = kernel_options(biases + decay + no_decay_bn) if name in ("SGD", "Adam", "AdamW") else {}
    if name in ADAPTIVE:
        opt_cls = getattr(torch.optim, name)
        optimizer: torch.optim.Optimizer = opt_cls(groups, lr=lr, betas=(momentum, 0.999), weight_decay=0.0, **kernel)
    elif name == "RMSProp":
        optimizer = torch.optim.RMSprop(groups, lr=lr, momentum=momentum, weight_decay=0.0)
    else:
        optimizer = torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=True, weight_decay=0.0, **kernel)
    for group in optimizer.param_groups:
        group["initial_lr"] = lr
    return optimizer, name, lr


_FUSED_DEVICES = ("cpu", "cuda")


def kernel_options(params: Sequence[torch.Tensor]) -> dict[str, bool]:
    """Optimizer keyword for the fastest update kernel: ``fused=True`` when every parameter is a float tensor
    on one device type with fused SGD/Adam/AdamW kernels (CPU, CUDA), else ``{}`` (torch's default).

    The fused kernels update every tensor of a group in one pass (on CPU about twice as fast as the
    per-tensor loop that torch uses there by default) and compute the same update. Sharded parameters
    (``parallel=fsdp``) take the foreach kernel: torch 2.14 has no DTensor rule for fused SGD.

    >>> kernel_options([torch.zeros(2)]), kernel_options([])
    ({'fused': True}, {})
    """
    if probe.any_sharded(params):
        return {"foreach": True}  # parallel=fsdp/hsdp: the fused SGD kernel has no DTensor rule (torch 2.14)
    types = {p.device.type for p in params}
    if len(types) == 1 and types <= set(_FUSED_DEVICES) and all(p.is_floating_point() for p in params):
        return {"fused": True}
    return {}


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)``, keeping this run's kernel choice (``fused``/``foreach``).

    A state dict carries each group's flags; loading one saved on another device, or by an older version,
    would otherwise switch the kernel (or ask for a fused kernel the device lacks).
    """
    state = {**state, "param_groups": [dict(g) for g in state["param_groups"]]}
    for saved, group in zip(state["param_groups"], optimizer.param_groups):
        for key in ("fused", "foreach"):
            if key in group:
                saved[key] = group[key]
            else:
                saved.pop(key, None)
    optimizer.load_state_dict(state)
    _match_layouts(optimizer)


def _match_layouts(optimizer: torch.optim.Optimizer) -> None:
    """Each state tensor (momentum, moments) in the memory layout of its parameter. A checkpoint written by a
    sharded run (``parallel=fsdp``, contiguous tensors) holds plain layouts where this run's parameters are
    channels-last, and the fused kernels read a parameter and its state with the parameter's strides: a
    contiguous momentum beside a channels-last weight would be read scrambled (measured: the resumed weights
    0.002 off). A state already in its parameter's memory order is left as it is (a DDP run's own).

    >>> net = nn.Conv2d(2, 4, 3).to(memory_format=torch.channels_last)
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    >>> groups = opt.state_dict()["param_groups"]
    >>> state = {"state": {0: {"momentum_buffer": torch.ones(4, 2, 3, 3)}}, "param_groups": groups}
    >>> load_optimizer_state(opt, state); opt.state[net.weight]["momentum_buffer"].stride() == net.weight.stride()
    True
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for name, value in state.items():
                if (
                    isinstance(value, torch.Tensor)
                    and not probe.is_dtensor(value)
                    and value.shape == p.shape
                    and _order(value) != _order(p)
                ):
                    state[name] = torch.empty_like(p, dtype=value.dtype).copy_(value)


def _order(t: torch.Tensor) -> list[int]:
    """The strides of ``t``'s dimensions longer than 1 (a dimension of one element has any stride: a 1x1 kernel
    is laid out alike whether its strides say channels-last or not)."""
    return [s for s, n in zip(t.stride(), t.shape) if n > 1]


def lr_lambda(cfg: Cfg) -> Callable[[float], float]:
    """Multiplier of lr0 at an epoch: linear from 1 to lrf, or cosine with cos_lr."""
    epochs, lrf = cfg.train.epochs, cfg.train.lrf
    if cfg.train.cos_lr:
        return lambda e: ((1 - math.cos(e * math.pi / epochs)) / 2) * (lrf - 1) + 1
    return lambda e: max(1 - e / epochs, 0) * (1.0 - lrf) + lrf


def warmup_iterations(cfg: Cfg, batches_per_epoch: int) -> int:
    """``warmup_epochs`` worth of iterations, leaving at least the last epoch out of warmup; 0 when off.

    No minimum: on a small set (a few batches per epoch) a floor of 100 iterations would keep a short run
    in warmup from start to end, its lr never reaching lr0.

    >>> from detrain.config.cfg import make_cfg
    >>> [warmup_iterations(make_cfg({"epochs": e, "warmup_epochs": 3.0}), 10) for e in (100, 3, 1)]
    [30, 20, 0]
    """
    epochs = min(cfg.train.warmup_epochs, max(cfg.train.epochs - 1, 0))
    return round(epochs * batches_per_epoch) if epochs > 0 else 0


def apply_warmup(
    optimizer: torch.optim.Optimizer,
    cfg: Cfg,
    ni: int,
    n_warmup: int,
    epoch_factor: float,
    lr0: float,
    momentum: float,
    accumulate_target: float,
) -> int:
    """Set lr and momentum for iteration ``ni`` of warmup; returns the accumulation steps to use now.

    Bias lr falls from ``warmup_bias_lr`` while the other groups rise from 0, both to ``lr0 * epoch_factor``.
    With ``optimizer=auto`` the bias warmup starts at 0 too: auto picks small adaptive-rate settings for
    short runs (fine-tuning), where a bias step of 0.1 would wreck pretrained weights in the first iteration.
    SGD's momentum rises from ``warmup_momentum`` to ``momentum``; Adam's and AdamW's betas are left as built,
    as in Ultralytics' recipe (their bias correction already tempers the first steps).
    MuSGD's groups each rise to their own lr (the head's class branches to 3x), its bias groups found by name
    (:func:`detrain.engine.train.recipe.musgd.apply_group_warmup`); ``lr0`` is not read there.
    With warmup off (``n_warmup`` 0) nothing is touched and the accumulation is ``accumulate_target``.
    """
    if n_warmup <= 0:
        return max(1, round(accumulate_target))
    xi = [0, n_warmup]
    accumulate = max(1, int(np.interp(ni, xi, [1, accumulate_target]).round()))
    if isinstance(optimizer, MuSGD):
        bias_start = 0.0 if cfg.train.optimizer == "auto" else cfg.train.warmup_bias_lr
        apply_group_warmup(optimizer, ni, n_warmup, epoch_factor, bias_start, cfg.train.warmup_momentum, momentum)
        return accumulate
    for j, group in enumerate(optimizer.param_groups):
        start = cfg.train.warmup_bias_lr if (j == 0 and cfg.train.optimizer != "auto") else 0.0
        group["lr"] = float(np.interp(ni, xi, [start, lr0 * epoch_factor]))
        if "momentum" in group:
            group["momentum"] = float(np.interp(ni, xi, [cfg.train.warmup_momentum, momentum]))
    return accumulate
