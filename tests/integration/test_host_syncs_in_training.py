"""A steady-state training step makes at most two host syncs (issue 40), counted through the real trainer on a CPU as
a GPU would have them (tests/_host_syncs.py; scripts/count_syncs.py prints the table, docs/benchmarks.md "Host syncs
per step").

The two that remain, both inherent:

1. the step's one read (``trainer._train_batch``): the all-reduced loss items with the flags every rank decides by
   (a non-finite loss or gradient skips the update, a preemption stops the run, rank 0's clock saves mid.pt) and
   the epoch's running losses for the progress bar, read together with one ``.tolist()``. The update's decision
   must be known on the host before the optimizer steps (or not), and the same on every rank;
2. the loss's foreground count (``DetectionLoss._score``, ``fg_mask.nonzero``): the box and DFL terms are sums over
   the F assigned anchors, in that order. Summing over every anchor with zero weights instead would change how the
   sums round (a different reduction order), so training would no longer be bit-identical. The assigner's own
   numbers (real boxes, candidate pairs, the largest box count to pad to) come from the labels, in host memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _host_syncs import STEP_ARGS, count_step_syncs, report

from detrain.data.synthetic import generate_shapes
from detrain.engine.train.nonfinite import NonFinite

pytestmark = pytest.mark.integration

BOUND = 2
AT = 4  # the counted batch: every batch is an update, so the optimizer's state exists by then


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = generate_shapes(tmp_path_factory.mktemp("syncs") / "shapes", n_train=24, n_val=2, imgsz=64, seed=0)
    return root / "data.yaml"


def _args(data: Path, project: Path) -> dict:
    return {**STEP_ARGS, "data": str(data), "project": str(project)}


def test_a_steady_training_step_makes_at_most_two_host_syncs(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    counter = count_step_syncs(_args(data, tmp_path), at=AT)
    trainer = counter.trainer
    assert trainer.ema.updates == AT + 1 and trainer.optimizer.state  # the step updated the weights and the EMA
    with capsys.disabled():
        report(counter)
    assert len(counter.syncs) <= BOUND, counter.table()
    kinds = sorted((s.kind, s.where.split(":")[0]) for s in counter.syncs)
    assert kinds == [(".tolist()", "detrain/engine/train/trainer.py"), ("nonzero", "detrain/nn/loss.py")], kinds


def test_the_count_goes_up_with_an_item_put_back_in_the_step(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The counter is not blind to the loop: a ``.item()`` of the loss, as a loop logging it would make, is one more
    sync than the bound (the test above goes red with it)."""
    note_loss = NonFinite.note_loss

    def with_an_item(self: NonFinite, loss: torch.Tensor) -> None:
        float(loss.item())
        note_loss(self, loss)

    monkeypatch.setattr(NonFinite, "note_loss", with_an_item)
    counter = count_step_syncs(_args(data, tmp_path), at=AT)
    assert len(counter.syncs) == BOUND + 1, counter.table()
    assert any(s.kind == "item" and s.where.endswith(" _step") for s in counter.syncs), counter.table()
