"""The training recipe around the optimizer against Ultralytics' own code (not a re-implementation of it).

* parameter groups, weight decay, lr0, momentum/betas and the optimizer class: Ultralytics'
  ``BaseTrainer.build_optimizer`` called with a stand-in ``self`` on its own YOLOv8n, detrain's
  ``build_optimizer`` on detrain's (the parameter names are the same);
* warmup length: ``BaseTrainer._get_warmup_iterations`` against ``optim.warmup_iterations``;
* lr, momentum/betas, weight decay and accumulation at every iteration, and the iterations that step:
  Ultralytics' real trainer and detrain's real Trainer, both run briefly on a copy of coco8, recorded per
  iteration (a callback there, a test-side wrapper of ``Trainer._step``/``_optimizer_step`` here);
* the EMA: both ``ModelEMA.update`` on copies of one model through the same weight changes;
* gradient clipping: both ``optimizer_step`` driven with recording stand-ins (what is clipped, when, how far).

Ultralytics is not a dependency: every test skips when it cannot be imported. To run them, e.g.
``PYTHONPATH=/opt/ulib YOLO_OFFLINE=1 YOLO_CONFIG_DIR=/tmp/ycfg python -m pytest
tests/integration/test_parity_recipe.py``.
The coco8 runs need ``../shared/data/coco8`` and skip without it.
"""

from __future__ import annotations

import copy
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
from detrain.engine.build import build_model
from detrain.engine.run_plan import RunPlan
from detrain.engine.train import trainer as trainer_module
from detrain.engine.train.ema import ModelEMA
from detrain.engine.train.recipe import optim
from detrain.engine.train.trainer import Trainer

COCO8 = Path(__file__).resolve().parents[3] / "shared" / "data" / "coco8"
NC = 3
ROLES = ("bias", "weight", "bn")  # detrain's group order; Ultralytics names its groups by "param_group"
TOL = 1e-9


@pytest.fixture(scope="module")
def ul(tmp_path_factory):
    """Ultralytics' modules, imported only when a test here runs (not at collection), offline and with its
    settings file in a temporary folder unless the caller chose one."""
    with offline_ultralytics(tmp_path_factory):
        from ultralytics.engine.trainer import BaseTrainer
        from ultralytics.nn.tasks import DetectionModel
        from ultralytics.utils.torch_utils import ModelEMA as UltralyticsEMA

        yield SimpleNamespace(BaseTrainer=BaseTrainer, DetectionModel=DetectionModel, ModelEMA=UltralyticsEMA)


@pytest.fixture
def global_torch_state():
    """The trainers set threads, RNGs and deterministic flags for the whole process: put them back after."""
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    cudnn_det, rng, env = torch.backends.cudnn.deterministic, torch.get_rng_state(), dict(os.environ)
    torch.set_num_threads(1)  # tiny convolutions: 1 thread is faster on a busy 2-core machine
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(det)
    torch.backends.cudnn.deterministic = cudnn_det
    torch.set_rng_state(rng)
    os.environ.clear()
    os.environ.update(env)


# ------------------------------------------------------------------ a. parameter groups


def _ultralytics_optimizer(ul, cfg, model, iterations: int, weight_decay: float):
    """``BaseTrainer.build_optimizer`` unbound: it reads ``self.args`` (and may rewrite optimizer, lr0 and
    warmup_bias_lr there, as its auto choice does) and ``self.data["nc"]``. Returns (optimizer, args after)."""
    args = SimpleNamespace(optimizer=cfg.train.optimizer, lr0=cfg.train.lr0, warmup_bias_lr=cfg.train.warmup_bias_lr)
    stand_in = SimpleNamespace(args=args, data={"nc": NC})
    opt = ul.BaseTrainer.build_optimizer(
        stand_in,
        model=model,
        name=cfg.train.optimizer,
        lr=cfg.train.lr0,
        momentum=cfg.train.momentum,
        decay=weight_decay,
        iterations=iterations,
    )
    return opt, args


def _groups_by_role(opt, model, roles) -> dict[str, dict[str, Any]]:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for role, group in zip(roles, opt.param_groups):
        out[role] = {
            "names": {names[id(p)] for p in group["params"]},
            **{k: group.get(k) for k in ("lr", "weight_decay", "momentum", "betas", "nesterov")},
        }
    return out


