"""Learning benchmark: does detrain learn as well as Ultralytics in the same number of epochs?

Both tools train a model from scratch (``--model``: yolov8n, the default, yolo11n or yolo26n, each tool's own
packaged yaml of that name; or from ``--weights``) on the very same files with the same settings (epochs,
imgsz, batch, workers, seed; everything else at each tool's default; CPU), each run in its own ``python`` process,
one after the other, for every seed of ``--seeds``. The table gives, per selected epoch, the mean over seeds of the
mAP50-95 each tool's own validator wrote to its ``results.csv``, then every run's ``best.pt`` scored by detrain's
COCO-exact validator (``detrain val``: the same code, flags and batches for both sides), the ratio detrain /
Ultralytics, and the wall time per run.

Datasets (``--dataset``):

* ``shapes``: detrain's synthetic set, generated into the work folder (``--n-train``, ``--n-val``,
  ``--gen-imgsz``); train and val are drawn separately, so val is held out.
* ``coco128``: ``../shared/data/coco128`` (beside the repository) split by a seeded permutation into train and
  a held-out val (``--val-fraction``). The images and labels are symlinked into the work folder (the shared
  folder is read-only and both tools write label caches beside the labels), listed in ``train.txt`` /
  ``val.txt``; nothing is copied into the repository.

Ultralytics is never a dependency: it is used when importable, e.g. with ``PYTHONPATH=/opt/ulib``; its
children run with ``YOLO_OFFLINE=1`` and ``YOLO_CONFIG_DIR`` inside the work folder. ``--reuse`` keeps every
run whose folder already holds a finished ``results.csv`` and a ``best.pt``, so an interrupted benchmark
resumes and the tables can be remade without retraining.

    PYTHONPATH=/opt/ulib python scripts/bench_learning.py --dataset shapes --epochs 30 --seeds 0,1 \\
        --out docs/bench_learning_shapes.md
    PYTHONPATH=/opt/ulib python scripts/bench_learning.py --dataset coco128 --epochs 30 --reuse --out coco128.md
    PYTHONPATH=/opt/ulib python scripts/bench_learning.py --quick --dataset shapes     # smoke run, ~1 minute
    python scripts/bench_learning.py --impls detrain --dataset shapes --epochs 10      # detrain only
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_data import train_images  # noqa: E402

SHARED_COCO128 = REPO.parent / "shared" / "data" / "coco128.yaml"
IMPLS = ("detrain", "ultralytics")
LABELS = {"detrain": "detrain", "ultralytics": "Ultralytics"}
# What each tool writes for the per-epoch mAP50-95 (Ultralytics: "(B)" for boxes, older versions pad with spaces)
MAP_COLUMNS = ("metrics/mAP50-95", "metrics/mAP50-95(B)")
DEFAULTS: dict[str, Any] = {
    "epochs": 30,
    "imgsz": 320,
    "batch": 16,
    "workers": 2,
    "seeds": "0,1",
    "n_train": 400,
    "n_val": 100,
    "gen_imgsz": 320,
}
QUICK: dict[str, Any] = {
    "epochs": 2,
    "imgsz": 64,
    "batch": 8,
    "workers": 2,
    "seeds": "0",
    "n_train": 16,
    "n_val": 8,
    "gen_imgsz": 64,
}
VAL_FLAGS = {"conf": 0.001, "iou": 0.7, "max_det": 300, "split": "val"}  # detrain val always batches rectangularly

# The Ultralytics side: a child python that trains as a user of its Python API would. With --threads it overrides
# the thread count Ultralytics' select_device imposes on CPU (min(8, cpus - 1)); otherwise that default stands.
ULTRALYTICS_CHILD = """
import json, sys, torch
kw = json.loads(sys.argv[1])
threads = kw.pop("threads")
if threads:
    import ultralytics.utils.torch_utils as tu
    tu.NUM_THREADS = threads
