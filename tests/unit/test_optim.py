"""Optimizer groups, schedules, warmup and the EMA."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from detrain.config.cfg import make_cfg
from detrain.engine.train.ema import ModelEMA
from detrain.engine.train.recipe import optim
from detrain.engine.train.recipe.musgd import MuSGD


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1))


def test_three_groups_decay_only_on_weights():
    net = _net()
    opt, name, lr = optim.build_optimizer(
        net, make_cfg({"optimizer": "SGD"}), nc=2, total_iterations=10, weight_decay=5e-4
    )
    assert name == "SGD" and lr == 0.01
    biases, weights, bn = opt.param_groups
    assert len(biases["params"]) == 3 and len(weights["params"]) == 2 and len(bn["params"]) == 1
    assert weights["weight_decay"] == 5e-4 and bn["weight_decay"] == 0 and biases["weight_decay"] == 0
    assert opt.defaults["nesterov"]


def test_auto_picks_adamw_for_short_runs_and_musgd_for_long_ones():
    cfg = make_cfg({"lr0": 0.02, "momentum": 0.95})  # auto ignores both
    _, short, lr = optim.build_optimizer(_net(), cfg, nc=80, total_iterations=100, weight_decay=0.0)
    opt, long, long_lr = optim.build_optimizer(_net(), cfg, nc=80, total_iterations=20_000, weight_decay=0.0)
    assert (short, long) == ("AdamW", "MuSGD") and lr == round(0.01 / 84, 6)
    assert isinstance(opt, MuSGD) and long_lr == 0.01 and {g["momentum"] for g in opt.param_groups} == {0.9}
    assert [g["param_group"] for g in opt.param_groups] == [r for r in ("weight", "bn", "bias", "muon") for _ in "12"]


def test_musgd_by_name_in_any_case_with_lr0_and_momentum_as_given():
    for spelling in ("MuSGD", "musgd", "MUSGD"):
        cfg = make_cfg({"optimizer": spelling, "lr0": 0.02})
        assert cfg.train.optimizer == "MuSGD"
        opt, name, lr = optim.build_optimizer(_net(), cfg, nc=2, total_iterations=10, weight_decay=5e-4)
        assert (name, lr, type(opt)) == ("MuSGD", 0.02, MuSGD)
        muon = [g for g in opt.param_groups if g["use_muon"] and g["params"]]
        assert len(muon) == 1 and len(muon[0]["params"]) == 2 and muon[0]["weight_decay"] == 5e-4
        assert {g["momentum"] for g in opt.param_groups} == {0.937} and all(g["nesterov"] for g in opt.param_groups)


def test_warmup_hands_musgd_to_its_per_group_rule():
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    net.head = nn.Module()
    net.head.cv3 = nn.Conv2d(4, 2, 1)  # a class branch: 3x lr
    net.head.class_parameters = net.head.cv3.parameters  # as a detrain head names it (detrain.nn.head.Head)
    for name, bias_start in (("MuSGD", 0.1), ("auto", 0.0)):  # auto: no bias-lr kick, as for AdamW
        cfg = make_cfg({"optimizer": name, "lr0": 0.01})
        opt, _, _ = optim.build_optimizer(net, cfg, nc=2, total_iterations=20_000, weight_decay=0.0)
        assert optim.apply_warmup(opt, cfg, 0, 10, 1.0, 123.0, 0.95, 4) == 1  # lr0 is not read for MuSGD
        lrs = {(g["param_group"], g["lr"]) for g in opt.param_groups if g["params"]}
        assert lrs == {("bias", bias_start), ("bn", 0.0), ("muon", 0.0)}
        assert optim.apply_warmup(opt, cfg, 10, 10, 0.5, 123.0, 0.95, 4) == 4
        ends = sorted((g["param_group"], round(g["lr"], 12)) for g in opt.param_groups if g["params"])
        assert ends == [("bias", 0.005), ("bias", 0.015), ("bn", 0.005), ("muon", 0.005), ("muon", 0.015)]
        assert {g["momentum"] for g in opt.param_groups} == {0.95}


def test_short_runs_from_scratch_update_every_batch_and_the_rest_gather_64_images():
    auto = make_cfg({"batch": 16})
    assert optim.images_per_update(auto, "AdamW", from_weights=False) == 16  # optimizer=auto, short, from scratch
    assert optim.images_per_update(auto, "AdamW", from_weights=True) == 64  # fine-tuning keeps the nominal 64
    assert optim.images_per_update(auto, "MuSGD", from_weights=False) == 64  # a long run (auto picked MuSGD)
    assert optim.images_per_update(make_cfg({"optimizer": "AdamW"}), "AdamW", False) == 64  # chosen by the user
    assert optim.images_per_update(make_cfg({"nbs": 32}), "AdamW", False) == 32  # a number is kept
    # weight decay is given per 64 images with nbs=auto, per nbs images otherwise
    assert optim.weight_decay_batch(auto) == 64 and optim.weight_decay_batch(make_cfg({"nbs": 24})) == 24


def test_updates_counted_for_the_auto_choice_as_ultralytics_counts_them():
    # ceil(n / max(batch, nbs)) * epochs, with 64 for nbs=auto: the same choice whatever nbs=auto resolves to
    assert optim.planned_updates(make_cfg({"epochs": 30}), 400) == 7 * 30
    assert optim.planned_updates(make_cfg({"epochs": 2, "batch": 128}), 400) == 4 * 2
    assert optim.auto_choice(make_cfg(), nc=80, updates=10_000)[0] == "AdamW"
    assert optim.auto_choice(make_cfg({"lr0": 0.02}), nc=80, updates=10_001) == ("MuSGD", 0.01, 0.9)
    assert optim.auto_choice(make_cfg({"optimizer": "SGD", "lr0": 0.02}), nc=80, updates=5) == ("SGD", 0.02, 0.937)


def test_lr_schedules_end_at_lrf():
    for cos in (False, True):
        f = optim.lr_lambda(make_cfg({"epochs": 10, "lrf": 0.01, "cos_lr": cos}))
        assert abs(f(0) - 1) < 1e-9 and abs(f(10) - 0.01) < 1e-9 and f(3) > f(7)


def test_warmup_ramps_lr_momentum_and_accumulation():
    cfg = make_cfg({"optimizer": "SGD"})
    opt, _, _ = optim.build_optimizer(_net(), cfg, nc=2, total_iterations=10, weight_decay=0.0)
    acc0 = optim.apply_warmup(opt, cfg, 0, 100, 1.0, 0.01, 0.937, 4)
    assert acc0 == 1 and opt.param_groups[0]["lr"] == cfg.train.warmup_bias_lr and opt.param_groups[1]["lr"] == 0
    assert opt.param_groups[1]["momentum"] == cfg.train.warmup_momentum
    acc1 = optim.apply_warmup(opt, cfg, 100, 100, 1.0, 0.01, 0.937, 4)
    assert acc1 == 4 and all(abs(g["lr"] - 0.01) < 1e-12 for g in opt.param_groups)
    auto = make_cfg()  # optimizer=auto: no bias-lr kick at the start (it would wreck pretrained weights)
    optim.apply_warmup(opt, auto, 0, 100, 1.0, 0.01, 0.937, 4)
    assert opt.param_groups[0]["lr"] == 0


def test_warmup_leaves_adam_betas_alone():
    for name in ("AdamW", "Adam"):
        cfg = make_cfg({"optimizer": name})
        opt, _, _ = optim.build_optimizer(_net(), cfg, nc=2, total_iterations=10, weight_decay=0.0)
        for ni in (0, 50, 100):
            optim.apply_warmup(opt, cfg, ni, 100, 1.0, 0.01, cfg.train.momentum, 4)
            assert all(g["betas"] == (cfg.train.momentum, 0.999) for g in opt.param_groups)
        assert all(abs(g["lr"] - 0.01) < 1e-12 for g in opt.param_groups)  # the lr is still warmed


def test_no_warmup_touches_nothing():
    cfg = make_cfg({"optimizer": "SGD", "warmup_epochs": 0})
    opt, _, _ = optim.build_optimizer(_net(), cfg, nc=2, total_iterations=10, weight_decay=0.0)
    assert optim.warmup_iterations(cfg, 50) == 0
    assert optim.apply_warmup(opt, cfg, 0, 0, 1.0, 0.01, 0.937, 4) == 4
    assert all(g["lr"] == 0.01 and g["momentum"] == 0.937 for g in opt.param_groups)


def test_warmup_length_has_no_floor_and_spares_the_last_epoch():
    def n(warmup_epochs, epochs, nb):
        return optim.warmup_iterations(make_cfg({"warmup_epochs": warmup_epochs, "epochs": epochs}), nb)

    assert n(3.0, 100, 500) == 1500 and n(3.0, 100, 4) == 12  # no 100-iteration minimum
    assert n(3.0, 3, 10) == 20 and n(3.0, 1, 10) == 0  # at most epochs - 1
    assert n(0.5, 10, 5) == 2 and n(0.0, 10, 5) == 0  # round() of a fraction; off


def test_ema_follows_the_model():
    net = _net()
    ema = ModelEMA(net, decay=0.5, tau=1.0)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    for _ in range(50):
        ema.update(net)
    for a, b in zip(ema.ema.parameters(), net.parameters()):
        assert torch.allclose(a, b, atol=1e-3)
    assert not any(p.requires_grad for p in ema.ema.parameters())


def test_ema_leaves_integer_buffers_as_copied():
    net = _net()
    ema = ModelEMA(net)
    net.train()
    net(torch.rand(2, 3, 8, 8))  # BatchNorm counts a batch and moves its running statistics
    ema.update(net)
    assert int(net[1].num_batches_tracked) == 1 and int(ema.ema[1].num_batches_tracked) == 0
    assert not torch.equal(ema.ema[1].running_mean, torch.zeros(4))  # float buffers are averaged


def test_fused_update_kernel_on_cpu_and_kept_when_loading_a_state():
    net = _net()
    for name in ("SGD", "AdamW"):
        opt, _, _ = optim.build_optimizer(
            net, make_cfg({"optimizer": name}), nc=2, total_iterations=10, weight_decay=5e-4
        )
        assert all(g["fused"] for g in opt.param_groups)
        net(torch.rand(1, 3, 8, 8)).sum().backward()
        opt.step()
        state = opt.state_dict()
        for group in state["param_groups"]:  # as an older or other-device checkpoint would have it
            group["fused"], group["foreach"] = None, True
        again, _, _ = optim.build_optimizer(
            net, make_cfg({"optimizer": name}), nc=2, total_iterations=10, weight_decay=5e-4
        )
        optim.load_optimizer_state(again, state)
        assert all(g["fused"] and not g.get("foreach") for g in again.param_groups)
        assert state["param_groups"][0]["fused"] is None  # the caller's dict is left as it was
        again.step()
        net.zero_grad()


def test_fused_sgd_takes_the_same_step_as_the_per_tensor_loop():
    torch.manual_seed(0)
    nets = [_net(), _net()]
    nets[1].load_state_dict(nets[0].state_dict())
    opts = []
    for net, fused in zip(nets, (True, False)):
        opt, _, _ = optim.build_optimizer(
            net, make_cfg({"optimizer": "SGD"}), nc=2, total_iterations=10, weight_decay=5e-4
        )
        if not fused:
            groups = [{**g, "fused": None, "foreach": False} for g in opt.param_groups]
            opt = torch.optim.SGD(groups, lr=0.01, momentum=0.937, nesterov=True)
        assert bool(opt.param_groups[0]["fused"]) is fused
        opts.append(opt)
    x = torch.rand(2, 3, 8, 8)
    for _ in range(3):
        for net, opt in zip(nets, opts):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
    for a, b in zip(*(n.parameters() for n in nets)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_lr_follows_the_update_past_the_one_lr0_is_used_with():
    """The recipe's choice per batch and optimizer (lr_scale=auto): nothing changes up to the update lr0 is used
    with at the default batch (16 images for AdamW from scratch, which updates on every batch; else nbs, 64), then
    lr0 grows with the square root of the ratio for Adam's kind and linearly for SGD and MuSGD; lr_scale=none is
    Ultralytics' recipe (lr0 whatever the batch), linear and sqrt force their rule from the same point."""
    auto = make_cfg()
    sizes = (16, 64, 128, 256, 1024)
    assert [optim.lr_scale_factor(auto, "AdamW", n) for n in sizes] == [1, 2, 8**0.5, 4, 8]  # from scratch
    assert [optim.lr_scale_factor(auto, "Adam", n) for n in sizes] == [1, 2, 8**0.5, 4, 8]
    assert [optim.lr_scale_factor(auto, "AdamW", n, from_weights=True) for n in sizes] == [1, 1, 2**0.5, 2, 4]
    for name in ("SGD", "MuSGD"):  # updates of 64 images: lr0's own
        assert [optim.lr_scale_factor(auto, name, n) for n in sizes] == [1, 1, 2, 4, 16]
    chosen = make_cfg({"optimizer": "AdamW"})  # a chosen AdamW accumulates to 64 images: lr0 is for those
    assert [optim.lr_scale_factor(chosen, "AdamW", n) for n in sizes] == [1, 1, 2**0.5, 2, 4]
    linear = make_cfg({"lr_scale": "linear"})
    assert [optim.lr_scale_factor(linear, "AdamW", n) for n in sizes] == [1, 4, 8, 16, 64]
    assert optim.lr_scale_factor(make_cfg({"lr_scale": "none"}), "SGD", 1024) == 1.0
    assert optim.lr_scale_factor(make_cfg({"lr_scale": "sqrt"}), "SGD", 256) == 2.0
    # a nominal batch given by nbs moves the point where scaling starts: updates of nbs images are lr0's own
    assert optim.lr_scale_factor(make_cfg({"nbs": 256}), "SGD", 256) == 1.0
    assert optim.lr_scale_factor(make_cfg({"nbs": 128}), "SGD", 512) == 4.0
    assert optim.lr_scale_factor(make_cfg({"nbs": 16}), "AdamW", 64) == 2.0  # every batch of 16 updates: sqrt(4)


