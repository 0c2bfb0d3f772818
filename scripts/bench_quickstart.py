"""What the README's quick start gives on a fresh machine: its exact training command, in a fresh folder.

The built-in shapes set is generated into an empty datasets folder (``DETRAIN_DATASETS_DIR``), as on a machine
that never ran detrain, and the run goes into an empty project folder. The table gives mAP50 and mAP50-95 of
every 5th epoch and the last (detrain's own validation of the EMA weights, ``results.csv``), over ``--seeds``
(the quick start uses the default seed 0), and the wall time. The header names the host (CPU model, the
instruction set torch's kernels use, torch's version, the load): the same commit and seed give other figures on
another CPU (oneDNN picks its convolution kernels by instruction set, so the rounding differs, and 25 epochs on 256
images carry that into the final mAP as a change of seed does), and a shared machine's load stretches the wall time.

    python scripts/bench_quickstart.py                 # the quick start as written: imgsz=160 epochs=25
    python scripts/bench_quickstart.py --seeds 0,1,2   # how much the figure moves with the seed
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICK_START = ["imgsz=160", "epochs=25", "device=cpu"]  # README.md, "Quick start"


def run(seed: int, work: Path, extra: list[str]) -> tuple[list[dict[str, float]], float, str]:
    """Train once as the quick start does; (results.csv rows, wall seconds, command)."""
    work.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "DETRAIN_DATASETS_DIR": str(work / "datasets"),
        "DETRAIN_PROGRESS": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    cmd = [
        sys.executable,
        "-m",
        "detrain.cli",
        "train",
        *QUICK_START,
        f"seed={seed}",
        f"project={work / 'runs'}",
        f"name=seed{seed}",
        "exist_ok=True",
        *extra,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"{shlex.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    with open(work / "runs" / f"seed{seed}" / "results.csv", newline="") as f:
        rows = [{k.strip(): float(v) for k, v in row.items() if k and v} for row in csv.DictReader(f)]
    return rows, wall, shlex.join(["detrain", "train", *QUICK_START, f"seed={seed}", *extra])


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (or ``cpuinfo``, its text), else what platform knows."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def host() -> str:
    """Where a figure was measured, for the table's header: the figures depend on the CPU's kernels and the wall
    time on the machine's load, so two tables compare only where this line agrees (see the module docstring)."""
    import torch

    load = f", load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return (
        f"{cpu_model()} ({os.cpu_count()} CPUs, torch kernels {torch.backends.cpu.get_cpu_capability()}), "
        f"torch {torch.__version__}{load}"
    )


def commit() -> str:
    """The checkout's commit, marked ``+dirty`` when tracked files differ from it ('unknown' outside git)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0", help="comma-separated seeds (the quick start runs seed 0)")
    p.add_argument("extra", nargs="*", help="more key=value arguments for detrain train (default: none)")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    results = []
    where = host()  # before training: the load the runs start under
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            rows, wall, cmd = run(seed, Path(tmp) / f"s{seed}", args.extra)
            results.append((seed, rows, wall, cmd))
            print(f"seed {seed}: {wall:.0f} s, final mAP50 {rows[-1]['metrics/mAP50']:.3f}", flush=True)
    epochs = len(results[0][1])
    shown = sorted(set(range(5, epochs + 1, 5)) | {1, epochs})
    extra = " " + " ".join(args.extra) if args.extra else ""
    print(
        f"\n`python scripts/bench_quickstart.py --seeds {args.seeds}{extra}`"
        f" — {time.strftime('%Y-%m-%d')}, {platform.machine()}, {where}, commit {commit()}, command: "
        f"`{results[0][3]}`\n"
    )
    print("| seed | " + " | ".join(f"epoch {e}" for e in shown) + " | wall s |")
    print("|---" * (len(shown) + 2) + "|")
    for seed, rows, wall, _ in results:
        cells = [f"{rows[e - 1]['metrics/mAP50']:.3f} / {rows[e - 1]['metrics/mAP50-95']:.3f}" for e in shown]
        print(f"| {seed} | " + " | ".join(cells) + f" | {wall:.0f} |")
    print("\n(cells: mAP50 / mAP50-95)")


if __name__ == "__main__":
    main()