@pytest.mark.parametrize(("name", "iterations"), [("auto", 300), ("SGD", 300), ("AdamW", 300), ("Adam", 300)])
def test_parameter_groups_match(ul, name, iterations):
    cfg = make_cfg({"optimizer": name})
    weight_decay = 0.0005 * 48 / 64  # as a caller scales it for batch 16, accumulate 3, nbs 64
    umodel = ul.DetectionModel("yolov8n.yaml", nc=NC, verbose=False)
    dmodel, _ = build_model("n.yaml", nc=NC, verbose=False)
    uopt, uargs = _ultralytics_optimizer(ul, cfg, umodel, iterations, weight_decay)
    dopt, dname, dlr = optim.build_optimizer(dmodel, cfg, NC, iterations, weight_decay)
    assert type(dopt) is type(uopt) and dname == uargs.optimizer != "auto"
    assert dlr == uargs.lr0 == uopt.param_groups[0]["lr"]

    u = _groups_by_role(uopt, umodel, [g["param_group"] for g in uopt.param_groups])
    d = _groups_by_role(dopt, dmodel, ROLES)
    # Ultralytics files every parameter, the frozen DFL projection too (it never gets a gradient, so never
    # moves); detrain leaves out what does not train
    frozen = {n for n, p in umodel.named_parameters() if not p.requires_grad}
    assert frozen == {"model.22.dfl.conv.weight"}
    for role in ROLES:
        assert d[role]["names"] == u[role]["names"] - frozen, role
        for key in ("lr", "weight_decay", "momentum", "betas", "nesterov"):
            assert d[role][key] == u[role][key], (role, key, d[role][key], u[role][key])
    assert u["weight"]["weight_decay"] == weight_decay and u["bn"]["weight_decay"] == u["bias"]["weight_decay"] == 0

    # auto starts the bias warmup at 0 in both (Ultralytics by rewriting warmup_bias_lr; detrain in apply_warmup)
    optim.apply_warmup(dopt, cfg, 0, 10, 1.0, dlr, cfg.train.momentum, 1)
    assert dopt.param_groups[0]["lr"] == uargs.warmup_bias_lr


@pytest.mark.parametrize(("ours", "theirs"), [("n.yaml", "yolov8n.yaml"), ("yolo11n.yaml", "yolo11n.yaml")])
def test_auto_long_run_picks_the_same_optimizer(ul, ours, theirs):
    # above 10,000 planned updates both pick MuSGD at lr 0.01 and momentum 0.9, whatever lr0 and momentum say and
    # whatever the family, with the same eight groups (members, lr, weight decay, momentum, Muon or not)
    cfg = make_cfg({"optimizer": "auto", "lr0": 0.02, "momentum": 0.95})
    umodel = ul.DetectionModel(theirs, nc=NC, verbose=False)
    dmodel = build_model(ours, nc=NC, verbose=False)[0]
    uopt, uargs = _ultralytics_optimizer(ul, cfg, umodel, 20_000, 5e-4)
    dopt, dname, dlr = optim.build_optimizer(dmodel, cfg, NC, 20_000, 5e-4)
    assert type(dopt).__name__ == type(uopt).__name__ == dname == uargs.optimizer == "MuSGD"
    assert dlr == uargs.lr0 == 0.01 and (dopt.muon, dopt.sgd) == (uopt.muon, uopt.sgd)
    frozen = {n for n, p in umodel.named_parameters() if not p.requires_grad}  # the DFL projection: detrain omits it
    unames = {id(p): n for n, p in umodel.named_parameters()}
    dnames = {id(p): n for n, p in dmodel.named_parameters()}
    assert len(dopt.param_groups) == len(uopt.param_groups) == 8
    for dg, ug in zip(dopt.param_groups, uopt.param_groups):
        theirs = [unames[id(p)] for p in ug["params"] if unames[id(p)] not in frozen]
        assert [dnames[id(p)] for p in dg["params"]] == theirs
        for key in ("param_group", "lr", "momentum", "weight_decay", "nesterov", "use_muon"):
            assert dg.get(key) == ug.get(key), (ug["param_group"], key)
    assert {g["lr"] for g in dopt.param_groups} == {0.01, 0.03}
    # auto starts the bias warmup at 0 in both (Ultralytics by rewriting warmup_bias_lr; detrain in apply_warmup)
    optim.apply_warmup(dopt, cfg, 0, 10, 1.0, dlr, cfg.train.momentum, 1)
    assert {g["lr"] for g in dopt.param_groups if g["param_group"] == "bias"} == {uargs.warmup_bias_lr} == {0.0}


@pytest.mark.parametrize(
    ("warmup_epochs", "epochs", "nb"),
    [
        (3.0, 100, 500),
        (3.0, 100, 4),
        (3.0, 3, 10),
        (3.0, 1, 10),
        (0.5, 10, 5),
        (1.5, 10, 7),
        (0.0, 10, 5),
        (10.0, 4, 3),
    ],
)
def test_warmup_iterations_match(ul, warmup_epochs, epochs, nb):
    stand_in = SimpleNamespace(args=SimpleNamespace(warmup_epochs=warmup_epochs), epochs=epochs)
    expected = ul.BaseTrainer._get_warmup_iterations(stand_in, nb)
    assert optim.warmup_iterations(make_cfg({"warmup_epochs": warmup_epochs, "epochs": epochs}), nb) == expected


