"""What a rank builds before its first epoch, each piece a function of the arguments (none sees the trainer): the
model as it trains (:func:`train_model`), AutoBatch's batch (:func:`pick_batch`), the batch plan
(:func:`plan_batches`), the optimizer and its learning-rate rule (:func:`build_recipe`) and the lines that say them
(:func:`recipe_lines`), and ``compile=`` (:func:`compile_model`). The trainer calls them in order
(``Trainer._setup``), each using those before it; the data, the data-parallel wrapper, AMP and the loss are its own
steps there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from detrain.config.cfg import Cfg, replace_cfg
from detrain.config.values import is_auto_batch
from detrain.distributed import parallel
from detrain.distributed.parallel import unwrap
from detrain.engine.build import build_model
from detrain.engine.train import auto_batch, freeze, pretrained
from detrain.engine.train.batch_plan import BatchPlan, batch_plan, check_split
from detrain.engine.train.ema import ModelEMA
from detrain.engine.train.precision import train_dtype
from detrain.engine.train.recipe import optim
from detrain.engine.train.reproduce import carry_to_compiler
from detrain.engine.train.state.checkpointer import Checkpointer
from detrain.nn import modules

if TYPE_CHECKING:
    from detrain.nn.model import DetectionModel


def train_model(
    cfg: Cfg, nc: int, names: dict[int, str], device: torch.device, state: Checkpointer, verbose: bool
) -> tuple[nn.Module, ModelEMA]:
    """The model on ``device`` with its starting weights (pretrained=: a fresh init, or a file's matching layers),
    or a resumed run's own (``state``); frozen layers (freeze=) before the optimizer and DDP see them; its EMA."""
    model, _ = build_model(
        cfg.inputs.model, nc=nc, names=names, verbose=verbose, weights_sha256=cfg.inputs.weights_sha256
    )
    if state.resume is None:
        model = pretrained.start_weights(model, cfg, verbose=verbose)
    frozen = freeze.freeze_layers(model, cfg.train.freeze, verbose=verbose)
    state.restore_weights(model)  # a resumed run's own weights, not the starting ones
    trained: nn.Module = model.to(device)
    if device.type in ("cpu", "cuda"):
        trained = to_channels_last(trained)
    ema = ModelEMA(trained, fixed=freeze.parameter_names(model, frozen))
    state.restore_ema(ema)  # a resumed run's EMA
    return trained, ema


def to_channels_last(model: nn.Module) -> nn.Module:
    """Channels-last weights, except 1x1 kernels kept in their plain layout (equally valid for them), which
    is the layout autograd gives their gradients: DDP's buckets then need no strided copies."""
    model = model.to(memory_format=torch.channels_last)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 4 and p.shape[2:] == (1, 1):
                p.data = p.data.reshape(p.shape[0], -1).clone().view(p.shape)  # strides (C, 1, 1, 1)
    return model


def pick_batch(
    cfg: Cfg,
    bare: DetectionModel,
    records: Sequence[Any],
    device: torch.device,
    planned_world: int,
    say: Callable[[str], None],
) -> Cfg:
    """``batch=-1`` or a fraction: the largest batch whose step fits that share of every rank's GPU memory
    (:mod:`auto_batch`), the same on every rank (a collective); from here on the run's arguments (args.yaml,
    checkpoints) hold that number, so a resume or a rerun of args.yaml trains with the same batch. Any other
    ``batch``: ``cfg`` itself."""
    if not is_auto_batch(cfg.train.batch):
        return cfg
    train = train_dtype(cfg.train.amp, device)
    dtypes = (train, None if train is None else torch.float16)  # validation's, as choose_precision's
    # as Ultralytics: a mosaic holds up to four images' boxes, multi_scale trains up to 1.5 x imgsz
    objects = max((len(r.cls) for r in records), default=1) * (4 if cfg.augment.mosaic > 0 else 1)
    largest = -(-int(cfg.inputs.imgsz * (1.5 if cfg.train.multi_scale else 1)) // 32) * 32
    chosen = auto_batch.pick_batch(
        cfg.train.batch,
        device,
        lambda: auto_batch.model_steps(bare, (largest, cfg.inputs.imgsz), objects, dtypes, device),
        planned_world,
        len(records),
        say,
    )
    check_split(chosen, planned_world)
    return replace_cfg(cfg, {"batch": chosen})


def plan_batches(cfg: Cfg, n_images: int, nc: int, world_size: int, planned_world: int) -> tuple[BatchPlan, int]:
    """The batch plan (:func:`detrain.engine.train.batch_plan.batch_plan`): ``optimizer=auto``'s choice, and
    from it how many images an update gathers (``nbs=auto``); with the updates ``optimizer=auto`` counts."""
    total_iters = optim.planned_updates(cfg, n_images)
    opt_name = optim.auto_choice(cfg, nc, total_iters)[0]
    per_update = optim.images_per_update(cfg, opt_name, pretrained.starts_from_weights(cfg))
    return batch_plan(cfg.train.batch_images, per_update, world_size, planned_world), total_iters


@dataclass(frozen=True)
class Recipe:
    """The optimizer as built (its name: ``optimizer=auto``'s choice) with its lr0 (``lr_factor`` x the key's, as
    ``lr_scale`` says for the planned update), momentum and weight decay, and the lr schedule's rule ``lf``."""

    optimizer: torch.optim.Optimizer
    name: str
    lr0: float
    lr_factor: float
    momentum: float
    weight_decay: float
    lf: Callable[[float], float]
    bn_momentum: float = optim.BN_MOMENTUM  #: BatchNorm's, per update of its running statistics
    ghost_images: int = 0  #: the images BatchNorm normalises over in training (0: a rank's whole forward pass)


def build_recipe(model: nn.Module, cfg: Cfg, nc: int, plan: BatchPlan, total_iters: int) -> Recipe:
    """The optimizer over the bare model's parameters for the planned update, and the lr schedule's rule."""
    # as planned, whatever the world now; per image as given for nbs images
    weight_decay = cfg.train.weight_decay * plan.update_images / optim.weight_decay_batch(cfg)
    name = optim.auto_choice(cfg, nc, total_iters)[0]
    parallel.check_optimizer(model, name)  # fsdp: no MuSGD
    # the planned update, not this world's: nodes joining or leaving keep the global batch and the recipe
    lr_factor = optim.lr_scale_factor(cfg, name, plan.update_images, pretrained.starts_from_weights(cfg))
    optimizer, opt_name, lr0 = optim.build_optimizer(unwrap(model), cfg, nc, total_iters, weight_decay, lr_factor)
    first = optimizer.param_groups[0]
    momentum = first["momentum"] if "momentum" in first else first["betas"][0]  # (Mu)SGD or Adam(W)
    # ghost batches: plain BatchNorm layers only (sync_bn's, converted by the wrap, normalise the global batch)
    bare = modules.use_ghost_batches(unwrap(model), optim.ghost_images(cfg, plan.local_batch))
    ghost = modules.ghost_batch_images(bare)
    bn_momentum = optim.batchnorm_momentum(cfg, statistics_images(plan, ghost))
    optim.set_batchnorm_momentum(unwrap(model), bn_momentum)
    lf = optim.lr_lambda(cfg)
    return Recipe(optimizer, opt_name, lr0, lr_factor, momentum, weight_decay, lf, bn_momentum, ghost)


def statistics_images(plan: BatchPlan, ghost: int) -> int:
    """The images over all ranks that one update of BatchNorm's running statistics sees: this world's forward
    passes, cut into ghost batches of ``ghost`` (0: whole)."""
    return plan.step_images // modules.ghost_runs(plan.local_batch, ghost)


def recipe_lines(recipe: Recipe, cfg: Cfg, plan: BatchPlan, world_size: int, nb: int, device: str) -> list[str]:
    """Rank 0's line on the optimizer and the batch plan, and one on an elastic world smaller than planned."""
    momentum = f"{recipe.momentum:g}"
    warmed = cfg.train.momentum  # where warmup takes (Mu)SGD's momentum (auto builds MuSGD at 0.9)
    lifted = "momentum" in recipe.optimizer.param_groups[0] and warmed != recipe.momentum
    if lifted and optim.warmup_iterations(cfg, nb) > 0:
        momentum += f" (warmup lifts it to {warmed:g})"
    scaled = ""
    if recipe.lr_factor != 1.0:
        rule = optim.lr_scale_rule(cfg, recipe.name)
        base = optim.lr_reference_images(cfg, recipe.name, pretrained.starts_from_weights(cfg))
        scaled = (
            f" ({rule} in the update of {plan.update_images} images over {base}: {recipe.lr_factor:.3g} x; "
            "lr_scale=none: off)"
        )
    norm = ""
    if recipe.ghost_images:
        norm = f"; BatchNorm over ghost batches of {recipe.ghost_images} images (bn_images=0: the whole pass)"
    if recipe.bn_momentum != optim.BN_MOMENTUM:
        images = statistics_images(plan, recipe.ghost_images)
        norm += f"; BatchNorm momentum {recipe.bn_momentum:.3g} for forward passes of {images} images"
    lines = [
        f"optimizer: {recipe.name} lr0={recipe.lr0:g}{scaled} momentum={momentum} "
        f"weight_decay={recipe.weight_decay:g}; accumulate to {plan.step_images * plan.accumulate} "
        f"images; {world_size} worker(s) on {device}{norm}"
    ]
    if plan.planned_world != world_size:
        lines.append(
            f"elastic: {world_size} of the {plan.planned_world} planned workers; each keeps its "
            f"batch of {plan.local_batch} and {plan.accumulate} steps of {plan.step_images} images "
            f"make an update (planned: {plan.update_images})"
        )
    return lines


def compile_model(bare: nn.Module, mode: str | bool, say: Callable[[str], None]) -> None:
    """``compile=``: the bare model's forward compiled in place (``nn.Module.compile``), so it keeps its class
    and its state_dict's names (no ``_orig_mod.`` prefix): checkpoints, resume, export and the EMA (a copy
    made before, which validation runs eagerly) see the same model. In a group DDP already wraps this very
    module, which is the order torch advises (compile the inner module, not the DDP wrapper, which dynamo
    traces poorly); dynamo sees the DDP forward it runs in and splits the graph at DDP's buckets
    (DDPOptimizer), so gradient all-reduces still overlap the backward. Call it after the AMP and AutoBatch checks,
    which would otherwise compile shapes and dtypes that training never runs."""
    if mode is False:
        return
    carry_to_compiler()
    if mode == "aot_eager":
        bare.compile(backend="aot_eager")
    else:
        bare.compile(mode=None if mode == "default" else mode)
    say(f"compile={mode}: the first training steps compile the model (torch.compile)")
