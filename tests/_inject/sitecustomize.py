"""Test-only fault injection at an exact point of a training run, from outside detrain.

Tests put this folder first on a child's PYTHONPATH (``tests/_faults.py``: ``fault_env``), so that Python imports
this module at the start of that child and of every process it spawns (launcher, elastic workers, torchrun
ranks). It does nothing unless ``TEST_FAULT`` holds a rule, a JSON object:

* ``after``: ``"last.pt"`` or ``"mid.pt"``, the checkpoint whose atomic write is the point (the rule acts in rank
  0's process only, the one that writes checkpoints; other nodes' copies of them are not the point), or
  ``"results.csv"``, whose rewrite at an epoch's end is the point in the training loop's own thread (checkpoints
  are written by rank 0's writer thread while the loop goes on: holding the writer does not hold the loop);
* ``epoch``: the written checkpoint's ``epoch`` field (the last finished epoch, 0-based: a last.pt with epoch 0
  is written at the end of the first epoch, a mid.pt with epoch 0 within the second); for results.csv the last
  row's epoch, 0-based (0: the first epoch's row, written just before that epoch's last.pt is handed to the writer);
* ``next_batch`` (mid.pt only): act at the first mid.pt of that epoch whose ``mid_epoch.next_batch`` is at least
  this;
* ``then``: ``"kill"`` (SIGKILL this process once the file is in place), ``"hold"`` (write ``<until>.held``
  holding this pid, then wait until the file ``until`` exists, or at most 300 s, and go on) or ``"raise"`` (the
  rename fails with ``OSError(EIO, "injected failure")``, the file is not written);
* ``every_attempt``: true to act on every attempt of the launcher (a failure that repeats).

The rule acts on the launcher's first attempt only (``TORCHELASTIC_RESTART_COUNT`` absent or 0) unless
``every_attempt``, so a restarted group runs on. It watches the run through Python's audit hooks (the
``os.rename`` event that ``os.replace`` raises, :pep:`578`), so nothing in detrain knows about it: the
checkpoint's temporary file is read with
``torch.load(weights_only=True)`` to learn its epoch and position, before the rename. To act *after* the file is
in place, "kill" does the rename itself and dies; "hold" puts a copy in place atomically and lets the original
rename replace it with the same bytes after the hold.
"""

from __future__ import annotations

import json
import os

# rank 0 alone: the other nodes' first processes write copies of its checkpoints (engine/train/state/replicas.py), which
# are not the point a rule names
_RULE = (
    json.loads(os.environ["TEST_FAULT"])
    if os.environ.get("TEST_FAULT") and os.environ.get("RANK", "0") == "0"
    else None
)
_busy = False  # the hook's own file operations raise audit events too


def _first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")


def _matches(src: str) -> bool:
    if _RULE["after"] == "results.csv":
        with open(src) as f:
            rows = [line for line in f.read().splitlines() if line.strip()]
        return len(rows) - 2 == _RULE["epoch"]  # a header, then one row per finished epoch
    import torch

    ckpt = torch.load(src, map_location="cpu", weights_only=True)
    if ckpt.get("epoch") != _RULE["epoch"]:
        return False
    if _RULE["after"] == "mid.pt":
        return int(ckpt["mid_epoch"]["next_batch"]) >= int(_RULE["next_batch"])
    return True


def _hold(until: str, src: str, dst: str) -> None:
    import shutil

    copy = f"{dst}.fault-copy"
    shutil.copyfile(src, copy)
    os.replace(copy, dst)
    with open(f"{until}.held.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(f"{until}.held.tmp", f"{until}.held")
    import time

    deadline = time.monotonic() + 300
    while not os.path.exists(until) and time.monotonic() < deadline:
        time.sleep(0.05)


def _in_folder(name: object, dir_fd: object) -> str:
    """A rename's path as a full one: relative to its folder descriptor when the rename gave one (detrain's atomic
    writes rename inside a folder opened once, so a planted link cannot redirect them)."""
    if isinstance(dir_fd, int) and dir_fd >= 0:
        return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), os.fsdecode(name))  # type: ignore[arg-type]
    return os.fsdecode(name)  # type: ignore[arg-type]