from ultralytics import YOLO
model = YOLO(kw.pop("model"))
model.train(**kw)
# what it really used: its trainer sets workers to 0 on CPU whatever was asked
print(json.dumps({"threads": torch.get_num_threads(), "workers": model.trainer.args.workers}))
"""


# ---------------------------------------------------------------- datasets


@dataclass(frozen=True)
class Dataset:
    """A dataset yaml both tools read (absolute ``path``), and a tag naming it in the work folder."""

    tag: str
    yaml: Path
    n_train: int
    n_val: int
    note: str


def prepare_shapes(work: Path, n_train: int, n_val: int, gen_imgsz: int, seed: int = 0) -> Dataset:
    """Generate the synthetic set into work/data/<tag> once and write an absolute-path yaml beside it."""
    from detrain.data.synthetic import SHAPE_NAMES, fingerprint, generate_shapes

    tag = f"shapes_{n_train}_{n_val}_{gen_imgsz}"
    root = work / "data" / tag
    stamp = f"fingerprint: {fingerprint(n_train, n_val, gen_imgsz, seed)}"
    generated = root / "data.yaml"
    if not (generated.is_file() and stamp in generated.read_text()):
        if root.exists():
            shutil.rmtree(root)
        generate_shapes(root, n_train=n_train, n_val=n_val, imgsz=gen_imgsz, seed=seed)
    data = write_data_yaml(root / "bench.yaml", root, "images/train", "images/val", SHAPE_NAMES)
    note = f"shapes: {n_train} train / {n_val} val images generated at {gen_imgsz} px (seed {seed}), held-out val"
    return Dataset(tag, data, n_train, n_val, note)


def write_data_yaml(path: Path, root: Path, train: str, val: str, names: dict[int, str]) -> Path:
    """An Ultralytics-schema dataset yaml with an absolute ``path`` (Ultralytics reads a relative one against
    its own datasets folder, detrain against the yaml's folder)."""
    doc = {"path": str(root.absolute()), "train": train, "val": val, "names": {int(k): v for k, v in names.items()}}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def split_images(images: list[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, val): a seeded permutation's first ``round(n * val_fraction)`` images are val; both sorted.

    >>> split_images(["a", "b", "c", "d"], 0.25, 0)[1]
    ['c']
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val fraction must be between 0 and 1 (got {val_fraction})")
    ordered = sorted(images)
    n_val = min(max(1, round(len(ordered) * val_fraction)), len(ordered) - 1)
    perm = np.random.default_rng(seed).permutation(len(ordered))
    val = {ordered[i] for i in perm[:n_val]}
    return [p for p in ordered if p not in val], sorted(val)


def label_of(image: Path) -> Path:
    """The label file of an image (the last ``/images/`` becomes ``/labels/``), as both tools find it."""
    from detrain.data.labels.verify import img2label_path

    return Path(img2label_path(image))


def link_split(images: list[str], root: Path, split: str) -> list[str]:
    """Symlink each image into root/images/<split> and its label (when it has one) into root/labels/<split>."""
    (root / "images" / split).mkdir(parents=True)
    (root / "labels" / split).mkdir(parents=True)
    out = []
    for im in images:
        src = Path(im)
        dst = root / "images" / split / src.name
        dst.symlink_to(src.resolve())
        if label_of(src).is_file():
            (root / "labels" / split / f"{src.stem}.txt").symlink_to(label_of(src).resolve())
        out.append(str(dst))
    return out


def prepare_coco128(work: Path, shared_yaml: Path, val_fraction: float, seed: int) -> Dataset | None:
    """A held-out split of coco128 in work/data/<tag> (symlinks, train.txt, val.txt, data.yaml), or None when
    the shared data is absent. Rebuilt each time: it is deterministic and costs only symlinks."""
    if not shared_yaml.is_file():
        return None
    images, names = train_images(str(shared_yaml))  # coco128's train and val are the same 128 images
    train, val = split_images(images, val_fraction, seed)
    tag = f"coco128_val{val_fraction:g}_seed{seed}"
    root = work / "data" / tag
    if root.exists():
        shutil.rmtree(root)
    for split, files in (("train", train), ("val", val)):
        linked = link_split(files, root, split)
        (root / f"{split}.txt").write_text("".join(f"{p}\n" for p in linked))
    data = write_data_yaml(root / "data.yaml", root, "train.txt", "val.txt", names)
    note = (
        f"coco128 ({shared_yaml.parent / 'coco128'}): {len(train)} train / {len(val)} val images, "
        f"held-out split by a seeded permutation (seed {seed}, val fraction {val_fraction:g})"
    )
    return Dataset(tag, data, len(train), len(val), note)


# ---------------------------------------------------------------- runs


@dataclass
class Run:
    """One training run of one tool and seed, and what came of it."""

    impl: str
    seed: int
    dir: str
    per_epoch: dict[int, float] = field(default_factory=dict)  # epoch (1-based) -> own-validator mAP50-95
    final: dict[str, float] | None = None  # best.pt by detrain's validator: map, map50
    wall_s: float | None = None
    threads: int | None = None  # torch threads it trained with
    workers: int | None = None  # loader workers it trained with
    reused: bool = False


def read_results_csv(path: Path) -> dict[int, float]:
    """epoch -> mAP50-95 from either tool's results.csv (headers and values stripped of padding)."""
    with open(path, newline="") as f:
        rows = [{(k or "").strip(): (v or "").strip() for k, v in row.items()} for row in csv.DictReader(f)]
    if not rows:
        return {}
    column = next((c for c in MAP_COLUMNS if c in rows[0]), None)
    if column is None:
        raise ValueError(f"{path}: no mAP50-95 column (looked for {', '.join(MAP_COLUMNS)})")
    return {int(float(r["epoch"])): float(r[column]) for r in rows if r.get(column)}


def finished(run_dir: Path, epochs: int) -> bool:
    """Whether a run folder holds a results.csv with every epoch and a best.pt."""
    csv_file, best = run_dir / "results.csv", run_dir / "weights" / "best.pt"
    if not (csv_file.is_file() and best.is_file()):
        return False
    try:
        return set(range(1, epochs + 1)) <= set(read_results_csv(csv_file))
    except (ValueError, KeyError, OSError):
        return False


def run_name(impl: str, args: argparse.Namespace, seed: int) -> str:
    """The run folder's name: the settings a reused run must share."""
    start = f"_from-{args.weights.stem}" if args.weights else f"_{args.model}" if args.model != "yolov8n" else ""
    extra = "".join(f"_{kv.replace('=', '-')}" for kv in args.detrain_args) if impl == "detrain" else ""
    return f"{impl}{start}_e{args.epochs}_i{args.imgsz}_b{args.batch}_w{args.workers}_t{args.threads}{extra}_s{seed}"


def child_env(work: Path, threads: int) -> dict[str, str]:
    """The environment of every child: Ultralytics offline with its settings in the work folder, no progress
    bars from detrain in the logs, and OMP_NUM_THREADS only when ``--threads`` asks for a count."""
    env = dict(os.environ)
    env.setdefault("YOLO_OFFLINE", "1")
    env.setdefault("YOLO_CONFIG_DIR", str(work / "ultralytics_config"))
    env["DETRAIN_PROGRESS"] = "0"
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def train_command(impl: str, data: Path, args: argparse.Namespace, seed: int, project: Path) -> list[str]:
    """The command line that trains one run."""
    name = run_name(impl, args, seed)
    if impl == "detrain":
        model = str(args.weights.absolute()) if args.weights else f"{args.model}.yaml"
        return [
            sys.executable,
            "-m",
            "detrain.cli",
            "train",
            f"data={data}",
            f"model={model}",
            f"epochs={args.epochs}",
            f"imgsz={args.imgsz}",
            f"batch={args.batch}",
            f"seed={seed}",
            f"workers={args.workers}",
            "device=cpu",
            f"project={project}",
            f"name={name}",
            "exist_ok=True",
            "plots=False",
            *args.detrain_args,
        ]
    kw = {
        "model": str(args.weights.absolute()) if args.weights else f"{args.model}.yaml",
        "data": str(data),
        "epochs": args.epochs,
        "imgsz": args.imgsz,
        "batch": args.batch,
        "seed": seed,
        "workers": args.workers,
        "device": "cpu",
        "project": str(project),
        "name": name,
        "exist_ok": True,
        "plots": False,
        "amp": False,
        "threads": args.threads,
    }
    return [sys.executable, "-c", ULTRALYTICS_CHILD, json.dumps(kw)]


def run_logged(cmd: list[str], log: Path, env: dict[str, str], cwd: Path, timeout_s: float) -> float:
    """Run ``cmd`` with its output in ``log`` (a file, not a pipe: loader workers may outlive it); the wall
    seconds it took. Stops the benchmark with the log's tail when it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as out:
        out.write("$ " + shlex.join(cmd) + "\n")
        out.flush()
        try:
            rc = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    wall = time.perf_counter() - t0
    if rc != 0:
        tail = log.read_text(errors="replace")[-6000:]
        raise SystemExit(f"failed (exit {rc}, log {log}): {shlex.join(cmd[:4])} ...\n{tail}")
    return wall


def last_json_line(log: Path) -> dict[str, Any]:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def detrain_threads(threads: int) -> int:
    """The torch threads detrain's trainer uses for one CPU worker."""
    if threads > 0:
        return threads
    from detrain.distributed.launch.devices import cpu_threads_per_worker

    return cpu_threads_per_worker(1) or int(os.environ["OMP_NUM_THREADS"])


def train_run(impl: str, data: Dataset, args: argparse.Namespace, seed: int, work: Path) -> Run:
    """Train one run, or keep a finished one with ``--reuse``; per-epoch mAP and wall time recorded."""
    project = work / data.tag / "runs"
    run_dir = project / run_name(impl, args, seed)
    meta_file = run_dir / "bench_run.json"
    reused = args.reuse and finished(run_dir, args.epochs)
    if reused:
        meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
        print(f"{impl} seed {seed}: reusing {run_dir}", flush=True)
    else:
        if run_dir.exists():  # Ultralytics appends to an old results.csv: start clean
            shutil.rmtree(run_dir)
        print(f"{impl} seed {seed}: training into {run_dir}", flush=True)
        log = project / f"{run_dir.name}.log"
        cmd = train_command(impl, data.yaml, args, seed, project)
        wall = run_logged(cmd, log, child_env(work, args.threads), REPO, args.timeout)
        used = (
            last_json_line(log)
            if impl == "ultralytics"
            else {"threads": detrain_threads(args.threads), "workers": args.workers}
        )
        meta = {"wall_s": wall, **used, "command": shlex.join(cmd)}
        meta_file.write_text(json.dumps(meta, indent=2))
        print(f"{impl} seed {seed}: {wall:.1f} s", flush=True)
    per_epoch = read_results_csv(run_dir / "results.csv")
    return Run(
        impl, seed, str(run_dir), per_epoch, None, meta.get("wall_s"), meta.get("threads"), meta.get("workers"), reused
    )


def score_run(run: Run, data: Dataset, args: argparse.Namespace, work: Path) -> None:
    """Score the run's best.pt and last.pt (the last epoch's EMA weights) with ``detrain val``, the same flags for
    both tools, into ``run.final`` (map, map50 of best.pt; last_map of last.pt)."""
    run.final = {}
    for which in ("best", "last"):
        weights = Path(run.dir) / "weights" / f"{which}.pt"
        val_dir = work / data.tag / "val" / (Path(run.dir).name + ("" if which == "best" else "_last"))
        metrics_file = val_dir / "metrics.json"
        fresh = metrics_file.is_file() and metrics_file.stat().st_mtime >= weights.stat().st_mtime
        if not (args.reuse and fresh):
            cmd = [
                sys.executable,
                "-m",
                "detrain.cli",
                "val",
                f"model={weights}",
                f"data={data.yaml}",
                f"imgsz={args.imgsz}",
                f"batch={args.batch}",
                f"workers={args.workers}",
                "device=cpu",
                *(f"{k}={v}" for k, v in VAL_FLAGS.items()),
                "plots=False",
                "verbose=False",
                f"project={val_dir.parent}",
                f"name={val_dir.name}",
                "exist_ok=True",
            ]
            run_logged(cmd, val_dir.parent / f"{val_dir.name}.log", child_env(work, args.threads), REPO, args.timeout)
        metrics = json.loads(metrics_file.read_text())
        if which == "best":
            run.final.update(map=float(metrics["map"]), map50=float(metrics["map50"]))
        else:
            run.final["last_map"] = float(metrics["map"])


# ---------------------------------------------------------------- tables


def selected_epochs(epochs: int, all_epochs: bool = False, every: int = 5) -> list[int]:
    """Every ``every``-th epoch and the last (or all of them).

    >>> selected_epochs(12)
    [5, 10, 12]
    """
    if all_epochs:
        return list(range(1, epochs + 1))
    return sorted(set(range(every, epochs + 1, every)) | {epochs})


def mean_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present and len(present) == len(values) else None


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, or None when either is missing or theirs is 0."""
    return ours / theirs if ours is not None and theirs else None


def summarize(runs: dict[str, list[Run]], epochs: list[int]) -> dict[str, Any]:
    """Means over seeds per tool: per selected epoch, of the final best.pt scores and of the wall time, plus
    the detrain / Ultralytics ratios where both sides ran."""
    per_epoch = {impl: {e: mean_or_none([r.per_epoch.get(e) for r in rs]) for e in epochs} for impl, rs in runs.items()}
    final = {
        impl: {k: mean_or_none([r.final.get(k) if r.final else None for r in rs]) for k in ("map", "map50", "last_map")}
        for impl, rs in runs.items()
    }
    wall = {impl: mean_or_none([r.wall_s for r in rs]) for impl, rs in runs.items()}
    both = "detrain" in runs and "ultralytics" in runs
    ratios: dict[str, Any] = {}
    if both:
        ratios = {
            "per_epoch": {e: ratio(per_epoch["detrain"][e], per_epoch["ultralytics"][e]) for e in epochs},
            "final_map": ratio(final["detrain"]["map"], final["ultralytics"]["map"]),
            "final_map50": ratio(final["detrain"]["map50"], final["ultralytics"]["map50"]),
            "final_last_map": ratio(final["detrain"]["last_map"], final["ultralytics"]["last_map"]),
            "wall_s": ratio(wall["detrain"], wall["ultralytics"]),
        }
    return {"epochs": epochs, "per_epoch": per_epoch, "final": final, "wall_s": wall, "ratio": ratios}


def _num(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _seeds(runs: list[Run], key: str) -> str:
    values = [r.final.get(key) if r.final else None for r in runs]
    return ", ".join(_num(v, 3) for v in values) if len(values) > 1 else ""


def render_markdown(runs: dict[str, list[Run]], summary: dict[str, Any], header: list[str]) -> str:
    """The header lines, then one table: selected epochs (each tool's own validator, mean over seeds), the
    best.pt scores by detrain's validator (mean, per seed in brackets), and the wall time per run."""
    impls = [i for i in IMPLS if i in runs]
    both = len(impls) == 2
    cols = [f"{LABELS[i]} mAP50-95" for i in impls] + (["detrain / Ultralytics"] if both else [])
    lines = [*header, "", "| epoch | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for e in summary["epochs"]:
        cells = [_num(summary["per_epoch"][i][e]) for i in impls]
        cells += [_x(summary["ratio"]["per_epoch"][e])] if both else []
        lines.append(f"| {e} | " + " | ".join(cells) + " |")
    for key, label in (
        ("map", "best.pt mAP50-95, detrain validator"),
        ("map50", "best.pt mAP50, detrain validator"),
        ("last_map", "last.pt mAP50-95, detrain validator"),
    ):
        cells = []
        for i in impls:
            seeds = _seeds(runs[i], key)
            cells.append(f"**{_num(summary['final'][i][key])}**" + (f" ({seeds})" if seeds else ""))
        cells += [f"**{_x(summary['ratio'][f'final_{key}'])}**"] if both else []
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    cells = [_num(summary["wall_s"][i], 1) for i in impls] + ([_x(summary["ratio"]["wall_s"])] if both else [])
    lines.append("| wall s per run | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Epoch rows: the mAP50-95 each tool's own validator wrote to results.csv during training (mean over "
        "seeds). best.pt rows: every run's best.pt scored by detrain's COCO-exact validator with the same "
        f"flags for both ({', '.join(f'{k}={v}' for k, v in VAL_FLAGS.items())}, rectangular batches); "
        "mean over seeds, per seed in brackets. Wall time: the whole training process (start-up, label "
        "checks, per-epoch validation, and Ultralytics' final re-validation of best.pt).",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", choices=("shapes", "coco128"), default="shapes")
    p.add_argument("--impls", default="detrain,ultralytics", help="comma-separated: detrain, ultralytics")
    p.add_argument(
        "--model",
        choices=("yolov8n", "yolo11n", "yolo26n"),
        default="yolov8n",
        help="the architecture both tools build from scratch (ignored with --weights)",
    )
    p.add_argument("--epochs", type=int, help=f"default {DEFAULTS['epochs']} ({QUICK['epochs']} with --quick)")
    p.add_argument("--imgsz", type=int, help=f"default {DEFAULTS['imgsz']} ({QUICK['imgsz']} with --quick)")
    p.add_argument("--batch", type=int, help=f"default {DEFAULTS['batch']} ({QUICK['batch']} with --quick)")
    p.add_argument("--workers", type=int, help=f"loader workers, default {DEFAULTS['workers']}")
    p.add_argument("--seeds", help=f"comma-separated, default {DEFAULTS['seeds']} ({QUICK['seeds']} with --quick)")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads for both tools (0: each tool's default: detrain all cpus, Ultralytics min(8, cpus - 1))",
    )
    p.add_argument(
        "--weights",
        type=Path,
        help="start both tools from this Ultralytics checkpoint, YOLOv8, YOLO11 or YOLO26 (e.g. "
        "../shared/weights/yolov8n.pt: fine-tuning) instead of training --model from scratch",
    )
    p.add_argument(
        "--detrain-args",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="extra detrain train arguments (ablations; they name the run folder)",
    )
    p.add_argument("--n-train", type=int, help=f"shapes: train images, default {DEFAULTS['n_train']}")
    p.add_argument("--n-val", type=int, help=f"shapes: val images, default {DEFAULTS['n_val']}")
    p.add_argument("--gen-imgsz", type=int, help=f"shapes: generated image size, default {DEFAULTS['gen_imgsz']}")
    p.add_argument("--val-fraction", type=float, default=0.25, help="coco128: held-out fraction")
    p.add_argument("--split-seed", type=int, default=0, help="coco128: seed of the train/val permutation")
    p.add_argument("--all-epochs", action="store_true", help="a table row for every epoch")
    p.add_argument("--reuse", action="store_true", help="keep finished runs (and their scores) instead of retraining")
    p.add_argument("--quick", action="store_true", help="smoke run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench_learning", help="data, runs and logs")
    p.add_argument("--out", type=Path, help="also write the table as markdown here")
    p.add_argument("--json", type=Path, help="raw numbers (default: --out with .json, else in the work folder)")
    p.add_argument("--timeout", type=float, default=24 * 3600, help="seconds one child may run")
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="train up to this many runs of the same tool at once (give each core one: with --threads 1 "
        "on 2 cores, --parallel 2); the tools never overlap, so each side's wall times are taken "
        "under the same conditions",
    )
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.seed_list = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    args.impl_list = [s.strip() for s in args.impls.split(",") if s.strip()]
    unknown = set(args.impl_list) - set(IMPLS)
    if unknown or not args.impl_list:
        p.error(f"--impls: unknown {sorted(unknown)}; valid: {', '.join(IMPLS)}")
    if not args.seed_list:
        p.error("--seeds: give at least one seed")
    if args.parallel < 1:
        p.error("--parallel: at least 1")
    return args


def ultralytics_version(work: Path) -> str | None:
    """Ultralytics' version when it is importable, asked of a child: importing it here would set
    OMP_NUM_THREADS=1 in this process's environment, which every later child (detrain's too) would inherit."""
    code = "import ultralytics; print(ultralytics.__version__)"
    done = subprocess.run([sys.executable, "-c", code], env=child_env(work, 0), capture_output=True, text=True)
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None


def command_line(argv: list[str] | None) -> str:
    """How this benchmark was started, PYTHONPATH included when set."""
    args = sys.argv[1:] if argv is None else argv
    script = os.path.relpath(__file__, Path.cwd()) if Path(__file__).is_relative_to(Path.cwd()) else __file__
    prefix = f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else ""
    return f"{prefix}python {script} {shlex.join(args)}".rstrip()


def machine(ultra: str | None) -> dict[str, Any]:
    import torch

    import detrain

    return {
        "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "detrain": detrain.__version__,
        "ultralytics": ultra,
        "date": datetime.date.today().isoformat(),
    }


def header_lines(
    args: argparse.Namespace,
    data: Dataset,
    info: dict[str, Any],
    runs: dict[str, list[Run]],
    load: tuple[float, float],
    command: str,
) -> list[str]:
    used = [
        f"{LABELS[i]} torch threads {rs[0].threads}, loader workers {rs[0].workers}"
        for i, rs in runs.items()
        if rs and rs[0].threads is not None
    ]
    return [
        "## Learning: detrain vs Ultralytics, "
        f"{f'fine-tuned from {args.weights.name}' if args.weights else args.model + ' from scratch'} ({args.dataset})",
        "",
        f"`{command}`",
        "",
        f"- machine: {info['cpus']} CPUs ({info['cpu']}), python {info['python']}, torch {info['torch']}, "
        f"detrain {info['detrain']}, ultralytics {info['ultralytics'] or 'not importable'}; {info['date']}; "
        f"load average {load[0]:.1f} -> {load[1]:.1f}",
        f"- data: {data.note}",
        f"- settings: epochs {args.epochs}, imgsz {args.imgsz}, batch {args.batch}, workers {args.workers}, seeds "
        f"{', '.join(map(str, args.seed_list))}, device cpu, every other setting at each tool's default"
        + (f"; detrain also {' '.join(args.detrain_args)}" if args.detrain_args else "")
        + (f"; {args.parallel} runs of the same tool at a time" if args.parallel > 1 else "")
        + (f"; as run: {'; '.join(used)}" if used else ""),
    ]


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    work = args.work.absolute()
    work.mkdir(parents=True, exist_ok=True)
    impls = list(args.impl_list)
    ultra = ultralytics_version(work) if "ultralytics" in impls else None
    if "ultralytics" in impls and ultra is None:
        print("ultralytics is not importable (try PYTHONPATH=/opt/ulib): benchmarking detrain only", file=sys.stderr)
        impls.remove("ultralytics")
    if not impls:
        return None
    if args.dataset == "shapes":
        data = prepare_shapes(work, args.n_train, args.n_val, args.gen_imgsz)
    else:
        found = prepare_coco128(work, SHARED_COCO128, args.val_fraction, args.split_seed)
        if found is None:
            print(
                f"coco128 skipped: {SHARED_COCO128} not found (the shared data beside the repository)", file=sys.stderr
            )
            return None
        data = found
    command = command_line(argv)
    load0 = os.getloadavg()[0]
    runs: dict[str, list[Run]] = {i: [] for i in impls}
    if args.parallel == 1:
        for seed in args.seed_list:  # one run at a time: each tool gets the whole machine
            for impl in impls:
                runs[impl].append(train_run(impl, data, args, seed, work))
    else:  # the seeds of one tool side by side, the tools one after the other
        for impl in impls:
            with ThreadPoolExecutor(args.parallel) as pool:
                runs[impl] = list(
                    pool.map(lambda seed, impl=impl: train_run(impl, data, args, seed, work), args.seed_list)
                )
    for impl in impls:
        for run in runs[impl]:
            score_run(run, data, args, work)
    load = (load0, os.getloadavg()[0])
    summary = summarize(runs, selected_epochs(args.epochs, args.all_epochs))
    info = machine(ultra)
    text = render_markdown(runs, summary, header_lines(args, data, info, runs, load, command))
    print("\n" + text)
    report = {
        "command": command,
        "machine": info,
        "load_average": load,
        "dataset": asdict(data) | {"yaml": str(data.yaml)},
        "settings": {k: getattr(args, k) for k in ("epochs", "imgsz", "batch", "workers", "threads")}
        | {"seeds": args.seed_list, "val": VAL_FLAGS},
        "runs": {i: [asdict(r) for r in rs] for i, rs in runs.items()},
        "summary": summary,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    json_file = args.json or (args.out.with_suffix(".json") if args.out else work / data.tag / "bench_learning.json")
    json_file.parent.mkdir(parents=True, exist_ok=True)
    json_file.write_text(json.dumps(report, indent=2, default=str))
    print(f"raw numbers: {json_file}" + (f"; table: {args.out}" if args.out else ""))
    return report


if __name__ == "__main__":
    main()
