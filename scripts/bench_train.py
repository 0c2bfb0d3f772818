"""Training-step throughput: forward + loss + backward + optimizer step on random images.

Times detrain's DetectionModel of a family (``--family``: yolov8, yolo11 or yolo26) with its own loss (the head
seam's criterion: DetectionLoss, or YOLO26's EndToEndLoss) and SGD, using the update kernel detrain's trainer
picks (fused where torch has one). When ``ultralytics`` is importable (it is never a dependency; e.g.
``PYTHONPATH=/path/to/ulib``), its DetectionModel of the same family and scale is timed the same way, with the loss
it picks for it (v8DetectionLoss or E2ELoss) and the plain SGD its trainer uses on CPU, in the same process, and
the throughput ratio is printed. The two are timed in alternating blocks and summarised by the median step, so load
from other processes on a shared machine hits both alike.

Example::

    python scripts/bench_train.py --scale n --imgsz 320 --batch 8 --iters 20 --warmup 3 --threads 2
    python scripts/bench_train.py --family yolo26 --scale n --imgsz 320 --batch 8 --threads 2
    python scripts/bench_train.py --compile default --no-ultralytics --imgsz 320 --batch 8 --threads 2

``--compile MODE`` also times detrain's step with its model compiled in place as ``compile=MODE`` trains it
(``nn.Module.compile``; aot_eager: the tracing backend, no code generation), beside the eager one, and prints each
one's first step: the compile cost a run pays once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout too

from detrain.config.keys import Loss
from detrain.engine.train.recipe.optim import kernel_options
from detrain.nn.model import DetectionModel

EPOCHS = 100  # the run length a loss with a schedule (YOLO26's) is built for; both sides at its first epoch


@dataclass
class Batch:
    """Random images in [0, 1] and a few random boxes per image, in the loss contract's flat layout."""

    imgs: torch.Tensor  # (B, 3, H, W) float
    batch_idx: torch.Tensor  # (M,)
    cls: torch.Tensor  # (M, 1)
    bboxes_xywhn: torch.Tensor  # (M, 4)


def make_batch(batch: int, imgsz: int, nc: int, boxes_per_image: int, device: torch.device, seed: int) -> Batch:
    """A reproducible random batch.

    >>> b = make_batch(2, 64, 80, 3, torch.device("cpu"), 0); b.imgs.shape, b.bboxes_xywhn.shape
    (torch.Size([2, 3, 64, 64]), torch.Size([6, 4]))
    """
    g = torch.Generator().manual_seed(seed)
    m = batch * boxes_per_image
    centres = torch.rand(m, 2, generator=g) * 0.6 + 0.2
    sizes = torch.rand(m, 2, generator=g) * 0.35 + 0.05
    return Batch(
        imgs=torch.rand(batch, 3, imgsz, imgsz, generator=g).to(device),
        batch_idx=torch.arange(batch).repeat_interleave(boxes_per_image).float().to(device),
        cls=torch.randint(0, nc, (m, 1), generator=g).float().to(device),
        bboxes_xywhn=torch.cat((centres, sizes), 1).to(device),
    )


def _sgd(model: torch.nn.Module, **kernel: bool) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=0.01, momentum=0.937, nesterov=True, weight_decay=5e-4, **kernel)


@dataclass
class DetrainParts:
    """What a detrain training step is made of: the model, its input batch in the model's memory format, its loss
    and its optimizer."""

    model: DetectionModel
    imgs: torch.Tensor
    criterion: Any
    optimizer: torch.optim.Optimizer


def detrain_parts(
    args: argparse.Namespace, batch: Batch, device: torch.device, compile_mode: str | None = None
) -> DetrainParts:
    """detrain's model of ``args.family`` and ``args.scale`` (seeded: every call starts from the same weights), its
    loss at the schedule's first epoch and the SGD the trainer would build; with ``compile_mode``, the model
    compiled in place as the trainer's ``compile=`` does."""
    torch.manual_seed(0)  # the eager and the compiled model start from the same weights
    model = DetectionModel(f"{args.family}{args.scale}.yaml", nc=args.nc).to(device).train()
    imgs = batch.imgs
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
        imgs = imgs.contiguous(memory_format=torch.channels_last)
    if compile_mode == "aot_eager":
        model.compile(backend="aot_eager")
    elif compile_mode is not None:
        model.compile(mode=None if compile_mode == "default" else compile_mode)
    criterion = model.criterion(asdict(Loss()), epochs=EPOCHS)
    criterion.set_epoch(0)
    # the update kernel detrain's trainer picks (engine/optim.py: fused where torch has one)
    optimizer = _sgd(model, **kernel_options(list(model.parameters())))
    return DetrainParts(model, imgs, criterion, optimizer)


