"""Counting a training step's host syncs on a CPU, as they would be on a GPU
(tests/integration/test_host_syncs_in_training.py, tests/unit/test_host_syncs.py, scripts/count_syncs.py).

On CUDA the host waits for the device wherever it needs a device number (``.item()``, ``.tolist()``, ``int(t)``,
``bool(t)``), a shape that depends on device values (``nonzero``, a boolean mask as an index, ``masked_select``,
``unique``, ``bincount``, ``repeat_interleave`` without its size), and at every blocking copy between host and
device (``.to(device)`` without ``non_blocking``, ``.cpu()``, ``.numpy()``, a tensor made from Python numbers for
the device: ``torch.tensor``, ``new_tensor``). On a CPU run none of them waits, and the copies do not even happen,
so :class:`SyncCounter` tells the two memories apart itself: it follows, op by op (a ``TorchDispatchMode``), which
tensors a GPU run would hold in host memory, and counts the would-be syncs of the others.

* Host: the tensors given to :meth:`SyncCounter.mark_host` (the loader's batch, the optimizer's ``step`` counters,
  which torch keeps on the CPU) and views set over their memory, and whatever an op makes from host tensors without
  a device tensor.
* Device: every tensor the counter never saw made (the model's parameters and buffers, what existed before it was
  entered) and whatever an op makes from at least one device tensor.
* In between: a factory's fresh tensor (``torch.zeros``, ``arange``) and a tensor made from Python numbers take the
  side of the first tensors they meet; the second, once it meets a device tensor, counts as a copy to the device.
  ``.to(...)`` towards a device (a device, or a device tensor to follow) of a tensor that is not a device tensor is
  a copy to the device (on a CPU run a clone, the same values), a sync unless ``non_blocking=True``.
* Counted (while :attr:`SyncCounter.on`): each would-be sync of a tensor that is not host memory, with the op and
  the innermost ``detrain`` frame that made it (:attr:`SyncCounter.syncs`).

Enter it before the counted step (the run's first batch): the tensors the step reuses (a loss's cached constants)
then carry the side they took when they were made. What it cannot see on a CPU: ``.to("cpu")`` of a device tensor
(the same call as a move to the CPU "device"; ``.cpu()`` and the reads are counted) and ``.to(device)`` of a host
tensor towards the CPU (counted as a copy), and copies made inside C++ kernels.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

# ops whose output shape or value the host must read from the device on CUDA
SHAPE_OPS = {
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.bincount.default: "bincount",
    aten.repeat_interleave.Tensor: "repeat_interleave",
    aten._local_scalar_dense.default: "item",
    aten.is_nonzero.default: "bool(tensor)",
    aten.equal.default: "torch.equal",
}
INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
HOST, DEVICE, FRESH, LIFTED = "host", "device", "fresh", "from Python numbers"
LIFT_KIND = "tensor from Python numbers"


@dataclass(frozen=True)
class Sync:
    """One would-be host sync: what it is and where (``file:line function`` of the innermost detrain frame)."""

    kind: str
    where: str


def _where() -> str:
    """The innermost frame in detrain's package (or, failing that, outside torch and this file)."""
    frames = traceback.extract_stack()[:-2]
    for want in ("/detrain/", ""):
        for frame in reversed(frames):
            name = frame.filename
            if want in name and "/torch/" not in name and not name.endswith("/_host_syncs.py"):
                short = name[name.rfind("/detrain/") + 1 :] if "/detrain/" in name else name.rsplit("/", 1)[-1]
                return f"{short}:{frame.lineno} {frame.name}"
    return "?"


class SyncCounter(TorchDispatchMode):
    """Follows tensors' sides while entered and counts would-be host syncs while :attr:`on` (see the module);
    :meth:`watching` enters it with the Python-level reads and copies watched too."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[Sync] = []
        self.on = False
        self.trainer: Any = None  # count_step_syncs's, once it has trained
        self._side: dict[int, tuple[weakref.ref, str]] = {}
        self._host_storages: set[int] = set()

    # ------------------------------------------------------------------ which memory a tensor lives in
    def side(self, t: torch.Tensor) -> str:
        entry = self._side.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        return DEVICE

    def _set(self, t: torch.Tensor, side: str) -> None:
        self._side[id(t)] = (weakref.ref(t), side)

    def mark_host(self, tensors: Iterable[Any]) -> None:
        """These tensors (and any tensor inside lists, tuples and dicts of them) are host memory on a GPU run, and so
        is any tensor later set over their storage (``set_``: the loader's shared-memory blocks)."""
        for t in tree_flatten(list(tensors))[0]:
            if isinstance(t, torch.Tensor):
                self._set(t, HOST)
                self._host_storages.add(t.untyped_storage().data_ptr())

    def count(self, kind: str) -> None:
        if self.on:
            self.syncs.append(Sync(kind, _where()))

    # ------------------------------------------------------------------ every op
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        sides = [self.side(t) for t in inputs]
        side = DEVICE if DEVICE in sides else HOST if HOST in sides else LIFTED if LIFTED in sides else FRESH
        if any(isinstance(a, torch.UntypedStorage) and a.data_ptr() in self._host_storages for a in args):
            side = HOST  # a view set over a host tensor's memory
        if side == DEVICE and LIFTED in sides:  # numbers from the host meet the device: they were copied there
            self.count(LIFT_KIND)
        if side in (HOST, DEVICE):  # fresh tensors take the side of what they meet
            for t, s in zip(inputs, sides):
                if s in (FRESH, LIFTED):
                    self._set(t, side)
        if side != HOST:
            kind = SHAPE_OPS.get(func)
            if kind is None and func in INDEX_OPS:
                indices = args[1] if len(args) > 1 else []
                if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or []):
                    kind = "boolean mask index"
            if kind is not None:
                self.count(kind)
        out = func(*args, **kwargs)
        made = LIFTED if func is aten.lift_fresh.default else side
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._set(t, made)
        return out

    # ------------------------------------------------------------------ what never reaches the dispatcher
    @contextlib.contextmanager
    def watching(self) -> Iterator[SyncCounter]:
        """This mode entered, with ``Tensor.tolist``, ``.numpy``, ``.cpu`` and ``.to`` watched (they reach no
        dispatcher on a CPU run)."""
        originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu", "to")}
        counter = self

        def reader(name: str) -> Any:
            def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if counter.side(self) != HOST:
                    counter.count(f".{name}()")
                return originals[name](self, *args, **kwargs)

            return read

        def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = originals["to"](self, *args, **kwargs)
            if counter.side(self) == DEVICE or not _names_a_device(counter, args, kwargs):
                return out
            if not kwargs.get("non_blocking", False) and not any(a is True for a in args[1:]):
                counter.count("blocking copy to the device")
            if out is self:
                out = self.clone()
            counter._set(out, DEVICE)
            return out

        patched = {"tolist": reader("tolist"), "numpy": reader("numpy"), "cpu": reader("cpu"), "to": to}
        for name, fn in patched.items():
            setattr(torch.Tensor, name, fn)
        try:
            with self:
                yield self
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)

    def table(self) -> list[tuple[int, str, str]]:
        """(count, kind, where) of every distinct sync, most frequent first."""
        seen = Counter((s.kind, s.where) for s in self.syncs)
        return [(n, kind, where) for (kind, where), n in seen.most_common()]