def _audit(event: str, args: tuple) -> None:
    global _RULE, _busy
    if event != "os.rename" or _RULE is None or _busy:
        return
    src, dst = _in_folder(args[0], args[2]), _in_folder(args[1], args[3])
    folder = os.path.basename(os.path.dirname(dst))
    if os.path.basename(dst) != _RULE["after"] or (folder != "weights" and _RULE["after"] != "results.csv"):
        return
    _busy = True
    try:
        if not (_RULE.get("every_attempt") or _first_attempt()) or not _matches(src):
            return
        rule, _RULE = _RULE, None  # once per process
        if rule["then"] == "raise":
            import errno

            raise OSError(errno.EIO, "injected failure")
        if rule["then"] == "kill":
            os.replace(src, dst)
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        _hold(rule["until"], src, dst)
    finally:
        _busy = False


if _RULE is not None:
    import sys

    sys.addaudithook(_audit)


# ---------------------------------------------------------------------------------------------- non-finite steps
# ``TEST_NONFINITE`` (a JSON object) makes chosen batches' losses NaN on one rank, for real: ``rank``, ``at``
# (global batch indices, 0-based over the run) or ``from`` (that batch and every later one); ``"in": "forward"``
# makes the model's input NaN instead (the NaN flows through every layer, BatchNorm's running statistics included);
# with ``dump`` (a folder), every rank appends, per batch, a digest of its model's and EMA's parameters before and
# after the batch, the same of the model's buffers, and the EMA's update count, to ``<dump>/rank<r>.jsonl``. It
# wraps ``Trainer._train_batch`` once detrain's trainer module is imported (a meta path finder), and the batch's
# ``criterion.score`` while it runs: nothing in detrain knows.
_NONFINITE = json.loads(os.environ["TEST_NONFINITE"]) if os.environ.get("TEST_NONFINITE") else None
_TRAINER = "detrain.engine.train.trainer"


def _digest(trainer: object) -> str:
    import hashlib

    h = hashlib.sha256()
    for module in (trainer.model, trainer.ema.ema):  # type: ignore[attr-defined]
        for p in module.parameters():
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _buffer_digest(trainer: object) -> str:
    import hashlib

    h = hashlib.sha256()
    model = getattr(trainer.model, "module", trainer.model)  # type: ignore[attr-defined]
    for b in model.buffers():
        h.update(b.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _nan_input(module, args):
    return (args[0] * float("nan"), *args[1:])


def _poisoned(score):
    def nan_score(*args, **kwargs):
        return tuple(t * float("nan") for t in score(*args, **kwargs))

    return nan_score


def _patch_trainer(module: object) -> None:
    rule = _NONFINITE
    cls = module.Trainer  # type: ignore[attr-defined]
    original = cls._train_batch

    def _train_batch(self, epoch, i, batch, *rest):
        ni = epoch * self.nb + i
        bad = self.rank == rule["rank"] and (ni in rule.get("at", ()) or ni >= rule.get("from", 1 << 60))
        before = _digest(self) if rule.get("dump") else None
        buffers = _buffer_digest(self) if rule.get("dump") else None
        hook = None
        if bad and rule.get("in") == "forward":
            hook = getattr(self.model, "module", self.model).register_forward_pre_hook(_nan_input)
        elif bad:
            self.criterion.score = _poisoned(self.criterion.score)
        try:
            return original(self, epoch, i, batch, *rest)
        finally:
            if hook is not None:
                hook.remove()
            elif bad:
                del self.criterion.score
            if before is not None:
                line = {"step": ni, "nan": bad, "before": before, "after": _digest(self), "ema": self.ema.updates}
                line.update(buffers_before=buffers, buffers_after=_buffer_digest(self))
                with open(os.path.join(rule["dump"], f"rank{self.rank}.jsonl"), "a") as f:
                    f.write(json.dumps(line) + "\n")

    cls._train_batch = _train_batch


class _AfterImport:
    """A meta path finder that lets the real finder find the trainer module and patches it once executed."""

    def find_spec(self, name, path, target=None):
        import sys

        if name != _TRAINER:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None and spec.loader is not None:
                real = spec.loader.exec_module

                def exec_module(module, real=real):
                    real(module)
                    _patch_trainer(module)

                spec.loader.exec_module = exec_module
                return spec
        return None


if _NONFINITE is not None:
    import sys

    sys.meta_path.insert(0, _AfterImport())