def test_the_scaled_lr_is_what_every_group_starts_from():
    """build_optimizer multiplies the chosen lr0 (optimizer=auto's too) by the factor: every group's initial_lr,
    which the schedule and warmup scale, is the scaled rate."""
    cfg = make_cfg({"optimizer": "SGD", "lr0": 0.01})
    opt, name, lr = optim.build_optimizer(_net(), cfg, nc=3, total_iterations=100, weight_decay=0.0, lr_factor=4.0)
    assert name == "SGD" and lr == 0.04
    assert {g["initial_lr"] for g in opt.param_groups} == {0.04}
    auto_lr = optim.auto_choice(make_cfg(), 3, 100)[1]
    _, _, lr = optim.build_optimizer(_net(), make_cfg(), nc=3, total_iterations=100, weight_decay=0.0, lr_factor=2.0)
    assert lr == 2 * auto_lr


def test_the_recipe_follows_the_planned_update_whatever_the_world():
    """Nodes joining or leaving keep the global batch (each worker keeps its batch and accumulates for the ones
    missing): the update the recipe scales for is the planned one, so the lr does not move with the world."""
    from detrain.engine.train.batch_plan import batch_plan

    cfg = make_cfg({"batch": 256})
    full, shrunk = batch_plan(256, 256, world=4, planned_world=4), batch_plan(256, 256, world=2, planned_world=4)
    assert full.update_images == shrunk.update_images == 256 and shrunk.accumulate == 2
    assert optim.lr_scale_factor(cfg, "AdamW", shrunk.update_images) == optim.lr_scale_factor(cfg, "AdamW", 256) == 4