def _names_a_device(counter: SyncCounter, args: tuple, kwargs: dict) -> bool:
    """Whether a ``.to(...)`` call names a device (a device, its name, an index) or a device tensor to follow."""
    for a in (*args, kwargs.get("device"), kwargs.get("other")):
        if isinstance(a, torch.Tensor):
            return counter.side(a) == DEVICE
        if isinstance(a, (torch.device, str, int)) and not isinstance(a, bool):
            return True
    return False


def optimizer_host_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's ``step`` counters that torch keeps in host memory (neither ``capturable`` nor ``fused``)."""
    found: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        if group.get("capturable") or group.get("fused"):
            continue
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor):
                found.append(step)
    return found


def report(counter: SyncCounter, out: Any = sys.stdout) -> None:
    """The counter's table, one line per (kind, place)."""
    print(f"{len(counter.syncs)} host syncs", file=out)
    for n, kind, where in counter.table():
        print(f"  {n:4d}  {kind:30s} {where}", file=out)


# a tiny run whose every batch is an update (nbs = batch), past warmup's first batches by the counted one; mid.pt
# on (never due: its flag rides the step's all-reduce) and preemption on (grace's default), so both are counted
STEP_ARGS: dict[str, Any] = dict(
    model="n.yaml",
    device="cpu",
    imgsz=64,
    batch=4,
    nbs=4,
    workers=0,
    epochs=1,
    val=False,
    plots=False,
    verbose=False,
    seed=0,
    save_interval=1000.0,
    name="run",
)


class _Stop(Exception):
    """Raised once the counted step is over: the rest of the run is not needed."""


def count_step_syncs(args: dict[str, Any], at: int = 4, patch: Any = None) -> SyncCounter:
    """Train in this process (rank 0 of 1) with ``args`` (``make_cfg``'s keys) through batch ``at`` of the first
    epoch, counting the would-be host syncs of that batch's whole step with :class:`SyncCounter`: the trainer's own
    code from the batch in hand (the loader's part is not the step's) to the end of its bookkeeping (forward, loss,
    backward, the update and the EMA, the step's flags, the progress bar, ``Checkpointer.after_batch``). The counter
    is entered at the first batch, each batch and the optimizer's ``step`` counters marked host memory. ``at`` should
    be past the first update, so that the optimizer's state exists (steady state). ``patch(trainer)``, when given,
    may change the trainer before it trains (a test's deliberate extra sync)."""
    from detrain.config.cfg import make_cfg
    from detrain.distributed.world import World
    from detrain.engine.train.trainer import Trainer

    counter = SyncCounter()
    trainer = counter.trainer = Trainer(make_cfg(args), World())
    if patch is not None:
        patch(trainer)
    train_batch = trainer._train_batch
    entered = contextlib.ExitStack()

    def counted_batch(epoch: int, i: int, batch: dict[str, Any], *rest: Any) -> Any:
        if not entered._exit_callbacks:  # type: ignore[attr-defined]
            entered.enter_context(counter.watching())
        counter.mark_host([v for v in batch.values() if isinstance(v, torch.Tensor)])
        counter.mark_host(optimizer_host_tensors(trainer.optimizer))
        if i == at:
            counter.on = True
            after = trainer.state.after_batch

            def after_batch(*a: Any, **k: Any) -> None:
                after(*a, **k)
                counter.on = False
                entered.close()
                raise _Stop

            trainer.state.after_batch = after_batch  # type: ignore[method-assign]
        return train_batch(epoch, i, batch, *rest)

    trainer._train_batch = counted_batch  # type: ignore[method-assign]
    try:
        trainer.train()
    except _Stop:
        pass
    finally:
        entered.close()
    return counter
