"""MuSGD's recipe against Ultralytics' real trainer: the parameter groups (which parameters, lr, weight decay,
Muon or not) and every iteration's lr and momentum per group, warmup and the lr schedule included.

Both real trainers run the same short schedule on a copy of coco8 (YOLO11n, 64 px, 3 epochs of 2 or 4 batches)
and record each iteration's groups: Ultralytics from its ``on_train_batch_end`` callback, detrain from a
test-side wrapper of ``Trainer._step`` (called after warmup set the iteration's lr and momentum). Cases:
``optimizer=MuSGD`` (linear, and cosine with accumulation), and ``optimizer=auto`` over a long run, where both
pick MuSGD at lr 0.01 and momentum 0.9 and warmup lifts the momentum to the ``momentum`` key's 0.937 (the planned
updates forced to 20,000 on both sides: coco8 has 4 images). YOLO26n's groups (its ``one2one_cv3`` branches at 3x
lr) are checked on Ultralytics' own model through ``optim.build_optimizer``.

Skips without Ultralytics (never a dependency; ``PYTHONPATH=$PWD:/opt/ulib``) or without ``../shared/data/coco8``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _ultralytics import offline_ultralytics

from detrain.config.cfg import make_cfg
from detrain.distributed.world import World
from detrain.engine.run_plan import RunPlan
from detrain.engine.train import trainer as trainer_module
from detrain.engine.train.recipe import optim
from detrain.engine.train.trainer import Trainer

COCO8 = Path(__file__).resolve().parents[3] / "shared" / "data" / "coco8"
LONG = 20_000  # planned updates forced on both sides for the auto case
CASES = {  # 4 training images: batch 2 gives 2 batches an epoch, batch 1 gives 4
    "musgd": dict(optimizer="MuSGD", epochs=3, warmup_epochs=1.0, lr0=0.02, lrf=0.1, batch=2, nbs=2),
    "musgd-cosine-accumulate": dict(
        optimizer="musgd", epochs=3, warmup_epochs=1.0, lr0=0.02, batch=1, nbs=2, cos_lr=True, warmup_bias_lr=0.05
    ),
    "auto-long": dict(optimizer="auto", epochs=3, warmup_epochs=1.0, lr0=0.02, lrf=0.1, batch=2, nbs=2),
}
COMMON = dict(
    imgsz=64,
    workers=0,
    device="cpu",
    plots=False,
    val=False,
    save=False,
    amp=False,
    close_mosaic=0,
    deterministic=False,
    seed=0,
    verbose=False,
    exist_ok=True,
)
KEYS = ("param_group", "lr", "momentum", "weight_decay", "nesterov", "use_muon")


@pytest.fixture
def coco8_yaml(tmp_path: Path) -> Path:
    """A private copy (both trainers write label caches next to the labels)."""
    if not (COCO8 / "images" / "train").is_dir():
        pytest.skip(f"{COCO8} not found")
    shutil.copytree(COCO8, tmp_path / "coco8", ignore=shutil.ignore_patterns("*.cache"))
    names = "\n".join(f"  {i}: class{i}" for i in range(80))
    path = tmp_path / "coco8.yaml"
    path.write_text(f"path: {tmp_path / 'coco8'}\ntrain: images/train\nval: images/val\nnames:\n{names}\n")
    return path


@pytest.fixture
def global_torch_state():
    """The trainers set threads, RNGs and deterministic flags for the whole process: put them back after."""
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    cudnn_det, rng, env = torch.backends.cudnn.deterministic, torch.get_rng_state(), dict(os.environ)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(det)
    torch.backends.cudnn.deterministic = cudnn_det
    torch.set_rng_state(rng)
    os.environ.clear()
    os.environ.update(env)


def _groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: g.get(k) for k in KEYS} for g in optimizer.param_groups]


def _same_groups(a: list[dict[str, Any]], b: list[dict[str, Any]], where: str) -> None:
    for ga, gb in zip(a, b, strict=True):
        assert ga["param_group"] == gb["param_group"] and ga["nesterov"] == gb["nesterov"] is True, where
        assert bool(ga["use_muon"]) == bool(gb["use_muon"]), where
        for key in ("lr", "momentum", "weight_decay"):
            assert ga[key] == pytest.approx(gb[key], abs=1e-12), (where, key, ga, gb)


def _members(model: torch.nn.Module, optimizer: torch.optim.Optimizer, leave_out: set[str]) -> list[list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in g["params"] if names[id(p)] not in leave_out] for g in optimizer.param_groups]


def _record_ultralytics(data: Path, project: Path, case: dict[str, Any], monkeypatch) -> dict[str, Any]:
    from ultralytics import YOLO
    from ultralytics.engine.trainer import BaseTrainer

    if case["optimizer"] == "auto":  # the run Ultralytics counts as long: above 10,000 planned updates
        build = BaseTrainer.build_optimizer
        monkeypatch.setattr(BaseTrainer, "build_optimizer", lambda self, **k: build(self, **{**k, "iterations": LONG}))
    out: dict[str, Any] = {"iterations": []}

    def on_batch_end(trainer: Any) -> None:  # after this iteration's step: lr and momentum are the ones it used
        out["iterations"].append(_groups(trainer.optimizer))
        if "members" not in out:
            frozen = {n for n, p in trainer.model.named_parameters() if not p.requires_grad}
            out["members"] = _members(trainer.model, trainer.optimizer, frozen)
            out["type"], out["frozen"] = type(trainer.optimizer).__name__, frozen

    model = YOLO("yolo11n.yaml")
    model.add_callback("on_train_batch_end", on_batch_end)
    model.train(data=str(data), project=str(project), name="ultralytics", **COMMON, **case)
    return out


def _record_detrain(data: Path, project: Path, case: dict[str, Any], monkeypatch) -> dict[str, Any]:
    if case["optimizer"] == "auto":
        monkeypatch.setattr(trainer_module.optim, "planned_updates", lambda cfg, n_images: LONG)
    out: dict[str, Any] = {"iterations": []}
    step = Trainer._step

    def recording_step(self: Trainer, *args: Any, **kwargs: Any) -> Any:  # after warmup, before the forward
        out["iterations"].append(_groups(self.optimizer))
        if "members" not in out:
            out["members"] = _members(self._bare(), self.optimizer, set())
            out["type"] = type(self.optimizer).__name__
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "_step", recording_step)
    cfg = make_cfg({"model": "yolo11n.yaml", "data": str(data), "project": str(project), **COMMON, **case})
    Trainer(cfg, World(device="cpu"), RunPlan(save_dir=str(project / "detrain"))).train()
    return out


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_musgd_groups_lr_and_momentum_every_iteration_match_ultralytics(
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    coco8_yaml: Path,
    global_torch_state: None,
    monkeypatch: pytest.MonkeyPatch,
    case: dict[str, Any],
) -> None:
    with offline_ultralytics(tmp_path_factory):
        theirs = _record_ultralytics(coco8_yaml, tmp_path, case, monkeypatch)
    ours = _record_detrain(coco8_yaml, tmp_path, case, monkeypatch)

    assert ours["type"] == theirs["type"] == "MuSGD"
    assert theirs["frozen"] == {"model.23.dfl.conv.weight"}  # Ultralytics files it (in Muon's group); detrain not
    assert ours["members"] == theirs["members"]
    assert sum(len(m) for m in ours["members"][6:]) > 80  # the Muon groups hold the convolutions
    assert len(ours["iterations"]) == len(theirs["iterations"]) == 3 * 4 // case["batch"]
    for ni, (a, b) in enumerate(zip(ours["iterations"], theirs["iterations"])):
        _same_groups(a, b, f"iteration {ni}")
    last, first = ours["iterations"][-1], ours["iterations"][0]
    assert len({g["lr"] for g in last}) == 2  # the head's class branches at 3x
    if case["optimizer"] == "auto":  # built at 0.9, but warmup ends at the momentum key's 0.937; no bias kick
        assert {g["momentum"] for g in last} == {0.937}
        assert {g["lr"] for g in first if g["param_group"] == "bias"} == {0.0}


def test_yolo26n_groups_through_detrains_builder_match_ultralytics(tmp_path_factory: pytest.TempPathFactory) -> None:
    """YOLO26's head has ``one2one_cv3`` class branches too: both at 3x lr (detrain's YOLO26 is not built yet, so
    detrain's builder runs on Ultralytics' own model)."""
    with offline_ultralytics(tmp_path_factory):
        from ultralytics.engine.trainer import BaseTrainer
        from ultralytics.nn.tasks import DetectionModel

        theirs = DetectionModel("yolo26n.yaml", nc=80, verbose=False)
        ours = DetectionModel("yolo26n.yaml", nc=80, verbose=False)
        cfg = make_cfg({"optimizer": "auto"})
        args = SimpleNamespace(optimizer="auto", lr0=cfg.train.lr0, warmup_bias_lr=cfg.train.warmup_bias_lr)
        stand_in = SimpleNamespace(args=args, data={"nc": 80})
        their_opt = BaseTrainer.build_optimizer(stand_in, theirs, "auto", 0.01, 0.937, 5e-4, LONG)
    our_opt, name, lr = optim.build_optimizer(ours, cfg, 80, LONG, 5e-4)
    assert (name, lr) == (args.optimizer, args.lr0) == ("MuSGD", 0.01)
    frozen = {n for n, p in ours.named_parameters() if not p.requires_grad}
    assert _members(ours, our_opt, frozen) == _members(theirs, their_opt, frozen)
    _same_groups(_groups(our_opt), _groups(their_opt), "yolo26n")
    boosted = [n for m, g in zip(_members(ours, our_opt, set()), our_opt.param_groups) if g["lr"] == 0.03 for n in m]
    assert any(".one2one_cv3." in n for n in boosted) and any(".cv3." in n for n in boosted)
