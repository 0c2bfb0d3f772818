"""MuSGD's recipe against Ultralytics' real trainer: the parameter groups (which parameters, lr, weight decay,
Muon or not) and every iteration's lr and momentum per group, warmup and the lr schedule included.

Ultralytics trains YOLO26n with ``optimizer=MuSGD`` on a copy of coco8 for 3 short epochs and records each
iteration's groups; detrain's side is :func:`detrain.engine.train.musgd.build_musgd` on that same model, driven
through the same run by detrain's schedule (``optim.lr_lambda``, ``optim.warmup_iterations``, a LambdaLR stepped
at each epoch's end) and :func:`apply_group_warmup`, as the trainer will drive it once wired.

Skips without Ultralytics (never a dependency; ``PYTHONPATH=$PWD:/opt/ulib``) or without ``../shared/data/coco8``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _ultralytics import offline_ultralytics

from detrain.config.cfg import make_cfg
from detrain.engine.train import optim
from detrain.engine.train.musgd import apply_group_warmup, build_musgd

COCO8 = Path(__file__).resolve().parents[3] / "shared" / "data" / "coco8"
RUN = {"epochs": 3, "warmup_epochs": 1.0, "lr0": 0.02, "lrf": 0.1, "batch": 2, "nbs": 2}  # 2 batches an epoch


@pytest.fixture
def coco8_yaml(tmp_path: Path) -> Path:
    """A private copy (Ultralytics writes label caches next to the labels)."""
    if not (COCO8 / "images" / "train").is_dir():
        pytest.skip(f"{COCO8} not found")
    shutil.copytree(COCO8, tmp_path / "coco8", ignore=shutil.ignore_patterns("*.cache"))
    names = "\n".join(f"  {i}: class{i}" for i in range(80))
    path = tmp_path / "coco8.yaml"
    path.write_text(f"path: {tmp_path / 'coco8'}\ntrain: images/train\nval: images/val\nnames:\n{names}\n")
    return path


@pytest.fixture
def global_torch_state():
    """The trainer sets threads, RNGs and deterministic flags for the whole process: put them back after."""
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    rng, env = torch.get_rng_state(), dict(os.environ)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(det)
    torch.set_rng_state(rng)
    os.environ.clear()
    os.environ.update(env)


def _groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [
        {k: g.get(k) for k in ("param_group", "lr", "momentum", "weight_decay", "nesterov", "use_muon")}
        for g in optimizer.param_groups
    ]


def test_musgd_groups_lr_and_momentum_every_iteration_match_ultralytics(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, coco8_yaml: Path, global_torch_state: None
) -> None:
    with offline_ultralytics(tmp_path_factory):
        from ultralytics import YOLO

        theirs: list[list[dict[str, Any]]] = []
        seen: dict[str, Any] = {}

        def on_batch_end(trainer: Any) -> None:  # the lr and momentum this iteration used
            theirs.append(_groups(trainer.optimizer))
            if "model" not in seen:
                names = {id(p): n for n, p in trainer.model.named_parameters()}
                seen["model"] = trainer.model
                seen["names"] = [[names[id(p)] for p in g["params"]] for g in trainer.optimizer.param_groups]
                seen["nb"] = len(trainer.train_loader)

        model = YOLO("yolo26n.yaml")
        model.add_callback("on_train_batch_end", on_batch_end)
        model.train(
            data=str(coco8_yaml),
            project=str(tmp_path),
            name="ultralytics",
            optimizer="MuSGD",
            imgsz=64,
            workers=0,
            device="cpu",
            plots=False,
            val=False,
            save=False,
            amp=False,
            close_mosaic=0,
            seed=0,
            verbose=False,
            exist_ok=True,
            **RUN,
        )

    cfg = make_cfg({"optimizer": "SGD", **RUN})  # detrain's keys know no MuSGD yet; the schedule keys are the same
    weight_decay = cfg.train.weight_decay * cfg.train.batch / cfg.train.nbs  # accumulate 1
    ours = build_musgd(seen["model"], cfg.train.lr0, cfg.train.momentum, weight_decay)
    names = {id(p): n for n, p in seen["model"].named_parameters()}
    assert [[names[id(p)] for p in g["params"]] for g in ours.param_groups] == seen["names"]
    assert sum(len(n) for n in seen["names"][6:]) > 100 and any(g["use_muon"] for g in ours.param_groups)

    lf = optim.lr_lambda(cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(ours, lr_lambda=lf)
    nb = seen["nb"]
    n_warmup = optim.warmup_iterations(cfg, nb)
    assert nb == 2 and n_warmup == 2
    mine: list[list[dict[str, Any]]] = []
    for epoch in range(cfg.train.epochs):
        for i in range(nb):
            ni = i + nb * epoch
            if ni <= n_warmup:
                apply_group_warmup(
                    ours,
                    ni,
                    n_warmup,
                    lf(epoch),
                    bias_lr_start=cfg.train.warmup_bias_lr,
                    momentum_start=cfg.train.warmup_momentum,
                    momentum=cfg.train.momentum,
                )
            mine.append(_groups(ours))
        scheduler.step()

    assert len(mine) == len(theirs) == cfg.train.epochs * nb
    for ni, (a, b) in enumerate(zip(mine, theirs)):
        for ga, gb in zip(a, b, strict=True):
            assert ga["param_group"] == gb["param_group"] and ga["nesterov"] == gb["nesterov"], ni
            assert bool(ga["use_muon"]) == bool(gb["use_muon"]), ni
            for key in ("lr", "momentum", "weight_decay"):
                assert ga[key] == pytest.approx(gb[key], abs=1e-12), (ni, key, ga, gb)
    assert sorted({g["lr"] for g in mine[-1]}) == pytest.approx([0.02 * lf(2), 3 * 0.02 * lf(2)])  # head cls: 3x