def detrain_step(
    args: argparse.Namespace, batch: Batch, device: torch.device, compile_mode: str | None = None
) -> Callable[[], torch.Tensor]:
    """One detrain training step (it returns its loss) as a closure over :func:`detrain_parts`."""
    parts = detrain_parts(args, batch, device, compile_mode)
    model, imgs, criterion, optimizer = parts.model, parts.imgs, parts.criterion, parts.optimizer

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        targets = criterion.assign(model(imgs), batch.batch_idx, batch.cls, batch.bboxes_xywhn)
        loss, _ = criterion.score(targets, None, None)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def ultralytics_step(args: argparse.Namespace, batch: Batch, device: torch.device) -> Callable[[], torch.Tensor] | None:
    """The same step with Ultralytics' model of the family and the loss it picks, or None when it is not
    installed."""
    os.environ.setdefault("YOLO_OFFLINE", "1")  # never reach the network from a benchmark
    os.environ.setdefault("YOLO_VERBOSE", "False")
    try:
        from ultralytics.nn.tasks import DetectionModel as UltralyticsModel
    except ImportError:
        return None
    model = UltralyticsModel(f"{args.family}{args.scale}.yaml", nc=args.nc, verbose=False).to(device).train()
    model.args = SimpleNamespace(**asdict(Loss()), epochs=EPOCHS)  # the loss reads its gains (detrain's) from here
    criterion = model.init_criterion()
    optimizer = _sgd(model)  # Ultralytics' trainer asks for no fused/foreach kernel on CPU
    # Ultralytics trains in the default (contiguous) memory format; it is timed as it trains
    data = {"img": batch.imgs, "batch_idx": batch.batch_idx, "cls": batch.cls, "bboxes": batch.bboxes_xywhn}

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss, _ = criterion(model(batch.imgs), data)
        loss.sum().backward()
        optimizer.step()
        return loss.detach().sum()

    return step


def _timed(step: Callable[[], object], n: int, device: torch.device, clock: Callable[[], float]) -> list[float]:
    times = []
    for _ in range(n):
        start = clock()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((clock() - start) * 1000)
    return times


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="yolov8", choices=("yolov8", "yolo11", "yolo26"))
    p.add_argument("--scale", default="n", choices=list("nsmlx"))
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=20, help="timed steps per implementation")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per implementation first")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument(
        "--channels-last",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="detrain in channels_last memory format (default: on)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--nc", type=int, default=80)
    p.add_argument("--boxes", type=int, default=4, help="random boxes per image")
    p.add_argument("--block", type=int, default=5, help="steps per alternating block")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this process's CPU time, a fair measure on a shared machine with --threads 1",
    )
    p.add_argument("--no-ultralytics", action="store_true", help="time detrain only")
    p.add_argument(
        "--compile",
        default=None,
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "aot_eager"),
        help="also time detrain compiled in this torch.compile mode (as compile=MODE trains), and the first steps",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    batch = make_batch(args.batch, args.imgsz, args.nc, args.boxes, device, seed=0)

    steps: dict[str, Callable[[], object]] = {"detrain": detrain_step(args, batch, device)}
    if args.compile:
        steps["detrain+compile"] = detrain_step(args, batch, device, args.compile)
    if not args.no_ultralytics:
        theirs = ultralytics_step(args, batch, device)
        if theirs is None:
            print("ultralytics is not importable: timing detrain only", file=sys.stderr)
        else:
            steps["ultralytics"] = theirs

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    first = {name: _timed(step, 1, device, clock)[0] for name, step in steps.items()}  # compiles, if compiled
    for step in steps.values():
        _timed(step, args.warmup, device, clock)
    times: dict[str, list[float]] = {name: [] for name in steps}
    remaining = args.iters
    while remaining > 0:  # alternate, so a burst of outside load lands on both
        n = min(args.block, remaining)
        for name, step in steps.items():
            times[name] += _timed(step, n, device, clock)
        remaining -= n

    detrain_layout = "channels_last" if args.channels_last else "contiguous"
    layout = {"detrain": detrain_layout, "detrain+compile": detrain_layout, "ultralytics": "contiguous"}
    print(
        f"{args.family}{args.scale}  imgsz {args.imgsz}  batch {args.batch}  threads {torch.get_num_threads()}  "
        f"device {device}  iters {args.iters}  warmup {args.warmup}  clock {args.clock}"
    )
    print(f"{'impl':<16} {'layout':<14} {'first ms':>10} {'median ms':>10} {'mean ms':>9} {'min ms':>8} {'img/s':>8}")
    throughput = {}
    for name, ms in times.items():
        median = statistics.median(ms)
        throughput[name] = args.batch / (median / 1000)
        print(
            f"{name:<16} {layout[name]:<14} {first[name]:>10.1f} {median:>10.1f} {statistics.fmean(ms):>9.1f} "
            f"{min(ms):>8.1f} "
            f"{throughput[name]:>8.1f}"
        )
    if "ultralytics" in throughput:
        print(f"throughput ratio detrain / ultralytics: {throughput['detrain'] / throughput['ultralytics']:.2f}x")
    if "detrain+compile" in throughput:
        print(f"throughput ratio compiled / eager: {throughput['detrain+compile'] / throughput['detrain']:.2f}x")


if __name__ == "__main__":
    main()
