"""How long a save blocks the training loop (issue 36 item 4): the seconds rank 0's loop spends in an epoch's save
(:meth:`Checkpointer.gather` + :meth:`Checkpointer.save_epoch`: ``last.pt``, its generation before kept as
``last.prev.pt``, and ``best.pt``), written synchronously (before: serialise, write, fsync, rename in the loop's
thread) and in the background (now: a host copy of the state in the loop, the files written by the writer's thread,
detrain/engine/train/state/writer.py), for model scales at an image size, on the CPU.

The real Checkpointer of a one-process run writes into a scratch run folder; the model (``yolov8<scale>``, 80
classes) has its EMA and an SGD optimizer whose momentum buffers are filled, as after the first update. Between two
saves the weights change in place and the loop "trains" for ``--gap`` seconds (a sleep, so that the writer's thread
has the CPU to itself, as it has while a GPU trains): with saves further apart than a write takes, the next save
never waits for the one before. The two ways take turns, a synchronous save then a background one, so that the load
of a shared machine falls on both alike. ``write`` is how long a background save took until the writer's thread had
written its files (the snapshot included); the run's files are removed at the end.

    python scripts/bench_save_block.py --scales n x --imgsz 640 --saves 3 --gap 10
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from detrain.config.cfg import make_cfg
from detrain.distributed.world import World
from detrain.engine.train.ema import ModelEMA
from detrain.engine.train.state import resume_state
from detrain.engine.train.state.checkpointer import Checkpointer, Loop, Parts
from detrain.engine.train.state.writer import Writer
from detrain.nn.model import DetectionModel


def _parts(scale: str) -> Parts:
    torch.manual_seed(0)
    model = DetectionModel("yolov8.yaml", scale=scale, nc=80)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.937, nesterov=True)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()  # the momentum buffers exist, as after the first update
    optimizer.zero_grad(set_to_none=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0)
    return Parts(model, ModelEMA(model), optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False))


def _checkpointer(scale: str, imgsz: int, background: bool, root: Path) -> Checkpointer:
    mode = "background" if background else "sync"
    cfg = make_cfg({"model": f"{scale}.yaml", "imgsz": imgsz, "project": str(root), "name": f"{scale}-{mode}"})
    launch = resume_state.Launch(None, None, 0, 0, False)
    ckpt = Checkpointer(resume_state.Start(cfg, None, None, launch), World(), torch.device("cpu"))
    ckpt.writer = Writer(background=background)
    ckpt.open_folder(cfg)
    return ckpt


def _saves(scale: str, imgsz: int, saves: int, gap: float, root: Path) -> dict[str, float]:
    """Both ways in turn (a synchronous save, then a background one, ``saves`` times: the machine's load falls on
    both alike): the seconds the loop was blocked by each save (median, max), the writer's seconds per save, and
    last.pt's size."""
    parts = _parts(scale)
    runs = {background: _checkpointer(scale, imgsz, background, root) for background in (False, True)}
    blocked: dict[bool, list[float]] = {False: [], True: []}
    writes = []
    for epoch in range(saves):
        for background, ckpt in runs.items():
            with torch.no_grad():
                for p in parts.model.parameters():
                    p.add_(1e-4)  # a step's change, in place: the save must hold the weights as they were
            loop = Loop(ckpt.cfg, batches_per_epoch=100, accumulate=1, step_images=16, best_fitness=0.0)
            start = time.perf_counter()
            ckpt.gather(parts, False)
            ckpt.save_epoch(parts, loop, epoch, {"fitness": float(epoch)}, improved=True)
            blocked[background].append(time.perf_counter() - start)
            thread = ckpt.writer._thread  # the write in flight (background)
            if thread is not None:
                thread.join()
                writes.append(time.perf_counter() - start)
            time.sleep(gap)  # the loop trains meanwhile
    out: dict[str, float] = {"params_m": sum(p.numel() for p in parts.model.parameters()) / 1e6, "write_s": 0.0}
    for background, ckpt in runs.items():
        ckpt.drain()
        last = ckpt.wdir / "last.pt"
        assert torch.load(last, map_location="cpu", weights_only=True)["epoch"] == saves - 1
        out["mb"] = last.stat().st_size / 1e6
        if ckpt.lock is not None:
            ckpt.lock.release()
        shutil.rmtree(ckpt.save_dir, ignore_errors=True)
        mode = "bg" if background else "sync"
        out[f"{mode}_s"], out[f"{mode}_max_s"] = statistics.median(blocked[background]), max(blocked[background])
    out["write_s"] = statistics.median(writes)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", nargs="+", default=["n", "x"])
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--saves", type=int, default=3, help="epoch saves per scale and mode (the median is shown)")
    parser.add_argument("--gap", type=float, default=10.0, help="seconds of 'training' between two saves")
    parser.add_argument("--dir", default=None, help="where the scratch run folders go (default: a temporary folder)")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_save_block_"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    header = "| scale | params | last.pt | sync: loop blocked per save | background: loop blocked per save | write |"
    rows = [header, "|---|---|---|---|---|---|"]
    for scale in args.scales:
        r = _saves(scale, args.imgsz, args.saves, args.gap, root)
        rows.append(
            f"| {scale} | {r['params_m']:.1f} M | {r['mb']:.0f} MB | {r['sync_s']:.2f} s (max {r['sync_max_s']:.2f}) | "
            f"{r['bg_s']:.2f} s (max {r['bg_max_s']:.2f}) | {r['write_s']:.2f} s |"
        )
        print(rows[-1], flush=True)
    print(f"\nimgsz {args.imgsz}, {args.saves} epoch saves each (last.pt + last.prev.pt + best.pt), gap {args.gap:g} s")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
