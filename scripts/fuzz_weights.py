"""Fuzz detrain's checkpoint loader with mutations of a real YOLOv8 checkpoint; every case must load or be refused.

    python scripts/fuzz_weights.py --cases 20000                 # the figure in docs/benchmarks.md
    python scripts/fuzz_weights.py --cases 500 --seed 7          # a quick look
    python scripts/fuzz_weights.py --replay 1234 --seed 7        # run one case in this process, with a traceback

Each case takes a base file (``../shared/weights/yolov8n.pt`` as Ultralytics wrote it, or the same weights saved
as a detrain checkpoint with RNG state), applies one structured mutation (or, one case in ten, a stack of
them) and calls ``detrain.weights.checkpoint.load_checkpoint`` on the result in a forked child (``_fuzz_sandbox``),
then builds the model it records (``model_from_checkpoint``: the model-yaml checks, shapes, finiteness):

- pickle level (``_fuzz_pickle``, data.pkl re-zipped with a correct CRC so the mutation reaches the
  unpickler): opcodes dropped, duplicated, swapped; globals renamed; storage dtypes, sizes and keys, tensor
  shapes, any integer or string changed; a value of the recorded model yaml made hostile (a width in the
  millions, a NaN multiple, a wrong type); numpy values, tensors, BUILDs and keys that are costly to hash
  forged in; bytes flipped;
- zip level (``_fuzz_zip``): the file or one record truncated, a record dropped or duplicated, records
  recompressed (must still load), a header field set to a lie, bytes flipped anywhere, NaN or infinity written
  into a tensor.

The acceptable ends are a load whose model weights are a dict of tensors and whose model is built (``ok``) or a
CheckpointError (``refused``). Anything else is a finding: another exception (``error``), an allocation past
``--mem-mb`` above what the child inherited (``memory``), more than ``--cpu-s`` seconds of CPU or ``--wall-s`` of
waiting (``hang``), or a signal (``crash``). Cases are seeded by ``(--seed, index)``, so any case can be replayed.
The table counts outcomes per mutation; the exit status is 1 when any case failed.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import _fuzz_pickle as fp  # noqa: E402
import _fuzz_zip as fz  # noqa: E402
from _fuzz_sandbox import KINDS, Outcome, run_isolated  # noqa: E402

DEFAULT_WEIGHTS = REPO.parent / "shared" / "weights" / "yolov8n.pt"
MUTATIONS = [*fp.MUTATIONS, *fz.MUTATIONS]
STACKED = "stacked"


@dataclass(frozen=True)
class Base:
    """A file to mutate: its records and its parsed data.pkl."""

    name: str
    records: list[fz.Record]
    pkl_index: int
    pickle: fp.ParsedPickle

    @classmethod
    def read(cls, name: str, path: Path) -> Base:
        records = fz.read_records(path)
        (pkl_index,) = [i for i, (n, _) in enumerate(records) if n.endswith("data.pkl")]
        return cls(name, records, pkl_index, fp.ParsedPickle(records[pkl_index][1]))

    def with_pickle(self, data: bytes) -> list[fz.Record]:
        records = list(self.records)
        records[self.pkl_index] = (records[self.pkl_index][0], data)
        return records


@dataclass(frozen=True)
class Case:
    index: int
    base: str
    mutations: tuple[str, ...]
    data: bytes

    @property
    def label(self) -> str:
        return self.mutations[0] if len(self.mutations) == 1 else STACKED


def make_detrain_base(weights: Path, folder: Path) -> Path:
    """The YOLOv8 weights as a detrain checkpoint (what ``detrain convert`` writes), plus a run's RNG state."""
    from detrain.engine.train.reproduce import rng_state
    from detrain.weights.checkpoint import load_checkpoint, save_checkpoint

    ckpt = load_checkpoint(weights)
    ckpt.update(rng=rng_state(), epoch=3, train_args={"imgsz": 640, "epochs": 10, "name": "fuzz"})
    return save_checkpoint(ckpt, folder / "detrain_base.pt")


