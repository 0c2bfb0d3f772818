"""Scaling benchmark: does a bigger global batch learn as much per epoch as batch 16?

Data parallelism multiplies the global batch (8 GPUs x 16 images = 128). This script trains the same model on the
same synthetic set at several global batches (``--batches``, default 16,64,256,1024) for the same epochs, by
detrain under each ``--recipes`` (``auto``: detrain's default, the learning rate following the batch; ``none``:
``lr_scale=none``, lr0 whatever the batch, as Ultralytics) and by Ultralytics when importable, and prints per tool,
recipe and batch:

* best mAP50-95 (the tool's own per-epoch validator, and its best.pt scored by detrain's COCO-exact validator);
* its ratio to the same tool and recipe at the smallest batch;
* seconds per epoch (wall time of the whole run / epochs: start-up and validation included);
* the first epoch whose mAP50-95 reaches the smallest batch's best (``>E`` when none does).

One process stands for many ranks: a global batch of 256 in one process takes the same step as 16 ranks x 16
(``tests/integration/test_train_distributed.py`` checks that equivalence; BatchNorm statistics are per rank unless
``sync_bn=true``). Each run is one ``python`` child (``scripts/bench_learning.py``'s runner), one thread each with
``--parallel`` runs side by side; ``--reuse`` keeps finished runs, so an interrupted benchmark resumes.

    PYTHONPATH=/opt/ulib python scripts/bench_scaling.py --n-train 4096 --imgsz 160 --epochs 10 --batches 16,256 \\
        --threads 1 --parallel 2 --reuse --out docs/bench_scaling.md
    python scripts/bench_scaling.py --quick      # smoke run: detrain only, two tiny batches, ~1 minute
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_learning as bl

RECIPES = {"auto": "lr_scale=auto", "none": "lr_scale=none", "linear": "lr_scale=linear", "sqrt": "lr_scale=sqrt"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", default="detrain,ultralytics", help="comma-separated: detrain, ultralytics")
    p.add_argument("--model", choices=("yolov8n", "yolo11n", "yolo26n"), default="yolov8n")
    p.add_argument("--recipes", default="auto,none", help=f"detrain's, comma-separated: {', '.join(RECIPES)}")
    p.add_argument("--batches", default="16,64,256,1024", help="global batches, comma-separated (smallest first)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--imgsz", type=int, default=160)
    p.add_argument("--n-train", type=int, default=8192, help="synthetic training images (1024 x 8 updates)")
    p.add_argument("--n-val", type=int, default=512)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (0: each tool's default)")
    p.add_argument("--parallel", type=int, default=1, help="runs side by side (give each a core)")
    p.add_argument("--detrain-args", nargs="*", default=[], metavar="KEY=VALUE", help="more detrain keys, every run")
    p.add_argument("--reuse", action="store_true", help="keep finished runs instead of retraining")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 epochs, 64 px, 64 images, batches 8,32")
    p.add_argument("--work", type=Path, default=bl.REPO / "runs" / "bench_scaling")
    p.add_argument("--out", type=Path, help="also write the table as markdown here (and .json beside it)")
    p.add_argument("--timeout", type=float, default=24 * 3600, help="seconds one run may take")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.imgsz, args.n_train, args.n_val, args.batches = 2, 64, 64, 16, "8,32"
        args.impls = "detrain"
    args.batch_list = sorted({int(b) for b in args.batches.split(",") if b.strip()})
    args.recipe_list = [r.strip() for r in args.recipes.split(",") if r.strip()]
    bad = [r for r in args.recipe_list if r not in RECIPES]
    if bad or not args.recipe_list or not args.batch_list:
        p.error(f"--recipes: one or more of {', '.join(RECIPES)}; --batches: at least one (got {bad or 'none'})")
    return args


def runs_to_train(args: argparse.Namespace, impls: list[str]) -> list[tuple[str, str, int]]:
    """(tool, recipe, batch) for every run: detrain once per recipe, Ultralytics once (its recipe is 'none').

    >>> ns = argparse.Namespace(recipe_list=["auto", "none"], batch_list=[16, 256])
    >>> runs_to_train(ns, ["detrain", "ultralytics"])[:3]
    [('detrain', 'auto', 16), ('detrain', 'auto', 256), ('detrain', 'none', 16)]
    """
    out = [("detrain", r, b) for r in args.recipe_list for b in args.batch_list] if "detrain" in impls else []
    return out + ([("ultralytics", "-", b) for b in args.batch_list] if "ultralytics" in impls else [])


def run_args(args: argparse.Namespace, impl: str, recipe: str, batch: int) -> argparse.Namespace:
    """The namespace bench_learning's runner reads for one run (its folder is named by these settings)."""
    extra = [RECIPES[recipe], *args.detrain_args] if impl == "detrain" else []
    return argparse.Namespace(
        model=args.model,
        weights=None,
        epochs=args.epochs,
        imgsz=args.imgsz,
        batch=batch,
        workers=args.workers,
        threads=args.threads,
        detrain_args=extra,
        reuse=args.reuse,
        timeout=args.timeout,
    )