# ------------------------------------------------------------------ b. every iteration of a real run

# 4 training images. sgd-cosine: batch 1, 4 iterations an epoch, 4 of warmup, accumulation ramping 1 -> 4;
# auto-adamw: a short run, so AdamW at the fitted lr, weight decay scaled by batch*accumulate/nbs = 4/3;
# no-warmup: warmup_epochs 0. accumulate-cap: nbs/batch = 32 steps exceed the run's 4 iterations. across-epochs:
# updates of 3 batches in epochs of 4, so gradients wait across every epoch's end.
CASES = {
    "sgd-cosine": dict(optimizer="SGD", batch=1, nbs=4, epochs=3, warmup_epochs=1.0, cos_lr=True),
    "auto-adamw": dict(optimizer="auto", batch=2, nbs=3, epochs=4, warmup_epochs=2.0),
    "no-warmup": dict(optimizer="SGD", batch=2, nbs=4, epochs=2, warmup_epochs=0.0),
    "accumulate-cap": dict(optimizer="SGD", batch=2, nbs=64, epochs=2, warmup_epochs=0.0),
    "across-epochs": dict(optimizer="SGD", batch=1, nbs=3, epochs=3, warmup_epochs=0.0),  # 4 batches, updates of 3
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


@pytest.fixture(scope="module")
def coco8_yaml(tmp_path_factory) -> Path:
    """A private copy (both trainers write label caches next to the labels)."""
    if not (COCO8 / "images" / "train").is_dir():
        pytest.skip(f"{COCO8} not found")
    root = tmp_path_factory.mktemp("coco8")
    shutil.copytree(COCO8, root / "coco8", ignore=shutil.ignore_patterns("*.cache"))
    names = "\n".join(f"  {i}: class{i}" for i in range(80))
    path = root / "coco8.yaml"
    path.write_text(f"path: {root / 'coco8'}\ntrain: images/train\nval: images/val\nnames:\n{names}\n")
    return path


def _snapshot(optimizer, roles, accumulate: int) -> dict[str, Any]:
    return {
        "accumulate": accumulate,
        "step": False,
        "optimizer": type(optimizer).__name__,
        "groups": {
            role: {k: g.get(k) for k in ("lr", "momentum", "betas", "weight_decay", "nesterov")}
            for role, g in zip(roles, optimizer.param_groups)
        },
    }


def _record_ultralytics(data: Path, project: Path, args: dict[str, Any]) -> list[dict[str, Any]]:
    from ultralytics import YOLO

    records: list[dict[str, Any]] = []
    updates = [0]

    def on_batch_end(trainer):  # after this iteration's step (if any); lr and momentum are the ones it used
        rec = _snapshot(
            trainer.optimizer, [g["param_group"] for g in trainer.optimizer.param_groups], trainer.accumulate
        )
        rec["step"] = trainer.ema.updates > updates[0]
        updates[0] = trainer.ema.updates
        records.append(rec)

    model = YOLO("yolov8n.yaml")
    model.add_callback("on_train_batch_end", on_batch_end)
    model.train(data=str(data), project=str(project), name="ultralytics", **COMMON, **args)
    return records


def _record_detrain(data: Path, project: Path, args: dict[str, Any], monkeypatch) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    step, optimizer_step, apply_warmup = Trainer._step, Trainer._optimizer_step, trainer_module.optim.apply_warmup
    warm: dict[str, int] = {}

    def recording_warmup(*a, **k):  # the accumulation warmup chose for this iteration
        warm["accumulate"] = apply_warmup(*a, **k)
        return warm["accumulate"]

    def recording_step(self, batch, will_step):  # after apply_warmup, before the forward
        records.append(_snapshot(self.optimizer, ROLES, warm.pop("accumulate", self.accumulate_target)))
        records[-1]["nb"] = self.nb
        return step(self, batch, will_step)

    def recording_optimizer_step(self):
        records[-1]["step"] = True
        return optimizer_step(self)

    monkeypatch.setattr(trainer_module.optim, "apply_warmup", recording_warmup)
    monkeypatch.setattr(Trainer, "_step", recording_step)
    monkeypatch.setattr(Trainer, "_optimizer_step", recording_optimizer_step)
    cfg = make_cfg({"model": "n.yaml", "data": str(data), "project": str(project), "name": "detrain", **COMMON, **args})
    Trainer(cfg, World(device="cpu"), RunPlan(save_dir=str(project / "detrain"))).train()
    return records


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_recipe_per_iteration_matches(ul, coco8_yaml, tmp_path, monkeypatch, global_torch_state, case):
    u = _record_ultralytics(coco8_yaml, tmp_path, case)
    d = _record_detrain(coco8_yaml, tmp_path, case, monkeypatch)
    assert len(d) == len(u) > 0
    # when to step: both step once `accumulate` batches have gathered since the last step, counted over the run
    # (gradients wait across an epoch's end), so at the same iterations
    assert [a["step"] for a in d] == [b["step"] for b in u]
    last = -1
    for ni, a in enumerate(d):
        assert a["step"] == (ni - last >= a["accumulate"]), (ni, a)
        last = ni if a["step"] else last
    for ni, (a, b) in enumerate(zip(d, u)):
        where = f"iteration {ni}: detrain {a}\nultralytics {b}"
        assert a["optimizer"] == b["optimizer"], where
        assert a["accumulate"] == b["accumulate"], where
        for role in ROLES:
            ga, gb = a["groups"][role], b["groups"][role]
            assert ga["nesterov"] == gb["nesterov"], where
            for key in ("lr", "momentum", "weight_decay"):
                assert (ga[key] is None) == (gb[key] is None), (key, where)
                if ga[key] is not None:
                    assert abs(ga[key] - gb[key]) <= TOL, (role, key, where)
            assert (ga["betas"] is None) == (gb["betas"] is None), where
            if ga["betas"] is not None:
                assert max(abs(x - y) for x, y in zip(ga["betas"], gb["betas"])) <= TOL, (role, where)


# ------------------------------------------------------------------ c. EMA


def test_ema_matches(ul):
    torch.manual_seed(0)
    model, _ = build_model("n.yaml", nc=NC, verbose=False)
    for start in (0, 5000):  # the ramp's first updates, and near the full decay
        ours, theirs = ModelEMA(model, updates=start), ul.ModelEMA(model, updates=start)
        net = copy.deepcopy(model).train()
        for _ in range(4):
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(torch.randn_like(p), alpha=0.05)
                net(torch.rand(2, 3, 64, 64))  # BatchNorm: running statistics and num_batches_tracked move
            ours.update(net)
            theirs.update(net)
            assert ours.updates == theirs.updates
            assert abs(ours.current_decay() - theirs.decay(theirs.updates)) <= 1e-12
            a, b = ours.ema.state_dict(), theirs.ema.state_dict()
            assert a.keys() == b.keys()
            for key in a:
                if a[key].dtype.is_floating_point:
                    torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-6, msg=key)
                else:
                    assert torch.equal(a[key], b[key]), key
        assert int(net.model[0].bn.num_batches_tracked) == 4
    for n in (1, 10, 100, 2000, 10_000, 100_000):  # the ramp itself, far beyond the updates run above
        ours.updates = n
        assert abs(ours.current_decay() - theirs.decay(n)) <= 1e-12