def test_batchnorm_momentum_follows_the_global_batch_past_16_images():
    """BatchNorm's momentum remembers as many images at any global batch as 0.03 does at 16: 0.03 up to 16 images a
    forward pass (every batch of today's small runs trains as before), 1 - 0.97 ** (n / 16) past it; lr_scale=none
    keeps Ultralytics' 0.03 whatever the batch."""
    auto = make_cfg()
    got = [optim.batchnorm_momentum(auto, n) for n in (4, 16, 32, 256, 1024)]
    assert got[:2] == [0.03, 0.03]
    assert got[2:] == pytest.approx([1 - 0.97**2, 1 - 0.97**16, 1 - 0.97**64])
    for rule in ("linear", "sqrt"):
        assert optim.batchnorm_momentum(make_cfg({"lr_scale": rule}), 256) == got[3]
    assert optim.batchnorm_momentum(make_cfg({"lr_scale": "none"}), 1024) == 0.03


def test_batchnorm_momentum_per_update_is_the_same_when_the_world_shrinks():
    """Half the planned workers: forward passes of half the images, two of them an update; what the running
    statistics keep of the past after an update is what the whole world's one forward pass keeps."""
    from detrain.engine.train.batch_plan import batch_plan

    cfg = make_cfg()
    full, shrunk = batch_plan(256, 256, world=4, planned_world=4), batch_plan(256, 256, world=2, planned_world=4)
    kept = [
        (1 - optim.batchnorm_momentum(cfg, p.step_images)) ** p.accumulate for p in (full, shrunk)
    ]  # fmt: skip
    assert kept[0] == pytest.approx(kept[1])


