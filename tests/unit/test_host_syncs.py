"""Host syncs, piece by piece: the EMA's update makes none and gives the per-tensor formula's bits; the flags that ride
the step's all-reduce (non-finite, preemption, mid.pt) are made on the device and read from the step's one host
read; the counter (tests/_host_syncs.py) sees what a GPU would wait for. A whole step is counted in
tests/integration/test_host_syncs_in_training.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from _host_syncs import SyncCounter
from torch import nn

from detrain.distributed.world import World
from detrain.engine.train.ema import ModelEMA
from detrain.engine.train.nonfinite import FLAGS, NonFinite
from detrain.engine.train.state.mid_epoch import MidEpoch
from detrain.engine.train.state.preemption import Preemption


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.SiLU(), nn.Conv2d(4, 2, 1).to(torch.float64), nn.Flatten()
    )


def _per_tensor(ema: nn.Module, model: nn.Module, d: float, fixed: frozenset[str]) -> None:
    """The EMA's formula as it was written, one tensor at a time."""
    model_state = model.state_dict()
    with torch.no_grad():
        for name, value in ema.state_dict().items():
            if value.dtype.is_floating_point and name not in fixed:
                value.mul_(d).add_(model_state[name].detach(), alpha=1 - d)


def _train_a_little(net: nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    net.train()
    with torch.no_grad():
        net[0](torch.rand(2, 3, 6, 6))
        net[1](torch.rand(2, 4, 4, 4))  # BatchNorm's running statistics move
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)


def test_the_ema_update_is_the_per_tensor_formula_bit_for_bit_in_two_foreach_calls_per_dtype() -> None:
    net = _net()
    fixed = frozenset({"0.bias"})  # a frozen tensor: never averaged
    ema = ModelEMA(net, decay=0.9, tau=3.0, fixed=fixed)
    reference = copy.deepcopy(ema.ema)
    frozen = ema.ema[0].bias.clone()
    for step in range(6):
        _train_a_little(net, step)
        ema.update(net)
        _per_tensor(reference, net, ema.current_decay(), fixed)
        for (name, a), b in zip(ema.ema.state_dict().items(), reference.state_dict().values()):
            assert a.dtype == b.dtype and torch.equal(a, b), name
            assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), name  # -0.0 too
    assert torch.equal(ema.ema[0].bias, frozen)  # the fixed tensor is untouched
    assert int(ema.ema[1].num_batches_tracked) == 0  # integer buffers keep what they were copied with
    assert {e[0].dtype for e, _ in ema._pairs(net)} == {torch.float32, torch.float64}  # one group per dtype


def test_the_ema_update_makes_no_host_sync_and_builds_no_state_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    net = _net()
    ema = ModelEMA(net)
    ema.update(net)  # the first update finds the tensors
    built = []
    real = nn.Module.state_dict
    monkeypatch.setattr(nn.Module, "state_dict", lambda self, *a, **k: built.append(self) or real(self, *a, **k))
    counter = SyncCounter()
    counter.on = True
    with counter.watching():
        for _ in range(3):
            ema.update(net)
    assert counter.syncs == [] and built == []
    foreach = 0

    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            nonlocal foreach
            foreach += "_foreach_" in str(func)
            return func(*args, **(kwargs or {}))

    with Ops():
        ema.update(net)
    assert foreach == 4  # mul and add, for each of the two dtypes


def test_the_counter_sees_what_a_gpu_would_wait_for_and_not_host_work() -> None:
    counter = SyncCounter()
    weights = torch.arange(6.0)  # made before the counter: a device tensor, as a model's parameters
    labels = torch.tensor([0.0, 1.0, 1.0])
    counter.mark_host([labels])
    counter.on = True
    with counter.watching():
        int(labels.max())  # host numbers: no sync
        labels.nonzero()
        labels.to("cpu", non_blocking=True)  # a copy to the device that does not wait
        float(weights.sum())  # item
        weights.tolist()
        weights.nonzero()
        weights[weights > 2]  # boolean mask index
        labels.to(weights.device)  # a blocking copy to the device
        weights + weights.new_tensor([1.0])  # Python numbers copied to the device
        bool(weights[0] > 1)
    kinds = [s.kind for s in counter.syncs]
    assert kinds == [
        "item",
        ".tolist()",
        "nonzero",
        "boolean mask index",
        "blocking copy to the device",
        "tensor from Python numbers",
        "item",
    ], kinds
    assert all("test_host_syncs.py" in s.where for s in counter.syncs)


def test_the_step_flags_are_made_on_the_device_once_and_read_from_the_host_numbers(tmp_path: Path) -> None:
    items = torch.tensor([1.0, 2.0, 3.0])  # the step's loss items, on the device
    nonfinite, preempt = NonFinite(limit=0), Preemption(grace_s=25.0)
    mid = MidEpoch(1e-9, True, tmp_path, torch.device("cpu"), World())
    mid.attach(preempt.attach(nonfinite.attach(items)), 0, 4)  # the first step makes the flags
    preempt.signal = "SIGUSR1"
    preempt.attach(items)
    counter = SyncCounter()
    counter.on = True
    with counter.watching():
        nonfinite.note_loss(items.sum() * float("nan"))
        sent = mid.attach(preempt.attach(nonfinite.attach(items)), 0, 4)
    assert counter.syncs == []  # nothing copied from the host, nothing read
    assert sent.tolist() == [1.0, 2.0, 3.0, 1.0, 0.0, 0.0, 1.0, 1.0]  # items, non-finite loss and grads, SIGUSR1, due
    rest = nonfinite.read(preempt.read(mid.read(sent.tolist(), 0, 4)), world_size=1)
    assert rest == [1.0, 2.0, 3.0] and len(sent) == 3 + FLAGS + 2 + 1
    assert preempt.agreed and mid.due(0, 4) and not mid.due(0, 4)  # due once, for the step that carried it
    assert nonfinite.skip(0, 0, 4)  # decided from the numbers read: no read of its own
    assert mid.attach(items, 3, 4) is items and mid.read([1.0], 3, 4) == [1.0]  # the epoch's last batch: nothing