def make_case(bases: list[Base], seed: int, index: int) -> Case:
    """Case ``index`` of run ``seed``: the same bytes every time. The first base is drawn 3 times in 4."""
    rng = random.Random(f"{seed}/{index}")
    base = bases[0] if len(bases) == 1 or rng.random() < 0.75 else rng.choice(bases[1:])
    roll = rng.random()
    if roll < 0.55:
        name = rng.choice(list(fp.MUTATIONS))
        return Case(index, base.name, (name,), fz.write_zip(base.with_pickle(fp.MUTATIONS[name](rng, base.pickle))))
    if roll < 0.9:
        name = rng.choice(list(fz.MUTATIONS))
        return Case(index, base.name, (name,), fz.MUTATIONS[name](rng, base.records))
    names: list[str] = []
    pkl = base.pickle
    for _ in range(rng.randint(1, 2)):
        name = rng.choice(list(fp.MUTATIONS))
        data = fp.MUTATIONS[name](rng, pkl)
        names.append(name)
        try:
            pkl = fp.ParsedPickle(data)
        except Exception:  # noqa: BLE001 - no longer a parseable program: nothing more to aim at on this level
            break
    zip_name = rng.choice(list(fz.MUTATIONS))
    names.append(zip_name)
    return Case(index, base.name, tuple(names), fz.MUTATIONS[zip_name](rng, base.with_pickle(data)))


def load_target(path: Path, build: bool = True) -> Callable[[], str]:
    """What each child runs: load the file, touch what every caller reads (the model's weights) and, with
    ``build``, build the model it records and load its weights into it (the model-yaml checks, the shape checks)."""

    def target() -> str:
        from detrain.weights.checkpoint import load_checkpoint, model_from_checkpoint

        ckpt: Any = load_checkpoint(path)
        weights = ckpt["model"]["state_dict"]
        if not all(isinstance(k, str) and hasattr(v, "shape") for k, v in weights.items()):
            raise TypeError("load_checkpoint returned weights that are not tensors")
        if build:
            model = model_from_checkpoint(ckpt, source=str(path))
            return f"{ckpt.get('source', 'detrain')}: {len(weights)} tensors, {model.family} {model.scale} built"
        return f"{ckpt.get('source', 'detrain')}: {len(weights)} tensors"

    return target


def warm_up(bases: list[Base], folder: Path) -> None:
    """Load and build each unmutated base once in this process before any fork: the children then inherit the
    lazily imported modules, the allocator's freed pages and torch's first-use setup instead of each paying for
    them (a forked load of yolov8n.pt: 2.26 s cold, 0.40 s warm, on a 2-CPU VM), and each child's memory
    growth measures the case, not that setup (212 MiB cold, 19 MiB warm)."""
    for base in bases:
        path = folder / f"{base.name}.pt"
        path.write_bytes(fz.write_zip(base.records))
        load_target(path)()


