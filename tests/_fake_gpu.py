"""A fake GPU memory for AutoBatch's tests (:class:`detrain.engine.train.auto_batch.Memory`), importable by the
workers the distributed tests spawn.

Its steps are :func:`fake_steps`' (each returns what it is and its size) or real ones wrapped by
:func:`sized_steps`; a step of ``b`` images takes ``fixed + per_image * b`` bytes (validation's:
``fixed + val_per_image * b``), and one of more than ``oom_above`` images runs out of memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from detrain.engine.train.auto_batch import GIB, ProbeSteps


@dataclass
class FakeMemory:
    total_bytes: int = 80 * GIB
    available_bytes: int = 70 * GIB
    fixed: float = 1 * GIB
    per_image: float = 0.5 * GIB
    val_per_image: float = 0.05 * GIB
    oom_above: int | None = None
    name: str = "fake:0 (Fake GPU)"
    runs: list[tuple[str, int]] = field(default_factory=list)

    def total(self) -> int:
        return self.total_bytes

    def available(self) -> int:
        return self.available_bytes

    def peak(self, step: Callable[[], object]) -> int | None:
        kind, images = step()  # type: ignore[misc]
        self.runs.append((kind, images))
        if self.oom_above is not None and images > self.oom_above:
            return None
        return int(self.fixed + (self.per_image if kind == "train" else self.val_per_image) * images)


def fake_steps() -> ProbeSteps:
    """Steps that run nothing and say what they are."""
    return ProbeSteps(lambda b: ("train", b), lambda b: ("val", b))


def sized_steps(steps: ProbeSteps) -> ProbeSteps:
    """Real steps that also say what they are (so a FakeMemory can price them)."""
    train, val = steps.train, steps.val
    assert val is not None
    return ProbeSteps(lambda b: (train(b), ("train", b))[1], lambda b: (val(b), ("val", b))[1])
