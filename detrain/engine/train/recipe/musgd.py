"""MuSGD: SGD with, for every matrix and convolution filter, a Muon step added (the update orthogonalised), as
Ultralytics 8.4 trains long runs with (``optimizer=auto`` above 10,000 planned updates: the choice is
:func:`detrain.engine.train.recipe.optim.auto_choice`'s, which builds it with :func:`build_musgd`).

Muon replaces a weight matrix's momentum by the nearest semi-orthogonal matrix (all singular values about 1,
found by five quintic Newton-Schulz iterations in bfloat16): every direction the gradient spans moves at the
same rate, so rare directions are not drowned by the dominant ones. MuSGD adds ``muon * lr`` of that step to
plain Nesterov SGD at ``sgd * lr`` (0.2 and 1.0 as Ultralytics' trainer builds it); weight decay acts on the SGD
part only. 1-D parameters (biases, norm weights) take the SGD step alone. A convolution filter (out, in, kh, kw) is
read as the (out, in * kh * kw) matrix, in its own memory order (channels_last included).

Matrices with the same column count are orthogonalised in one batched call, their rows zero-padded to the
largest (zeros stay zeros through the iteration); a batch never spans more than 16x in rows, which bounds the
padding. In bfloat16 that batching changes the rounding, so it follows Ultralytics' rule exactly: the parameters
then equal Ultralytics' after the same steps (``tests/unit/test_parity_e2e.py``).

Groups (:func:`musgd_param_groups`): Muon for every 2-D and 4-D parameter, with weight decay; SGD for biases and
normalisation weights without it and for any other weight with it; the head's class branches (the parameters its
``class_parameters()`` gives: YOLO's ``cv3``, and YOLO26's ``one2one_cv3``) in groups of their own at 3x the
learning rate. Each group carries ``param_group`` (weight,
bn, bias, muon), so warmup (:func:`apply_group_warmup`) finds the biases by name rather than by position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)  # quintic coefficients: the steepest rise of small singular values to ~1
NEWTON_SCHULZ_STEPS = 5
MUON_GAIN, SGD_GAIN = 0.2, 1.0  # the two steps' shares of lr, as Ultralytics' trainer builds MuSGD
HEAD_CLS_LR_GAIN = 3.0  # the head's class branches learn 3x faster (a new task's classes adapt quickly)
MAX_ROW_SPAN = 16  # rows in one batched orthogonalisation span at most this factor


def orthogonalize(matrices: Tensor, eps: float = 1e-7) -> Tensor:
    """(K, R, C) -> (K, R, C) bfloat16: each matrix's approximate U V^T (its singular values pushed to about 1,
    within roughly 0.7..1.2) by quintic Newton-Schulz iterations. All-zero rows stay zero.

    >>> q = orthogonalize(torch.randn(1, 8, 32)).float()[0]
    >>> s = torch.linalg.svdvals(q); bool((s > 0.5).all() and (s < 1.5).all())
    True
    """
    x = matrices.bfloat16()
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)  # the top singular value at most 1: the iteration converges
    tall = matrices.size(-2) > matrices.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.transpose(-2, -1)
    a, b, c = NEWTON_SCHULZ
    for _ in range(NEWTON_SCHULZ_STEPS):
        gram = x @ x.transpose(-2, -1)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b * G + c * G @ G
        x = torch.baddbmm(x, poly, x, beta=a)  # a * X + (b * G + c * G @ G) @ X
    return x.transpose(-2, -1) if tall else x


def _as_matrix(update: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """``update`` as an (out, rest) matrix read in its own memory order, and the map of a result of that shape
    back to ``update``'s shape and layout. A channels_last filter reads as (out, kh * kw * in): a permutation of
    the columns, which permutes the orthogonalised columns alike; any other strided layout is copied row-major."""
    shape = update.shape
    if update.is_contiguous():
        return update.reshape(shape[0], -1), lambda m: m.reshape(shape)
    if update.dim() == 4 and update.is_contiguous(memory_format=torch.channels_last):
        o, i, kh, kw = shape
        return update.permute(0, 2, 3, 1).reshape(o, -1), lambda m: m.reshape(o, kh, kw, i).permute(0, 3, 1, 2)
    return update.reshape(shape[0], -1).contiguous(), lambda m: m.reshape(shape)


def muon_directions(grads: list[Tensor], buffers: list[Tensor], beta: float, nesterov: bool = True) -> list[Tensor]:
    """The Muon step of each 2-D+ parameter: its momentum (``buffers`` updated in place to ``beta * m + (1 - beta)
    * g``; with ``nesterov`` one more such step looked ahead) orthogonalised, times sqrt(max(1, rows / cols)) of
    the tensor's last two dims (as Ultralytics: 1 for a square-kernel filter).

    >>> g = [torch.randn(4, 8), torch.randn(6, 2, 3, 3)]
    >>> [tuple(d.shape) for d in muon_directions(g, [torch.zeros_like(t) for t in g], beta=0.9)]
    [(4, 8), (6, 2, 3, 3)]
    """
    torch._foreach_mul_(buffers, beta)
    torch._foreach_add_(buffers, grads, alpha=1 - beta)
    if nesterov:
        updates = list(torch._foreach_mul(buffers, beta))
        torch._foreach_add_(updates, grads, alpha=1 - beta)
    else:
        updates = list(buffers)
    # one batched call per (columns, scale, device, dtype), split where the rows would span more than 16x
    keyed: dict[tuple, list[tuple[int, Tensor, Callable[[Tensor], Tensor]]]] = {}
    for i, u in enumerate(updates):
        matrix, restore = _as_matrix(u)
        scale = max(1, grads[i].size(-2) / grads[i].size(-1)) ** 0.5
        keyed.setdefault((matrix.size(1), scale, matrix.device, matrix.dtype), []).append((i, matrix, restore))
    out: list[Tensor] = list(updates)
    for (cols, scale, device, dtype), items in keyed.items():
        items.sort(key=lambda item: -item[1].size(0))  # stable: equal row counts keep the parameters' order
        batches: list[list[tuple[int, Tensor, Callable[[Tensor], Tensor]]]] = []
        for item in items:
            if batches and batches[-1][0][1].size(0) <= MAX_ROW_SPAN * item[1].size(0):
                batches[-1].append(item)
            else:
                batches.append([item])
        for batch in batches:
            padded = torch.zeros(len(batch), batch[0][1].size(0), cols, device=device, dtype=dtype)
            for j, (_, matrix, _) in enumerate(batch):
                padded[j, : matrix.size(0)] = matrix
            ortho = orthogonalize(padded).contiguous().to(grads[batch[0][0]].dtype).mul_(scale)
            for j, (i, matrix, restore) in enumerate(batch):
                out[i] = restore(ortho[j, : matrix.size(0)])
    return out


class MuSGD(torch.optim.Optimizer):
    """Nesterov SGD plus, in groups with ``use_muon``, a Muon step: ``p -= lr * (muon * orth(m_muon) + sgd *
    sgd_step)``, the two momenta kept apart; other groups take ``p -= lr * sgd_step`` only.

    State per parameter: ``momentum_buffer`` (Muon's in a Muon group, else SGD's) and ``momentum_buffer_SGD``
    (SGD's in a Muon group): Ultralytics' names, so an optimizer state saved by either loads in the other.

    >>> w = nn.Parameter(torch.ones(2, 2)); w.grad = torch.eye(2)
    >>> opt = MuSGD([{"params": [w], "use_muon": True}], lr=0.1, momentum=0.0, muon=1.0, sgd=0.0)
    >>> opt.step(); [[round(v, 1) for v in row] for row in w.tolist()]  # orth(I) is about I: a step of about 0.1
    [[0.9, 1.0], [1.0, 0.9]]
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        use_muon: bool = False,
        muon: float = MUON_GAIN,
        sgd: float = SGD_GAIN,
    ) -> None:
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "nesterov": nesterov}
        super().__init__(params, {**defaults, "use_muon": use_muon})
        self.muon = muon
        self.sgd = sgd

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr, momentum, nesterov = group["lr"], group["momentum"], group["nesterov"]
            use_muon = group["use_muon"]
            for p in params:
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                    if use_muon:
                        state["momentum_buffer_SGD"] = torch.zeros_like(p)
            grads = [p.grad for p in params if p.grad is not None]  # all of them: the filter above, for mypy
            if use_muon:
                muon_buffers = [self.state[p]["momentum_buffer"] for p in params]
                directions = muon_directions(grads, muon_buffers, momentum, nesterov)
                torch._foreach_add_(params, directions, alpha=-(lr * self.muon))
                sgd_buffers = [self.state[p]["momentum_buffer_SGD"] for p in params]
                lr *= self.sgd
            else:
                sgd_buffers = [self.state[p]["momentum_buffer"] for p in params]
            if group["weight_decay"] != 0:  # read after the Muon step moved the parameters (as Ultralytics)
                grads = list(torch._foreach_add(grads, params, alpha=group["weight_decay"]))
            torch._foreach_mul_(sgd_buffers, momentum)
            torch._foreach_add_(sgd_buffers, grads)
            steps = torch._foreach_add(grads, sgd_buffers, alpha=momentum) if nesterov else sgd_buffers
            torch._foreach_add_(params, steps, alpha=-lr)
        return loss


