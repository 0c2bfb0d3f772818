"""``detrain val``: evaluate weights (or an existing predictions file) on a dataset split, on any number of ranks.

Each process ``detrain val`` starts runs ``val_worker({"cfg": make_cfg({"model": "best.pt", "data":
"coco8.yaml"}).to_dict()})``; :func:`run_val` is the same in this process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from detrain.distributed import dist
from detrain.config import Cfg
from detrain.engine.build import build_model, cpu_threads_per_worker, increment_run_dir, is_weights, select_device
from detrain.engine.data import build_val_loader, load_split
from detrain.engine.validator import validate
from detrain.errors import ConfigError
from detrain.log import console


def run_val(cfg: Cfg, save_dir: str | Path | None = None) -> dict[str, Any]:
    """Validate on this rank's shard; every rank returns the same metrics."""
    device = select_device(cfg.distributed.device, dist.local_rank())
    if device.type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(cpu_threads_per_worker(int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size()))))
    save_dir = Path(dist.broadcast_object(
        str(save_dir or increment_run_dir(cfg.output.project, cfg.output.name, "val", cfg.output.exist_ok)) if dist.is_main() else None))
    data = load_split(cfg.inputs.data, cfg.predict.split, cfg)
    if cfg.predict.predictions:
        from detrain.engine.score_file import score_predictions_file

        return score_predictions_file(cfg, data, save_dir)
    weights = is_weights(cfg.inputs.model)
    if not weights and dist.is_main():
        console.print(f"note: {cfg.inputs.model} is an architecture, not weights: validating random weights")
    model, ckpt = build_model(cfg.inputs.model, nc=None if weights else data.nc, names=None if weights else data.names,
                              verbose=dist.is_main(), weights_sha256=cfg.inputs.weights_sha256)
    if model.nc != data.nc and not cfg.inputs.single_cls:  # single_cls scores any model's detections as one class
        args = ckpt.get("train_args") if isinstance(ckpt, dict) else None  # a checkpoint's word, only for the hint
        trained_single = isinstance(args, dict) and args.get("single_cls") is True
        hint = "; it was trained with single_cls=true: add single_cls=true" if trained_single else ""
        raise ConfigError(f"{cfg.inputs.model} predicts {model.nc} classes but {cfg.inputs.data} has {data.nc}; "
                          f"fine-tune it on the dataset first{hint}")
    model = model.to(device).eval()
    if hasattr(model, "fuse"):
        model.fuse()
    model = model.to(memory_format=torch.channels_last)
    world = dist.world_size()
    # Every rank runs whole single-process batches (the same rectangular shapes, so the same numbers for any
    # number of ranks); the ranks share the batches, contiguous and disjoint.
    loader = build_val_loader(data, cfg, cfg.train.batch, dist.rank(), world)
    if dist.is_main():
        console.print(f"validating {cfg.inputs.model} on {cfg.inputs.data} ({cfg.predict.split}: {len(data.records)} images) "
                      f"with {world} worker(s); results in {save_dir}")
    metrics = validate(model, loader, data, cfg, device, save_dir=save_dir, plots=cfg.output.plots, verbose=cfg.output.verbose)
    metrics["save_dir"] = str(save_dir)
    return metrics


def val_worker(args: dict[str, Any]) -> dict[str, Any]:
    """Entry point of every rank for ``detrain val``; ``args["cfg"]``: the Cfg the command checked."""
    cfg: Cfg = args["cfg"]
    dist.setup(timeout_s=cfg.distributed.dist_timeout)
    try:
        return run_val(cfg, args.get("save_dir"))
    finally:
        dist.cleanup()
