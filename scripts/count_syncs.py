"""The host syncs of one steady-state training step, as a GPU would have them, counted on the CPU.

Trains a tiny model on the built-in shapes set in this process up to one batch past the first updates and counts
that batch's whole step (forward, loss, backward, optimizer step, EMA, the loop's bookkeeping) with
``tests/_host_syncs.py``'s counter: one line per kind of sync and the code that made it. The same count is
``tests/unit/test_host_syncs.py``'s bound (docs/benchmarks.md, "Host syncs per step").

    PYTHONPATH=. python scripts/count_syncs.py
    PYTHONPATH=. python scripts/count_syncs.py optimizer=AdamW save_interval=0 grace=0
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _host_syncs import STEP_ARGS, count_step_syncs, report

from detrain.data.synthetic import generate_shapes


def main(argv: list[str]) -> None:
    overrides = dict(word.split("=", 1) for word in argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = generate_shapes(Path(tmp) / "shapes", n_train=24, n_val=2, imgsz=64, seed=0)
        args = {**STEP_ARGS, "data": str(root / "data.yaml"), "project": tmp, **overrides}
        print("train " + " ".join(f"{k}={v}" for k, v in args.items() if k not in ("data", "project")))
        report(count_step_syncs(args))


if __name__ == "__main__":
    main(sys.argv[1:])