def musgd_param_groups(
    model: nn.Module, lr: float, momentum: float, weight_decay: float, head: nn.Module | None = None
) -> list[dict[str, Any]]:
    """MuSGD's parameter groups for ``model``, in Ultralytics' order: (weight, bn, bias, muon), each split into
    the head's class branches (lr x3) then the rest; every group Nesterov at ``momentum``. ``head`` defaults to
    ``model.head`` (detrain's models), else ``model.model[-1]``. Parameters that do not train are left out.

    >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    >>> groups = musgd_param_groups(model, lr=0.01, momentum=0.9, weight_decay=5e-4)
    >>> [(g["param_group"], len(g["params"]), g["lr"]) for g in groups if g["params"]]
    [('bn', 1, 0.01), ('bias', 2, 0.01), ('muon', 1, 0.01)]
    """
    if head is None:
        head = getattr(model, "head", None)
    layers = getattr(model, "model", None)
    if head is None and isinstance(layers, nn.Sequential):
        head = layers[-1]
    class_parameters = getattr(head, "class_parameters", None)  # a detrain head's (detrain.nn.head.Head)
    boosted = {id(p) for p in class_parameters()} if callable(class_parameters) else set()
    norm_types = tuple(v for k, v in nn.__dict__.items() if "Norm" in k and isinstance(v, type))
    roles: dict[str, list[nn.Parameter]] = {"weight": [], "bn": [], "bias": [], "muon": []}
    for module_name, module in model.named_modules():
        for param_name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            full = f"{module_name}.{param_name}" if module_name else param_name
            if p.ndim in (2, 4):
                roles["muon"].append(p)
            elif "bias" in full:
                roles["bias"].append(p)
            elif isinstance(module, norm_types) or "logit_scale" in full:
                roles["bn"].append(p)
            else:
                roles["weight"].append(p)
    base = {"momentum": momentum, "nesterov": True}
    settings = {
        "weight": {"weight_decay": weight_decay},
        "bn": {"weight_decay": 0.0},
        "bias": {"weight_decay": 0.0},
        "muon": {"weight_decay": weight_decay, "use_muon": True},
    }
    groups = []
    for role, params in roles.items():
        for head_cls in (True, False):
            chosen = [p for p in params if (id(p) in boosted) == head_cls]
            group_lr = lr * HEAD_CLS_LR_GAIN if head_cls else lr
            groups.append({"params": chosen, "lr": group_lr, **base, **settings[role], "param_group": role})
    return groups


