"""Training callbacks: user functions the trainer calls at named events, on rank 0 only.

The event names are Ultralytics' where the meaning is the same, so a callback written for
``YOLO.add_callback`` ports by changing what it reads (a :class:`TrainEvent`, not the trainer itself):

>>> seen = []
>>> callbacks = Callbacks({"on_fit_epoch_end": [seen.append]})
>>> callbacks.fns("on_fit_epoch_end") == [seen.append]
True

Callbacks run in the process that trains rank 0: the calling process for one device, or the first spawned worker
when ``device`` names several (``"cpu,cpu"``, ``[0, 1]``). Spawned workers receive them pickled, so there each
callback must be importable by name (a function defined with ``def`` at the top level of a module, or a
``functools.partial`` of one); :func:`check_sendable` refuses a lambda or a closure with one line, before any
process starts. A callback that raises stops the run with its own exception (see :meth:`Callbacks.fire`).
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from detrain.errors import ConfigError

# In the order they fire. "epoch" in the comments is the event's TrainEvent.epoch.
EVENTS: tuple[str, ...] = (
    "on_pretrain_routine_start",  # before the data and the model are loaded; epoch: epochs already done (resume)
    "on_pretrain_routine_end",  # data, model, optimizer ready; nothing trained yet
    "on_train_start",  # just before the first epoch (after the starting weights are scored when fine-tuning)
    "on_train_epoch_start",  # each epoch, before its first batch; epoch: the epoch starting (from 1)
    "on_train_epoch_end",  # each epoch, after its batches, before validation; metrics: train losses, lr
    "on_model_save",  # each epoch, after last.pt (and best.pt, epochN.pt) are written; not with save=False
    "on_fit_epoch_end",  # each epoch, after validation and saving; metrics: the epoch's results.csv row
    "on_train_end",  # once, after the last epoch (or an early stop); metrics: what Model.train() returns
)

CallbackFn = Callable[["TrainEvent"], Any]


@dataclass(frozen=True)
class TrainEvent:
    """What every callback receives. Read it; do not change the trainer through it.

    * ``event``: the event's name (one of :data:`EVENTS`), so one function can serve several events;
    * ``epoch``: the epoch the event belongs to, counted from 1 as in results.csv and the console (so 2 is the
      second); before the first epoch the number of epochs already finished (0, or the resumed checkpoint's);
      at ``on_train_end`` the last finished epoch (below ``epochs`` after an early stop);
    * ``epochs``: the planned number of epochs;
    * ``metrics``: read-only; empty before the first epoch's end. ``on_train_epoch_end``: ``train/<name>`` for each of
      the model's loss items (``model.loss_names``: box, cls and dfl for YOLOv8/YOLO11, box, cls and l1 for YOLO26;
      means over the epoch and over every worker) and ``lr/pg0..2`` (one per parameter group: ``lr/pg0..7`` with
      MuSGD).
      ``on_model_save`` and ``on_fit_epoch_end``: the epoch's results.csv row (the above, ``metrics/mAP50``,
      ``metrics/mAP50-95``... when validated, and the speed columns). ``on_train_end``: the final
      metrics by name (``map50``, ``map``, ``fitness``...: the numbers in ``details`` of the
      :class:`~detrain.metrics.det_metrics.DetectionMetrics` ``Model.train()`` returns);
    * ``save_dir``: the run's folder; ``last``, ``best``: ``weights/last.pt`` and ``weights/best.pt`` when they
      exist at the time of the event, else None;
    * ``improved``: this epoch's fitness is the best so far, so best.pt was rewritten (``on_model_save``,
      ``on_fit_epoch_end``; False for the other events);
    * ``trainer``: rank 0's :class:`detrain.engine.train.trainer.Trainer`, for what the fields above do not carry
      (``trainer.model``, ``trainer.ema.ema``, ``trainer.cfg``); its internals may change between versions.
    """

    event: str
    epoch: int
    epochs: int
    metrics: Mapping[str, float]
    save_dir: Path
    last: Path | None
    best: Path | None
    improved: bool = False
    trainer: Any = field(default=None, repr=False, compare=False)


def check_event(event: str) -> None:
    """Refuse an event detrain does not fire (Ultralytics' batch, validator and predictor events included), so
    that a callback never waits in silence for a call that will not come."""
    if event not in EVENTS:
        raise ConfigError(f"callback event {event!r} is not one detrain fires; use one of: {', '.join(EVENTS)}")


def describe(fn: Any) -> str:
    """``module.qualname`` of a function, else its repr (a partial, a callable object)."""
    qual = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    return f"{module}.{qual}" if isinstance(qual, str) and isinstance(module, str) else repr(fn)


def unsendable_reason(fn: Any) -> str | None:
    """Why spawned workers could not receive ``fn`` (pickled by reference, imported again there), or None."""
    qual = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    if isinstance(qual, str) and "<lambda>" in qual:
        return "a lambda has no name the workers can import"
    if isinstance(qual, str) and "<locals>" in qual:
        return "a function defined inside another function (a closure) has no name the workers can import"
    if module == "__main__" and not getattr(sys.modules.get("__main__"), "__file__", None):
        return "a function of a notebook or an interactive session has no module the workers can import"
    try:
        pickle.dumps(fn)
    except Exception as e:  # noqa: BLE001 - whatever pickle says is the reason
        return f"it cannot be pickled ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
    return None


def check_sendable(callbacks: Mapping[str, list[CallbackFn]], where: str) -> None:
    """Before a run spawns workers: every callback must reach them by reference; one line naming the first that
    cannot and why (``where`` names the workers, e.g. "the 2 workers of device='cpu,cpu'")."""
    for event, fns in callbacks.items():
        for fn in fns:
            reason = unsendable_reason(fn)
            if reason:
                raise ConfigError(
                    f"callback {describe(fn)} for {event} cannot be sent to {where}: {reason}; define it with def "
                    "at the top level of an importable module (a .py file), or train on one device"
                )


class Callbacks:
    """The callbacks of one run, by event, fired by the trainer on rank 0 (other ranks do nothing)."""

    def __init__(self, callbacks: Mapping[str, list[CallbackFn]] | None = None) -> None:
        self._fns: dict[str, list[CallbackFn]] = {e: list(fns) for e, fns in (callbacks or {}).items() if fns}
        for event in self._fns:
            check_event(event)
        self.finished = 0  # epochs finished (and saved, unless save=False) so far; for the note on a failure

    def fns(self, event: str) -> list[CallbackFn]:
        return list(self._fns.get(event, ()))

    def registered(self) -> bool:
        """Whether the run has any callback: then each epoch's checkpoints are written whole before the callbacks
        after the save run (the trainer waits for its writer, :mod:`detrain.engine.train.state.writer`)."""
        return bool(self._fns)

    def fire(
        self,
        event: str,
        trainer: Any,
        epoch: int | None = None,
        metrics: Mapping[str, Any] | None = None,
        improved: bool = False,
    ) -> None:
        """Call ``event``'s callbacks in the order they were added, on rank 0 only (``trainer.main``).

        ``epoch`` None means the last finished epoch. A callback that raises stops the run with its own exception
        (as Ultralytics does), with a note naming the callback and the checkpoint to resume from: the trainer fires
        ``on_model_save`` and ``on_fit_epoch_end`` only after that epoch's last.pt is written whole, so no
        finished epoch is lost. With several workers the launcher then stops the others and reports rank 0's
        error in one line."""
        check_event(event)
        if event in ("on_pretrain_routine_start", "on_model_save", "on_fit_epoch_end") and epoch is not None:
            self.finished = epoch
        fns = self._fns.get(event)
        if not fns or not getattr(trainer, "main", False):
            return
        wdir = Path(trainer.wdir)
        last, best = wdir / "last.pt", wdir / "best.pt"
        info = TrainEvent(
            event=event,
            epoch=self.finished if epoch is None else epoch,
            epochs=trainer.cfg.train.epochs,
            metrics=MappingProxyType(dict(metrics or {})),
            save_dir=Path(trainer.save_dir),
            last=last if last.is_file() else None,
            best=best if best.is_file() else None,
            improved=improved,
            trainer=trainer,
        )
        for fn in fns:
            try:
                fn(info)
            except Exception as e:
                saved = (
                    f"; {last} holds epoch {self.finished}: train resume={last} continues from there"
                    if info.last is not None and 0 < self.finished < info.epochs
                    else ""
                )
                if hasattr(e, "add_note"):  # Python >= 3.11
                    e.add_note(
                        f"detrain: raised by the {event} callback {describe(fn)} at epoch {info.epoch}; "
                        f"the run stopped{saved}"
                    )
                raise
