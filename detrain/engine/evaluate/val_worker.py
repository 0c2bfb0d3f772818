"""``detrain val``: evaluate weights (or an existing predictions file) on a dataset split, on any number of ranks.

Each process ``detrain val`` starts runs ``val_worker({"cfg": make_cfg({"model": "best.pt", "data":
"coco8.yaml"}), "plan": RunPlan()}, world)``; :func:`run_val` is the same in a process whose group is formed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from detrain.config.cfg import Cfg, replace_cfg
from detrain.config.values import image_hw
from detrain.data.labels.report_file import write_label_reports
from detrain.data.prepare import build_val_loader, load_split
from detrain.distributed import dist
from detrain.distributed.world import World
from detrain.engine.backends import ExportedModel, load_exported
from detrain.engine.build import agree_run_dir, build_model, is_exported, is_weights, set_cpu_threads
from detrain.engine.evaluate.validator import validate
from detrain.engine.run_plan import RunPlan
from detrain.errors import ConfigError
from detrain.log import console


def run_val(cfg: Cfg, world: World, save_dir: str | Path | None = None) -> dict[str, Any]:
    """Validate on this rank's shard of ``world`` (on its device); every rank returns the same metrics. ``save_dir``:
    the run folder the launching process picked (None: rank 0 picks it). ``model=`` may be weights, an architecture
    (random weights) or an exported file (:mod:`detrain.engine.backends`: at its own input size, images letterboxed
    to that size), in float16 on CUDA with ``half``."""
    device = torch.device(world.device)
    set_cpu_threads(device, world)
    # collective: rank 0 decides the run folder (other nodes may not know the one the launching node picked)
    save_dir = agree_run_dir(cfg.output, "val", save_dir, world.is_main)
    data = load_split(cfg.inputs.data, cfg.predict.split, cfg)
    if world.is_main:  # every file skipped or corrected, with its reason: labels_<split>.txt
        write_label_reports(save_dir, data)
    if cfg.predict.predictions:
        from detrain.engine.evaluate.score_file import score_predictions_file

        return score_predictions_file(cfg, data, save_dir, world)
    model: torch.nn.Module
    if is_exported(cfg.inputs.model):
        model, cfg = _exported_model(cfg, data.nc, device, world.is_main)
        # a graph of one input size: every image letterboxed to it; else the .pt's rectangular batches
        loader = build_val_loader(data, cfg, cfg.train.batch_images, world, rect=model.fixed_imgsz is None)
    else:
        model = _pt_model(cfg, data, device, world.is_main)
        # Every rank runs whole single-process batches (the same rectangular shapes, so the same numbers for any
        # number of ranks); the ranks share the batches, contiguous and disjoint.
        loader = build_val_loader(data, cfg, cfg.train.batch_images, world)
    if world.is_main:
        console.print(
            f"validating {cfg.inputs.model} on {cfg.inputs.data} ({cfg.predict.split}: {len(data.records)} images) "
            f"with {world.world_size} worker(s); results in {save_dir}"
        )
    metrics = validate(
        model,
        loader,
        data,
        cfg,
        device,
        world,
        save_dir=save_dir,
        plots=cfg.output.plots,
        verbose=cfg.output.verbose,
        amp_dtype=_half_dtype(cfg, device, isinstance(model, ExportedModel), world.is_main),
    )
    metrics["save_dir"] = str(save_dir)
    return metrics


def _half_dtype(cfg: Cfg, device: torch.device, exported: bool, is_main: bool) -> torch.dtype | None:
    """``half=True``: the forward in float16 on CUDA (autocast; NMS and scoring stay float32), as Ultralytics
    validates in half precision there; elsewhere, and for an exported graph (float32 as exported), one line says
    that it runs float32."""
    if not cfg.predict.half:
        return None
    if device.type == "cuda" and not exported:
        return torch.float16
    if is_main:
        why = f"{cfg.inputs.model} is an exported float32 graph" if exported else "half=True runs on CUDA only"
        console.print(f"note: {why}; validating in float32 on {device.type}", markup=False, highlight=False)
    return None


def _pt_model(cfg: Cfg, data: Any, device: torch.device, is_main: bool) -> torch.nn.Module:
    """The model of ``model=`` (weights, or an architecture with random weights), fused, on ``device``, in eval mode;
    a model of another class count than the dataset's is one line."""
    weights = is_weights(cfg.inputs.model)
    if not weights and is_main:
        console.print(f"note: {cfg.inputs.model} is an architecture, not weights: validating random weights")
    model, ckpt = build_model(
        cfg.inputs.model,
        nc=None if weights else data.nc,
        names=None if weights else data.names,
        verbose=is_main,
        weights_sha256=cfg.inputs.weights_sha256,
    )
    if model.nc != data.nc and not cfg.inputs.single_cls:  # single_cls scores any model's detections as one class
        args = ckpt.get("train_args") if isinstance(ckpt, dict) else None  # a checkpoint's word, only for the hint
        trained_single = isinstance(args, dict) and args.get("single_cls") is True
        hint = "; it was trained with single_cls=true: add single_cls=true" if trained_single else ""
        raise ConfigError(
            f"{cfg.inputs.model} predicts {model.nc} classes but {cfg.inputs.data} has {data.nc}; "
            f"fine-tune it on the dataset first{hint}"
        )
    model = model.to(device).eval()
    model.fuse()
    return model.to(memory_format=torch.channels_last)


def _exported_model(cfg: Cfg, nc: int, device: torch.device, is_main: bool) -> tuple[ExportedModel, Cfg]:
    """(the exported file of ``model=``, ``cfg`` with the input size it runs at): a graph that takes any size runs
    at ``imgsz`` as the ``.pt`` does; one of a fixed size at the size (h, w) it was exported at, whatever
    ``imgsz=`` says (a line says so when they differ), as Ultralytics' validator does."""
    model = load_exported(cfg.inputs.model, device, trust=cfg.inputs.trust_export)
    if model.nc != nc and not cfg.inputs.single_cls:
        raise ConfigError(f"{cfg.inputs.model} predicts {model.nc} classes but {cfg.inputs.data} has {nc}")
    if model.fixed_imgsz is None:
        return model, cfg
    h, w = model.fixed_imgsz
    if image_hw(cfg.inputs.imgsz) != (h, w):
        size = str(h) if h == w else f"{h},{w}"
        if is_main:
            console.print(
                f"note: {cfg.inputs.model} was exported at imgsz={size}: validating at {size} (imgsz="
                f"{cfg.inputs.imgsz} is not used; an exported model's input size is fixed)"
            )
        cfg = replace_cfg(cfg, {"imgsz": [h, w]})
    return model, cfg


def val_worker(args: dict[str, Any], world: World) -> dict[str, Any]:
    """Entry point of every rank for ``detrain val``: ``args`` holds the Cfg the command checked (``cfg``, not
    checked again here) and the launching process's :class:`detrain.engine.run_plan.RunPlan` (``plan``); ``world``
    is this worker's place and device, as the launcher handed it."""
    cfg: Cfg = args["cfg"]
    plan: RunPlan = args["plan"]
    plan.register_heads()  # a spawned worker: the heads the launching process registered
    dist.setup(world, timeout_s=cfg.distributed.dist_timeout)  # collective: every rank joins the group (a barrier)
    try:
        return run_val(cfg, world, plan.save_dir)
    finally:
        dist.cleanup()
