"""Memory per rank of training a detector under DDP and under ``parallel=fsdp``: parameters, gradients, optimizer
state (SGD's momentum, AdamW's two moments), the EMA, and activations, for yolov8/yolo11/yolo26 at scales n..x.

Parameters, gradients and optimizer state are counted from the model (float32, 4 bytes an element): under DDP
every rank holds them whole; under fsdp each rank holds 1/W of each (a parameter's rows are split in
ceil(rows / W)-row chunks, so a rank holds at most that), plus the whole weights of the layer running now (its
all-gather: the largest layer is the bound; ``fully_shard`` may prefetch the next one, so up to twice that). The
EMA stays whole on every rank under both (detrain.engine.train.ema says why).

Activations are measured: one training forward at batch 1 on the CPU, every tensor autograd saves for the backward
counted once (``torch.autograd.graph.saved_tensors_hooks``; parameters left out, each storage counted once, views
included in theirs). That is what the backward must keep, whatever the parallel choice: fsdp shards no activation.
Per rank they scale with the images of its batch.

Example::

    python scripts/bench_fsdp_memory.py                      # 640, all families and scales
    python scripts/bench_fsdp_memory.py --imgsz 640 1280 --worlds 2 8
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout too

from detrain.nn.model import DetectionModel

FAMILIES = ("yolov8", "yolo11", "yolo26")
SCALES = ("n", "s", "m", "l", "x")
FLOAT = 4  # bytes of a float32 element
MB = 2**20


@dataclass(frozen=True)
class Counts:
    """One model's element counts: every parameter, the trainable ones, the largest layer's, and the rows-rounded
    largest per-rank share at each world size (fsdp)."""

    params: int
    trainable: int
    largest_layer: int
    shard: dict[int, int]
    shard_trainable: dict[int, int]


def counts(model: DetectionModel, worlds: list[int]) -> Counts:
    """Element counts of ``model`` (see :class:`Counts`); a rank's share of a tensor of n rows is ceil(n / W)
    rows, as ``fully_shard`` splits it (rank 0 holds that many, the last ranks may hold fewer)."""
    params = list(model.parameters())

    def share(p: torch.Tensor, w: int) -> int:
        rows = p.shape[0] if p.dim() else 1
        return -(-rows // w) * (p.numel() // max(rows, 1))

    return Counts(
        params=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        largest_layer=max(sum(p.numel() for p in layer.parameters()) for layer in model.model),
        shard={w: sum(share(p, w) for p in params) for w in worlds},
        shard_trainable={w: sum(share(p, w) for p in params if p.requires_grad) for w in worlds},
    )


def activation_bytes(model: nn.Module, imgsz: int) -> int:
    """Bytes of the tensors one training forward at batch 1 saves for its backward (parameters excluded; each
    storage once)."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    model.train()
    x = torch.rand(1, 3, imgsz, imgsz)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    del out  # the graph (and what it saved) goes with it
    return sum(seen.values())


def rank_bytes(c: Counts, world: int | None, adamw: bool) -> dict[str, float]:
    """MB per rank of parameters, gradients and optimizer state; ``world`` None: DDP (whole), else fsdp."""
    p = c.params if world is None else c.shard[world]
    g = c.trainable if world is None else c.shard_trainable[world]
    return {"params": p * FLOAT / MB, "grads": g * FLOAT / MB, "optim": g * FLOAT * (2 if adamw else 1) / MB}


def row(family: str, scale: str, imgszs: list[int], worlds: list[int]) -> list[str]:
    """One table row: the model, its parameters, DDP's and fsdp's per-rank states, the EMA, the largest layer and
    the measured activations per image at each size."""
    torch.manual_seed(0)
    model = DetectionModel(f"{family}.yaml", scale=scale, nc=80)
    c = counts(model, worlds)
    cells = [f"{family}{scale}", f"{c.params / 1e6:.1f}"]
    for adamw in (False, True):
        ddp = rank_bytes(c, None, adamw)
        cells.append(f"{sum(ddp.values()):.0f}")
        for w in worlds:
            cells.append(f"{sum(rank_bytes(c, w, adamw).values()):.0f}")
    cells += [f"{c.params * FLOAT / MB:.0f}", f"{c.largest_layer * FLOAT / MB:.0f}"]
    for imgsz in imgszs:
        cells.append(f"{activation_bytes(model, imgsz) / MB:.0f}")
    return cells


def _give_back_memory() -> None:
    """Free what the last model's forward left to the C allocator: one process measuring every model at 1280 grew
    to 22 GB (glibc keeps freed blocks) and was killed on a 23 GB machine at yolo26l, where a fresh process peaks
    at 5.9 GB."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--imgsz", type=int, nargs="+", default=[640])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--scales", nargs="+", default=list(SCALES))
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    ws = a.worlds
    head = ["model", "params (M)"]
    for opt in ("SGD", "AdamW"):
        head += [f"{opt} P+G+O DDP"] + [f"{opt} P+G+O fsdp W={w}" for w in ws]
    head += ["EMA (both)", "largest layer"] + [f"activations/image {s}" for s in a.imgsz]
    print("MB per rank (float32). P+G+O: parameters + gradients + optimizer state.")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    t0 = time.perf_counter()
    for family in a.families:
        for scale in a.scales:
            print("| " + " | ".join(row(family, scale, a.imgsz, ws)) + " |", flush=True)
            _give_back_memory()
    print(f"({time.perf_counter() - t0:.0f} s; torch {torch.__version__})")


if __name__ == "__main__":
    main()