def build_musgd(
    model: nn.Module, lr: float, momentum: float, weight_decay: float, head: nn.Module | None = None
) -> MuSGD:
    """MuSGD over :func:`musgd_param_groups`, Muon and SGD steps at 0.2 and 1.0 of each group's lr; every group's
    ``initial_lr`` is its own lr (3x for the head's class branches), what the lr schedule and warmup scale.

    >>> opt = build_musgd(nn.Sequential(nn.Linear(4, 4)), lr=0.01, momentum=0.9, weight_decay=0.0)
    >>> [(g["param_group"], g["initial_lr"]) for g in opt.param_groups if g["params"]]
    [('bias', 0.01), ('muon', 0.01)]
    """
    optimizer = MuSGD(musgd_param_groups(model, lr, momentum, weight_decay, head), lr=lr, momentum=momentum)
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    return optimizer


def apply_group_warmup(
    optimizer: torch.optim.Optimizer,
    ni: int,
    n_warmup: int,
    epoch_factor: float,
    bias_lr_start: float,
    momentum_start: float,
    momentum: float,
) -> None:
    """Warmup for groups tagged with ``param_group`` (MuSGD's): at iteration ``ni`` of ``n_warmup`` each group's lr
    rises from 0 (``bias`` groups: falls from ``bias_lr_start``) to its own ``initial_lr * epoch_factor``, and
    momentum from ``momentum_start`` to ``momentum``. Ultralytics' rule. :func:`detrain.engine.train.recipe.optim.
    apply_warmup` hands MuSGD here: its own way (the bias group by position, every group to one lr0) fits its
    three groups but not MuSGD's eight.

    >>> opt = build_musgd(nn.Sequential(nn.Linear(4, 4)), lr=0.01, momentum=0.9, weight_decay=0.0)
    >>> apply_group_warmup(opt, 5, 10, 1.0, bias_lr_start=0.1, momentum_start=0.8, momentum=0.9)
    >>> [(g["param_group"], round(g["lr"], 4), round(g["momentum"], 2)) for g in opt.param_groups if g["params"]]
    [('bias', 0.055, 0.85), ('muon', 0.005, 0.85)]
    """
    xi = [0, n_warmup]
    for group in optimizer.param_groups:
        start = bias_lr_start if group.get("param_group") == "bias" else 0.0
        group["lr"] = float(np.interp(ni, xi, [start, group["initial_lr"] * epoch_factor]))
        if "momentum" in group:
            group["momentum"] = float(np.interp(ni, xi, [momentum_start, momentum]))