def test_the_recipe_sets_every_batchnorm_layer_s_momentum():
    """build_recipe gives every BatchNorm layer (SyncBatchNorm's too) the momentum of the planned forward pass, and
    says it on the optimizer line; at 16 images nothing changes."""
    from detrain.engine.train.batch_plan import batch_plan
    from detrain.engine.train.setup import build_recipe, recipe_lines

    for batch, expected in ((16, 0.03), (256, 1 - 0.97**16)):
        net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.SyncBatchNorm(4))
        plan = batch_plan(batch, batch, world=1, planned_world=1)
        cfg = make_cfg({"batch": batch})
        recipe = build_recipe(net, cfg, nc=3, plan=plan, total_iters=100)
        assert [m.momentum for m in (net[1], net[2])] == pytest.approx([expected] * 2)
        assert type(net[1]) is nn.BatchNorm2d and recipe.ghost_images == 0
        line = recipe_lines(recipe, cfg, plan, 1, 10, "cpu")[0]
        assert ("BatchNorm momentum 0.386" in line) == (batch == 256), line
        assert "ghost" not in line


def test_one_process_of_256_can_normalise_as_16_ranks_of_16():
    """bn_images=16: a pass of 256 images in one process is normalised in ghost batches of 16 whose statistics
    each take 0.03 (as 16 passes of 16 would), 16 ranks of 16 keep whole passes at the global batch's momentum
    (0.386), and sync_bn's layers are left to the global batch; the optimizer line says which. The default (0)
    normalises the whole pass."""
    from detrain.engine.train.batch_plan import batch_plan
    from detrain.engine.train.setup import build_recipe, recipe_lines
    from detrain.nn.modules import GhostBatchNorm2d

    cfg = make_cfg({"batch": 256, "bn_images": 16})
    for world, ghost, momentum in ((1, 16, 0.03), (16, 0, 1 - 0.97**16)):
        net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.SyncBatchNorm(4))
        plan = batch_plan(256, 256, world=world, planned_world=world)
        recipe = build_recipe(net, cfg, nc=3, plan=plan, total_iters=100)
        assert recipe.ghost_images == ghost
        assert (type(net[1]) is GhostBatchNorm2d) == bool(ghost) and type(net[2]) is nn.SyncBatchNorm
        assert [m.momentum for m in (net[1], net[2])] == pytest.approx([momentum] * 2)
        line = recipe_lines(recipe, cfg, plan, world, 10, "cpu")[0]
        assert ("BatchNorm over ghost batches of 16 images" in line) == bool(ghost), line
    net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))  # the default: the whole pass
    assert build_recipe(net, make_cfg({"batch": 256}), 3, batch_plan(256, 256, 1, 1), 100).ghost_images == 0
    assert type(net[1]) is nn.BatchNorm2d