# ------------------------------------------------------------------ d. gradient clipping


class _Recorder:
    """Stands in for the scaler, optimizer and EMA: records the order of the calls made to it."""

    def __init__(self, calls: list, prefix: str) -> None:
        self.calls, self.prefix = calls, prefix

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: self.calls.append(f"{self.prefix}.{name}")


_CLIP = torch.nn.utils.clip_grad_norm_


def _drive(step_fn, stand_in, calls, monkeypatch) -> list:
    def recording_clip(parameters, max_norm, *args, **kwargs):
        calls.append(("clip", float(max_norm)))
        return _CLIP(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)
    step_fn(stand_in)
    return calls


def test_gradient_clipping_matches(ul, monkeypatch):
    net = torch.nn.Linear(4, 2)
    net(torch.rand(3, 4)).sum().mul(100).backward()

    def stand_in(calls, **extra):
        return SimpleNamespace(
            scaler=_Recorder(calls, "scaler"),
            optimizer=_Recorder(calls, "optimizer"),
            ema=_Recorder(calls, "ema"),
            model=net,
            device=torch.device("cpu"),
            **extra,
        )

    u_calls: list = []
    theirs = _drive(ul.BaseTrainer.optimizer_step, stand_in(u_calls), u_calls, monkeypatch)
    d_calls: list = []
    ours = _drive(Trainer._optimizer_step, stand_in(d_calls, cfg=make_cfg()), d_calls, monkeypatch)
    # unscale, then clip the norm of all gradients to 10, then step: the same calls in the same order
    assert (
        ours
        == theirs
        == ["scaler.unscale_", ("clip", 10.0), "scaler.step", "scaler.update", "optimizer.zero_grad", "ema.update"]
    )
    assert make_cfg().train.clip_grad == 10.0
