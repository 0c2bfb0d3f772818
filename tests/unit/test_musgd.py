"""MuSGD without Ultralytics: the orthogonalisation, a step against a hand computation (SGD part, Muon part,
weight decay after the Muon step), the parameter groups, the auto choice, warmup and a resumed state."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from detrain.config.cfg import make_cfg
from detrain.engine.train.recipe import optim
from detrain.engine.train.recipe.musgd import (
    MuSGD,
    apply_group_warmup,
    build_musgd,
    muon_directions,
    musgd_param_groups,
    orthogonalize,
)
from detrain.nn.model import DetectionModel


@pytest.mark.parametrize("shape", [(16, 64), (64, 16), (24, 24)])
def test_orthogonalize_pushes_every_singular_value_near_one(shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(0)
    k = min(shape)
    u, _ = torch.linalg.qr(torch.randn(shape[0], k, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(shape[1], k, generator=gen))
    g = (u * torch.linspace(0.1, 3.0, k)) @ v.T  # singular values 30x apart
    g = g[None]
    q = orthogonalize(g)
    assert q.dtype == torch.bfloat16 and q.shape == g.shape
    s = torch.linalg.svdvals(q.float()[0])
    assert float(s.min()) > 0.5 and float(s.max()) < 1.3
    # the same singular vectors as g's: q is about U V^T
    torch.testing.assert_close(q.float()[0], u @ v.T, rtol=0, atol=0.35)
    assert float(torch.linalg.matrix_norm(q.float()[0] - u @ v.T) / k**0.5) < 0.3


def test_zero_padded_rows_stay_zero_and_leave_the_rest_nearly_unchanged() -> None:
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(1, 6, 20, generator=gen)
    padded = torch.cat((g, torch.zeros(1, 10, 20)), 1)
    q, qp = orthogonalize(g).float(), orthogonalize(padded).float()
    assert float(qp[0, 6:].abs().max()) == 0.0
    torch.testing.assert_close(qp[:, :6], q, rtol=0, atol=0.05)  # bfloat16: only the rounding differs


def test_sgd_groups_step_as_torch_nesterov_sgd_with_weight_decay() -> None:
    torch.manual_seed(0)
    ours_p, ref_p = nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(5))
    ref_p.data.copy_(ours_p.data)
    ours = MuSGD([{"params": [ours_p], "weight_decay": 0.01}], lr=0.1, momentum=0.9, nesterov=True)
    ref = torch.optim.SGD([ref_p], lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    for _ in range(3):
        g = torch.randn(5)
        ours_p.grad, ref_p.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(ours_p, ref_p, rtol=0, atol=1e-7)


def test_a_muon_group_step_by_hand() -> None:
    """Two steps of a (3, 4) weight, by hand: Muon's momentum m = 0.9 m + 0.1 g, looked ahead (0.9 m + 0.1 g),
    orthogonalised, times lr * 0.2; then weight decay on the moved weight, and Nesterov SGD at lr * 1.0."""
    torch.manual_seed(1)
    w = nn.Parameter(torch.randn(3, 4))
    opt = MuSGD([{"params": [w], "use_muon": True, "weight_decay": 0.05}], lr=0.1, momentum=0.9, nesterov=True)
    p = w.detach().clone()
    m_muon, m_sgd = torch.zeros(3, 4), torch.zeros(3, 4)
    for _ in range(2):
        g = torch.randn(3, 4)
        w.grad = g.clone()
        opt.step()
        m_muon = m_muon * 0.9 + g * 0.1
        look_ahead = m_muon * 0.9 + g * 0.1
        p = p - 0.1 * 0.2 * orthogonalize(look_ahead[None]).float()[0]  # 3 rows < 4 columns: scale 1
        g_wd = g + 0.05 * p
        m_sgd = m_sgd * 0.9 + g_wd
        p = p - 0.1 * 1.0 * (g_wd + 0.9 * m_sgd)
        torch.testing.assert_close(w.detach(), p, rtol=0, atol=1e-6)
    assert set(opt.state[w]) == {"momentum_buffer", "momentum_buffer_SGD"}


def test_tall_matrices_are_scaled_by_the_root_of_rows_over_columns() -> None:
    g = [torch.randn(32, 8), torch.randn(8, 32), torch.randn(16, 4, 3, 3)]
    out = muon_directions(g, [torch.zeros_like(t) for t in g], beta=0.0, nesterov=False)
    norms = [float(torch.linalg.matrix_norm(o.reshape(o.shape[0], -1), ord=2)) for o in out]
    assert norms[0] == pytest.approx(2.0, rel=0.3)  # sqrt(32 / 8)
    assert norms[1] == pytest.approx(1.0, rel=0.3)
    assert norms[2] == pytest.approx(1.0, rel=0.3)  # a 3x3 filter: the last two dims are square


def test_channels_last_filters_keep_their_layout_and_step_alike() -> None:
    torch.manual_seed(2)
    dense = nn.Conv2d(6, 10, 3, bias=False)
    nhwc = copy.deepcopy(dense).to(memory_format=torch.channels_last)
    opts = [
        MuSGD([{"params": [m.weight], "use_muon": True}], lr=0.1, momentum=0.9, nesterov=True) for m in (dense, nhwc)
    ]
    for _ in range(2):
        g = torch.randn(10, 6, 3, 3)
        dense.weight.grad = g.clone()
        nhwc.weight.grad = g.clone().contiguous(memory_format=torch.channels_last)
        for opt in opts:
            opt.step()
    assert nhwc.weight.is_contiguous(memory_format=torch.channels_last) and not nhwc.weight.is_contiguous()
    torch.testing.assert_close(nhwc.weight, dense.weight, rtol=0, atol=1e-3 * 0.1)  # bfloat16 rounding only


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cv2 = nn.ModuleList([nn.Conv2d(4, 4, 1)])
        self.cv3 = nn.ModuleList([nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1))])
        self.one2one_cv3 = nn.ModuleList([nn.Conv2d(4, 2, 1)])

    def class_parameters(self) -> Iterator[nn.Parameter]:  # what a detrain head answers (detrain.nn.head.Head)
        return itertools.chain(self.cv3.parameters(), self.one2one_cv3.parameters())


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.Linear(4, 4), _Head())
        self.model[0].weight.requires_grad_(False)  # frozen: left out

    @property
    def head(self) -> nn.Module:
        return self.model[-1]


def test_groups_by_role_with_the_head_class_branches_at_three_times_the_lr() -> None:
    model = _Model()
    groups = musgd_param_groups(model, lr=0.01, momentum=0.9, weight_decay=5e-4)
    names = {id(p): n for n, p in model.named_parameters()}
    got = [(g["param_group"], g["lr"], sorted(names[id(p)] for p in g["params"])) for g in groups]
    head_cls = "model.3.cv3.0."
    assert got == [
        ("weight", 0.03, []),
        ("weight", 0.01, []),
        ("bn", 0.03, [head_cls + "1.weight"]),
        ("bn", 0.01, ["model.1.weight"]),
        ("bias", 0.03, [head_cls + "0.bias", head_cls + "1.bias", head_cls + "2.bias", "model.3.one2one_cv3.0.bias"]),
        ("bias", 0.01, ["model.1.bias", "model.2.bias", "model.3.cv2.0.bias"]),
        ("muon", 0.03, [head_cls + "0.weight", head_cls + "2.weight", "model.3.one2one_cv3.0.weight"]),
        ("muon", 0.01, ["model.2.weight", "model.3.cv2.0.weight"]),
    ]
    assert [g["weight_decay"] for g in groups] == [5e-4, 5e-4, 0.0, 0.0, 0.0, 0.0, 5e-4, 5e-4]
    assert [g.get("use_muon", False) for g in groups] == [False] * 6 + [True] * 2
    assert all(g["momentum"] == 0.9 and g["nesterov"] for g in groups)
    opt = build_musgd(model, 0.01, 0.9, 5e-4)
    assert [g["initial_lr"] for g in opt.param_groups] == [g["lr"] for g in groups]


@pytest.mark.parametrize(("yaml", "branches"), [("yolov8n.yaml", {"cv3"}), ("yolo26n.yaml", {"cv3", "one2one_cv3"})])
def test_the_boosted_groups_are_the_class_branches_the_head_names(yaml: str, branches: set[str]) -> None:
    model = DetectionModel(yaml, nc=2)
    names = {id(p): n for n, p in model.named_parameters()}
    boosted = [names[id(p)] for g in musgd_param_groups(model, 0.01, 0.9, 0.0) if g["lr"] == 0.03 for p in g["params"]]
    assert {n.split(".")[2] for n in boosted} == branches and all(
        n.startswith(f"model.{len(model.model) - 1}.") for n in boosted
    )
    assert len(boosted) == sum(1 for _ in model.head.class_parameters())


def test_the_boosted_groups_follow_the_head_not_a_branch_name() -> None:
    """A head whose class branch has a name of its own (a user's head): its class_parameters() are boosted."""

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.box, self.logits = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 2, 1)

        def class_parameters(self) -> Iterator[nn.Parameter]:
            return self.logits.parameters()

    model = nn.Sequential(nn.Conv2d(3, 4, 3), Logits())
    names = {id(p): n for n, p in model.named_parameters()}
    groups = musgd_param_groups(model, lr=0.01, momentum=0.9, weight_decay=0.0, head=model[1])
    assert sorted(names[id(p)] for g in groups if g["lr"] == 0.03 for p in g["params"]) == [
        "1.logits.bias",
        "1.logits.weight",
    ]