def test_a_ghost_batch_layer_is_the_layer_run_on_each_run_of_images():
    """Training: each run of 16 of a pass of 64 is normalised as a BatchNorm2d would normalise it alone, the
    running statistics update once per run (as four passes of 16 in a row), gradients flow to every run; eval:
    the plain layer; the state-dict keys are BatchNorm2d's; 0 turns it back."""
    from detrain.nn.modules import GhostBatchNorm2d, use_ghost_batches

    torch.manual_seed(0)
    x = torch.randn(64, 4, 5, 5) * 3 + 1
    plain = nn.BatchNorm2d(4, momentum=0.1)
    ghost = use_ghost_batches(nn.Sequential(copy.deepcopy(plain)), 16)[0]
    assert type(ghost) is GhostBatchNorm2d and list(ghost.state_dict()) == list(plain.state_dict())
    xg = x.clone().requires_grad_(True)
    out = ghost(xg)
    expected = torch.cat([plain(run) for run in x.split(16)])  # four passes of 16, one after another
    torch.testing.assert_close(out, expected)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(ghost, name), getattr(plain, name))
    out.square().sum().backward()
    assert xg.grad is not None and bool((xg.grad.abs().sum((1, 2, 3)) > 0).all())
    assert not torch.allclose(out, nn.BatchNorm2d(4)(x))  # the whole pass normalises differently
    ghost.eval(), plain.eval()
    torch.testing.assert_close(ghost(x), plain(x))
    uneven = use_ghost_batches(nn.Sequential(nn.BatchNorm2d(4)), 16)[0]
    uneven(torch.randn(33, 4, 2, 2))  # runs of 11: no run is a lone image
    assert int(uneven.num_batches_tracked) == 3
    assert type(use_ghost_batches(nn.Sequential(ghost), 0)[0]) is nn.BatchNorm2d


@pytest.mark.parametrize("name", ["Adamax", "NAdam", "RAdam", "RMSProp"])
def test_the_rest_of_ultralytics_optimizers_build_its_three_groups(name: str) -> None:
    """Ultralytics' other optimizers (any case, as its optimizer= takes them): torch's class over the three groups,
    the momentum key as Adam's beta1 or RMSprop's momentum (which warmup then raises), the decay on weights only."""
    cfg = make_cfg({"optimizer": name.lower(), "lr0": 0.002, "momentum": 0.8})
    opt, chosen, lr = optim.build_optimizer(_net(), cfg, nc=3, total_iterations=100, weight_decay=0.01)
    assert chosen == name and lr == 0.002
    assert type(opt).__name__ == {"RMSProp": "RMSprop"}.get(name, name)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.01, 0.0]
    first = opt.param_groups[0]
    assert (first["momentum"] if name == "RMSProp" else first["betas"][0]) == 0.8
    optim.apply_warmup(opt, cfg, ni=0, n_warmup=10, epoch_factor=1.0, lr0=0.002, momentum=0.8, accumulate_target=1)
    if name == "RMSProp":
        assert opt.param_groups[1]["momentum"] == cfg.train.warmup_momentum