@dataclass
class Tally:
    """Outcome counts per mutation, and what is worth printing about the worst cases."""

    counts: dict[str, Counter[str]]
    failures: list[tuple[Case, Outcome]]
    max_cpu: tuple[float, int] = (0.0, -1)
    max_growth: tuple[float, int] = (0.0, -1)
    stopped: bool = False  # set by SIGTERM / Ctrl-C: the cases so far are still reported

    def add(self, case: Case, outcome: Outcome) -> None:
        self.counts[case.label][outcome.kind] += 1
        if not outcome.acceptable:
            self.failures.append((case, outcome))
        self.max_cpu = max(self.max_cpu, (outcome.cpu_s, case.index))
        self.max_growth = max(self.max_growth, (outcome.peak_growth_mb, case.index))

    def total(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for c in self.counts.values():
            out.update(c)
        return out


def new_tally() -> Tally:
    return Tally(defaultdict(Counter), [])


def run_cases(
    bases: list[Base],
    seed: int,
    indices: range,
    folder: Path,
    *,
    cpu_s: float,
    mem_mb: int,
    wall_s: float,
    save_failures: Path | None = None,
    progress: int = 0,
    tally: Tally | None = None,
) -> Tally:
    """Make, write and load each case in a forked child of a warmed-up process (:func:`warm_up`); count how each
    ended (into ``tally`` when given)."""
    import detrain.nn.model
    import detrain.weights.ultralytics  # noqa: F401  imported here once, so no child imports them again
    from detrain.errors import CheckpointError

    tally = new_tally() if tally is None else tally
    warm_up(bases, folder)
    start = time.monotonic()
    for n, index in enumerate(indices, 1):
        if tally.stopped:
            break
        case = make_case(bases, seed, index)
        path = folder / f"{case.base}.pt"  # torch names the archive's folder after the file; keep it plausible
        path.write_bytes(case.data)
        outcome = run_isolated(
            load_target(path), (CheckpointError,), cpu_s=cpu_s, mem_bytes=mem_mb << 20, wall_s=wall_s
        )
        tally.add(case, outcome)
        if not outcome.acceptable and save_failures is not None:
            save_failures.mkdir(parents=True, exist_ok=True)
            (save_failures / f"case{index}_{outcome.kind}.pt").write_bytes(case.data)
        if progress and n % progress == 0:
            bad = len(tally.failures)
            print(f"  {n} cases, {bad} failed, {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return tally


def table(tally: Tally) -> str:
    """Outcome counts per mutation as a markdown table, with a total row."""
    head = ["mutation", "cases", *KINDS]
    rows = [
        [name, str(sum(c.values())), *(str(c[k]) for k in KINDS)]
        for name, c in sorted(tally.counts.items(), key=lambda kv: (kv[0] == STACKED, kv[0]))
    ]
    total = tally.total()
    rows.append(["**total**", str(sum(total.values())), *(str(total[k]) for k in KINDS)])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        padded = (c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), rule, *(line(r) for r in rows)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--first", type=int, default=0, help="index of the first case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weights", type=Path, default=DEFAULT_WEIGHTS, help="the YOLOv8 checkpoint to mutate")
    ap.add_argument("--no-detrain-base", action="store_true", help="mutate only the YOLOv8 file")
    ap.add_argument("--cpu-s", type=float, default=5.0, help="CPU seconds a case may use")
    ap.add_argument("--wall-s", type=float, default=60.0, help="wall seconds a case may take (a shared machine)")
    ap.add_argument("--mem-mb", type=int, default=1024, help="MiB a case may allocate")
    ap.add_argument("--save-failures", type=Path, default=None, help="write failing cases' files here")
    ap.add_argument("--progress", type=int, default=1000, help="a progress line every N cases (0: none)")
    ap.add_argument("--replay", type=int, default=None, help="run this one case here, unisolated, and show it")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # forked children must not inherit a busy thread pool
    if not args.weights.is_file():
        ap.error(f"{args.weights} not found")
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None  # case files are written and read once each
    with tempfile.TemporaryDirectory(prefix="fuzz_weights_", dir=shm) as tmp:
        folder = Path(tmp)
        bases = [Base.read("yolov8n", args.weights)]
        if not args.no_detrain_base:
            bases.append(Base.read("detrain", make_detrain_base(args.weights, folder)))
        if args.replay is not None:
            case = make_case(bases, args.seed, args.replay)
            path = folder / f"{case.base}.pt"
            path.write_bytes(case.data)
            print(f"case {case.index}: {case.base} + {', '.join(case.mutations)} ({len(case.data)} bytes)")
            print(load_target(path)())
            return 0
        t0 = time.monotonic()
        tally = new_tally()

        def stop(signum: int, frame: object) -> None:
            tally.stopped = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        tally = run_cases(
            bases,
            args.seed,
            range(args.first, args.first + args.cases),
            folder,
            cpu_s=args.cpu_s,
            mem_mb=args.mem_mb,
            wall_s=args.wall_s,
            save_failures=args.save_failures,
            progress=args.progress,
            tally=tally,
        )
        wall = time.monotonic() - t0
    total = sum(tally.total().values())
    if tally.stopped:
        print(f"stopped after {total} of {args.cases} cases")
    print(table(tally))
    print(
        f"\n{total} cases (seed {args.seed}, indices {args.first}..{args.first + total - 1}, bases: "
        f"{', '.join(b.name for b in bases)}) in {wall:.0f} s wall, {total / wall:.1f} cases/s; limits per case: "
        f"{args.cpu_s:g} s CPU, {args.wall_s:g} s wall, {args.mem_mb} MiB"
    )
    print(
        f"most CPU in one case: {tally.max_cpu[0]:.2f} s (case {tally.max_cpu[1]}); largest peak RSS growth: "
        f"{tally.max_growth[0]:.0f} MiB (case {tally.max_growth[1]})"
    )
    for case, outcome in tally.failures[:20]:
        print(
            f"FAILED case {case.index} ({case.base} + {', '.join(case.mutations)}): {outcome.kind}: "
            f"{outcome.detail[:200]}"
        )
    if len(tally.failures) > 20:
        print(f"... and {len(tally.failures) - 20} more failures")
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