def command_line(argv: list[str] | None) -> str:
    """How this benchmark was started, PYTHONPATH included when set."""
    args = sys.argv[1:] if argv is None else argv
    prefix = f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else ""
    return f"{prefix}python scripts/bench_scaling.py {shlex.join(args)}".rstrip()


def reached(per_epoch: dict[int, float], target: float) -> int | None:
    """The first epoch whose mAP reaches ``target`` (None: none does).

    >>> reached({1: 0.1, 2: 0.5, 3: 0.6}, 0.5), reached({1: 0.1}, 0.5)
    (2, None)
    """
    return next((e for e, m in sorted(per_epoch.items()) if m >= target), None)


def table(rows: list[dict[str, Any]], epochs: int) -> str:
    """The markdown table: one row per tool, recipe and batch; ratios and epochs against the smallest batch."""
    lines = [
        "| tool | recipe | global batch | updates/epoch | best mAP50-95 (own) | best.pt mAP50-95 (detrain val) "
        "| ratio to smallest batch | s/epoch | epochs to reach smallest batch's best |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        base = next(r for r in rows if r["tool"] == row["tool"] and r["recipe"] == row["recipe"])
        ratio = row["best"] / base["best"] if base["best"] else None
        hit = reached(row["per_epoch"], base["best"])
        lines.append(
            f"| {row['tool']} | {row['recipe']} | {row['batch']} | {row['updates']} | {row['best']:.4f} | "
            f"{bl._num(row['final'])} | {bl._x(ratio)} | {bl._num(row['s_epoch'], 1)} | "
            f"{hit if hit is not None else f'>{epochs}'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    work = args.work.absolute()
    work.mkdir(parents=True, exist_ok=True)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    ultra = bl.ultralytics_version(work) if "ultralytics" in impls else None
    if "ultralytics" in impls and ultra is None:
        print("ultralytics is not importable (try PYTHONPATH=/opt/ulib): detrain only", file=sys.stderr)
        impls.remove("ultralytics")
    data = bl.prepare_shapes(work, args.n_train, args.n_val, args.imgsz, args.seed)
    todo = runs_to_train(args, impls)

    def one(job: tuple[str, str, int]) -> dict[str, Any]:
        impl, recipe, batch = job
        ns = run_args(args, impl, recipe, batch)
        run = bl.train_run(impl, data, ns, args.seed, work)
        bl.score_run(run, data, ns, work)
        best = max(run.per_epoch.values(), default=0.0)
        updates = -(-args.n_train // max(batch, 64 if impl == "ultralytics" else batch))
        s_epoch = run.wall_s / args.epochs if run.wall_s else None
        final = run.final.get("map") if run.final else None
        return {"tool": bl.LABELS[impl], "recipe": recipe, "batch": batch, "updates": updates, "best": best,
                "final": final, "s_epoch": s_epoch, "per_epoch": run.per_epoch, "run": asdict(run)}  # fmt: skip

    with ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(one, todo))
    info = bl.machine(ultra)
    header = [
        f"## Scaling: {args.model} from scratch at global batch {', '.join(map(str, args.batch_list))}",
        "",
        f"`{command_line(argv)}`",
        "",
        f"- machine: {info['cpus']} CPUs, torch {info['torch']}, ultralytics {info['ultralytics'] or '-'}; "
        f"{info['date']}; load average {os.getloadavg()[0]:.1f} at the end",
        f"- data: {data.note}; {args.epochs} epochs at imgsz {args.imgsz}, seed {args.seed}, "
        f"{args.threads or 'default'} thread(s) per run, {args.parallel} run(s) at a time",
        "",
    ]
    notes = [
        "",
        "best: the highest mAP50-95 the tool's own validator gave in any epoch; best.pt: that checkpoint scored by "
        "detrain's COCO-exact validator; ratio: best against the same tool and recipe at the smallest batch; "
        "s/epoch: the whole run's wall time over its epochs (start-up and validation included, runs side by side "
        "share the machine); updates/epoch as optimizer=auto from scratch plans them (detrain: one per batch; "
        "Ultralytics: one per max(batch, 64) images).",
    ]
    text = "\n".join(header) + table(rows, args.epochs) + "\n".join(notes) + "\n"
    print("\n" + text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2, default=str))
    return rows


if __name__ == "__main__":
    main()