def test_auto_picks_musgd_only_above_10000_updates() -> None:
    auto = make_cfg({"optimizer": "auto"})
    assert optim.auto_choice(auto, 80, 10_001) == ("MuSGD", 0.01, 0.9)
    assert optim.auto_choice(auto, 80, 10_000) == ("AdamW", round(0.002 * 5 / 84, 6), 0.9)
    assert optim.auto_choice(make_cfg({"optimizer": "SGD", "lr0": 0.02}), 80, 50_000) == ("SGD", 0.02, 0.937)


def test_group_warmup_end_points() -> None:
    opt = build_musgd(_Model(), lr=0.01, momentum=0.9, weight_decay=0.0)
    apply_group_warmup(opt, 0, 20, 0.5, bias_lr_start=0.1, momentum_start=0.8, momentum=0.937)
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0, 0.0, 0.0, 0.1, 0.1, 0.0, 0.0]
    assert {g["momentum"] for g in opt.param_groups} == {0.8}
    apply_group_warmup(opt, 20, 20, 0.5, bias_lr_start=0.1, momentum_start=0.8, momentum=0.937)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.015, 0.005] * 4)
    assert {g["momentum"] for g in opt.param_groups} == {0.937}


def test_a_resumed_state_continues_the_same_steps() -> None:
    torch.manual_seed(3)
    model = _Model()
    twin = copy.deepcopy(model)
    opt = build_musgd(model, 0.01, 0.9, 5e-4)
    grads = [[torch.randn_like(p) for p in model.parameters()] for _ in range(4)]

    def step(m: nn.Module, o: MuSGD, k: int) -> None:
        for p, g in zip(m.parameters(), grads[k]):
            p.grad = g.clone() if p.requires_grad else None
        o.step()

    for k in range(4):
        step(model, opt, k)
    twin_opt = build_musgd(twin, 0.01, 0.9, 5e-4)
    for k in range(2):
        step(twin, twin_opt, k)
    resumed = build_musgd(twin, 0.01, 0.9, 5e-4)
    resumed.load_state_dict(twin_opt.state_dict())
    for k in range(2, 4):
        step(twin, resumed, k)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
