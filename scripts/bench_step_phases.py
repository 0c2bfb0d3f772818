"""Where one training step's time goes: forward, the loss's assignment, its scoring, backward and the optimizer step,
each timed on its own (the device synchronised between phases), for detrain's model of each family.

The step is ``bench_train.py``'s (its batch, model, loss and SGD); each phase's median over ``--iters`` steps after
``--warmup``, in ms, under autocast to ``--dtype`` on CUDA. Synchronising between phases costs a little, so the phases
add up to slightly more than ``bench_train.py``'s step; what they show is which phase to work on.

    python scripts/bench_step_phases.py --device cuda --families yolov8,yolo26 --imgsz 640 --batch 16 --dtype bf16
    python scripts/bench_step_phases.py --imgsz 160 --batch 4 --iters 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_train as bt

PHASES = ("forward", "assign", "score", "backward", "optimizer")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def phases(family: str, args: argparse.Namespace) -> dict[str, float]:
    """Median ms per phase of detrain's step for ``family``."""
    device = torch.device(args.device)
    batch = bt.make_batch(args.batch, args.imgsz, 80, 4, device, seed=0)
    parts = bt.detrain_parts(bt.parse_args(["--family", family, "--scale", "n", "--nc", "80"]), batch, device)
    model, imgs, criterion, optimizer = parts.model, parts.imgs, parts.criterion, parts.optimizer
    dtype = DTYPES[args.dtype]
    times: dict[str, list[float]] = {p: [] for p in PHASES}

    def timed(name: str, fn: Callable[..., Any], *fn_args: Any) -> Any:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = fn(*fn_args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times[name].append((time.perf_counter() - start) * 1000)
        return out

    for _ in range(args.warmup + args.iters):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            out = timed("forward", model, imgs)
            targets = timed("assign", criterion.assign, out, batch.batch_idx, batch.cls, batch.bboxes_xywhn)
            loss, _ = timed("score", criterion.score, targets, None, None)
        timed("backward", loss.backward)
        timed("optimizer", optimizer.step)
    return {p: statistics.median(t[args.warmup :]) for p, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default="yolov8,yolo11,yolo26")
    p.add_argument("--device", default="cpu")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="autocast dtype (CUDA)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    print(f"{args.device}, {args.dtype}, imgsz {args.imgsz}, batch {args.batch}: median ms of {args.iters} steps")
    print("| family | " + " | ".join(PHASES) + " | sum |")
    print("|---|" + "---:|" * (len(PHASES) + 1))
    for family in args.families.split(","):
        ms = phases(family, args)
        print(f"| {family}n | " + " | ".join(f"{ms[p]:.1f}" for p in PHASES) + f" | {sum(ms.values()):.1f} |")


if __name__ == "__main__":
    main()
