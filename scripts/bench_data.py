"""Images per second of the training dataloader (mosaic on, imgsz 640, batch 16), and of Ultralytics' when it is
importable (e.g. ``PYTHONPATH=/opt/ulib``), with the same settings and worker counts.

The train images of the dataset yaml are listed many times over (``--repeat``, as distinct symlinks in a
temporary folder, labels beside them) so that it behaves like a large dataset: no loader can serve a mosaic
partner from a decoded-image buffer of the same file, and Ultralytics' label cache lands in the temporary
folder, not beside the real labels. Both loaders run alternately, ``--rounds`` times; the table shows the best
round of each (the machine may be shared: the best round is the least disturbed one).

What is timed is the steady state of a long run: ``--warmup`` batches are drawn first, enough for each loader
to fill what it keeps between batches (Ultralytics' mosaic buffer: 8 batches; detrain's decode cache: a pool
window of 4 batches on each of 8 sampler lanes, 32 batches on one worker), once per worker and run.

``--augment-device gpu`` adds detrain with ``augment_device=gpu``: the workers plan and label, the images are
decoded and drawn on ``--device`` (default the first GPU, else the CPU) as the trainer draws them, and timed up to
a synchronised device (``--device none``: not drawn, the rate of the workers alone).

    python scripts/bench_data.py                       # ../shared/data/coco8.yaml, workers 1 and 2
    PYTHONPATH=/opt/ulib python scripts/bench_data.py --workers 1 2 4 --batches 60
    python scripts/bench_data.py --augment-device cpu gpu --workers 2 4 8
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GPU = "detrain-gpu"  # detrain with augment_device=gpu
sys.path.insert(0, str(REPO))


def mirror(images: list[str], repeat: int, folder: Path) -> list[str]:
    """``repeat`` distinct symlinks per image under folder/images/train, with labels under folder/labels/train."""
    (folder / "images" / "train").mkdir(parents=True)
    (folder / "labels" / "train").mkdir(parents=True)
    out = []
    for im in images:
        src = Path(im)
        label = Path(str(src.parent).replace(f"{os.sep}images", f"{os.sep}labels", 1)) / f"{src.stem}.txt"
        for j in range(repeat):
            dst = folder / "images" / "train" / f"{src.stem}_r{j:04d}{src.suffix}"
            dst.symlink_to(src.resolve())
            if label.exists():
                (folder / "labels" / "train" / f"{dst.stem}.txt").symlink_to(label.resolve())
            out.append(str(dst))
    return sorted(out)


def train_images(data: str) -> tuple[list[str], dict[int, str]]:
    """The train images and class names of a dataset yaml."""
    from detrain.data.dataset_yaml import load_dataset_yaml

    info = load_dataset_yaml(data, download=False)
    return list(info.train), dict(info.names)


def ultralytics_importable() -> bool:
    """Whether Ultralytics can be compared against here (e.g. with ``PYTHONPATH=/opt/ulib``)."""
    try:
        import ultralytics  # noqa: F401
    except ImportError:
        return False
    return True


def records_for(files: list[str], nc: int) -> list[Any]:
    """Verified label records."""
    from detrain.data.labels.verify import load_labels

    records, _ = load_labels(files, nc, cache=False, progress=False)
    return records


def endless(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def images_per_second(
    loader: Any,
    warmup: int,
    batches: int,
    done: Callable[[Any], None] = lambda b: None,
    draw: Callable[[Any], Any] = lambda b: b,
) -> float:
    """Images per second drawn as a training loop draws them; ``draw(batch)`` is what the loop does first with a
    batch (``augment_device=gpu``: its images drawn on the device), ``done(batch)`` what it does once a step has
    finished with it (detrain's trainer releases it: its worker may fill the memory again)."""
    it = endless(loader)
    for _ in range(warmup):  # worker start-up, the first prefetches, the buffers filling
        done(draw(next(it)))
    t0, n = time.perf_counter(), 0
    for _ in range(batches):
        batch = draw(next(it))
        n += len(batch["img"]) if isinstance(batch, dict) else len(batch)  # a DeviceBatch left undrawn
        done(batch)
    return n / (time.perf_counter() - t0)


def device_draw(device: str) -> Callable[[Any], Any]:
    """``draw`` for ``augment_device=gpu``: the batch's images drawn on ``device``, waited for; ``none``: left
    undrawn (what the loader's workers alone hand over)."""
    import torch

    if device == "none":
        return lambda batch: batch
    dev = torch.device(device)

    def draw(batch: Any) -> Any:
        out = batch.render(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return out

    return draw


def detrain_loader(
    files: list[str], names: dict[int, str], imgsz: int, batch: int, augment_device: str = "cpu"
) -> Callable[[int], Any]:
    from detrain.config.keys import Augment
    from detrain.data.dataset import DetectionDataset
    from detrain.data.loader import build_dataloader

    dataset = DetectionDataset(
        records_for(files, len(names)),
        imgsz=imgsz,
        augment=True,
        hyp=Augment(mosaic=1.0),
        batch_size=batch,
        augment_device=augment_device,
    )
    return lambda workers: build_dataloader(dataset, batch, shuffle=True, workers=workers)


def ultralytics_loader(
    folder: Path, names: dict[int, str], imgsz: int, batch: int, cache: str | bool = False, rank: int = -1
) -> Callable[[int], Any] | None:
    """``build(workers)`` for Ultralytics' training loader on folder/images/train (per-rank ``batch``; ``rank``
    -1 outside DDP), or None where Ultralytics is not importable."""
    try:
        from ultralytics.cfg import get_cfg
        from ultralytics.data.build import build_dataloader, build_yolo_dataset
    except ImportError:
        return None
    data = {
        "path": str(folder),
        "train": str(folder / "images" / "train"),
        "val": str(folder / "images" / "train"),
        "names": names,
        "nc": len(names),
        "channels": 3,
    }

    def build(workers: int) -> Any:
        cfg = get_cfg(overrides={"imgsz": imgsz, "batch": batch, "workers": workers, "cache": cache, "mosaic": 1.0})
        dataset = build_yolo_dataset(cfg, data["train"], batch, data, mode="train", stride=32)
        return build_dataloader(dataset, batch, workers, shuffle=True, rank=rank)

    return build


def _watchdog(seconds: float) -> None:
    """If a measurement hangs, print where every process of it stands (this one and its loader workers), then
    exit with an error instead of waiting for the outer timeout."""
    import faulthandler
    import multiprocessing
    import signal
    import threading

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # inherited by forked workers

    def fire() -> None:
        time.sleep(seconds)
        print(f"no result after {seconds:.0f} s; stacks follow", file=sys.stderr, flush=True)
        for proc in multiprocessing.active_children():
            os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(2)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)

    threading.Thread(target=fire, daemon=True).start()


def child(args: argparse.Namespace) -> None:
    """One measurement: build loader ``args.child`` with ``args.child_workers`` workers, print its images/s."""
    _watchdog(300)
    folder = Path(args.folder)
    _, names = train_images(args.data)
    files = sorted(glob.glob(str(folder / "images" / "train" / "*")))
    if args.child.startswith("detrain"):
        build = detrain_loader(files, names, args.imgsz, args.batch, "gpu" if args.child == GPU else "cpu")
    else:
        build = ultralytics_loader(folder, names, args.imgsz, args.batch)
        if build is None:
            print(json.dumps({"ips": None}))
            return
    loader = build(args.child_workers)
    if args.child.startswith("detrain"):
        from detrain.data.memory.batch_memory import release_batch

        draw = device_draw(args.device) if args.child == GPU else (lambda b: b)

        def done(batch: Any) -> None:
            if isinstance(batch, dict):  # not an undrawn DeviceBatch (--device none)
                release_batch(batch)

        ips = images_per_second(loader, args.warmup, args.batches, done, draw)
    else:
        ips = images_per_second(loader, args.warmup, args.batches)
    del loader  # stop the workers before reporting
    import gc

    gc.collect()
    print(json.dumps({"ips": ips}), flush=True)


def measure(args: argparse.Namespace, folder: Path, name: str, workers: int) -> float | None:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        name,
        "--child-workers",
        str(workers),
        "--folder",
        str(folder),
        "--data",
        args.data,
        "--imgsz",
        str(args.imgsz),
        "--batch",
        str(args.batch),
        "--batches",
        str(args.batches),
        "--warmup",
        str(args.warmup),
        "--device",
        args.device,
    ]
    # Output to a file, not a pipe: a pipe would also wait for any worker process that outlives the measurement.
    with tempfile.TemporaryFile("w+") as out:
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=600).returncode
        except subprocess.TimeoutExpired:
            rc = -1
        out.seek(0)
        text = out.read()
    lines = [line for line in text.splitlines() if line.startswith("{")]
    if rc != 0 or not lines:
        raise SystemExit(f"{name} with {workers} workers failed (exit {rc}):\n{text[-20000:]}")
    return json.loads(lines[-1])["ips"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "coco8.yaml"))
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat", type=int, default=400, help="how many times each train image is listed")
    p.add_argument("--batches", type=int, default=40, help="timed batches per run")
    p.add_argument("--warmup", type=int, default=40, help="batches drawn before timing (buffers filling)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--augment-device", nargs="+", choices=["cpu", "gpu"], default=["cpu"], help="detrain's modes")
    p.add_argument(
        "--device",
        default="",
        help="where augment_device=gpu draws ('' = cuda if available, else cpu; none: not drawn, the workers alone)",
    )
    p.add_argument("--child", choices=["detrain", GPU, "ultralytics"], help=argparse.SUPPRESS)
    p.add_argument("--child-workers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.device:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        child(args)
        return

    images, _ = train_images(args.data)
    names = [{"cpu": "detrain", "gpu": GPU}[mode] for mode in args.augment_device]
    names += ["ultralytics"] if ultralytics_importable() else []
    best: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        folder = Path(tmp)
        n = len(mirror(images, args.repeat, folder))
        load0 = os.getloadavg()[0]
        for _ in range(args.rounds):
            for workers in args.workers:
                for name in names:
                    ips = measure(args, folder, name, workers)
                    best[(name, workers)] = max(best.get((name, workers), 0.0), ips or 0.0)
        load1 = os.getloadavg()[0]

    print(
        f"\n{n} images ({len(images)} files x {args.repeat}), imgsz {args.imgsz}, batch {args.batch}, mosaic 1.0, "
        f"best of {args.rounds} rounds of {args.batches} batches after {args.warmup}; {os.cpu_count()} CPUs, "
        f"load average {load0:.1f} -> {load1:.1f}"
    )
    ours = [name for name in names if name != "ultralytics"]
    print(f"{GPU}: drawn on {args.device}" if GPU in ours else "")
    print(f"| workers | {' | '.join(f'{name} img/s' for name in ours)} | ultralytics img/s | ratio |")
    print("|---|" + "---|" * (len(ours) + 2))
    for workers in args.workers:
        theirs = best.get(("ultralytics", workers))
        cells = [f"{best[(name, workers)]:.1f}" for name in ours]
        ratio = " / ".join(f"{best[(name, workers)] / theirs:.2f}x" for name in ours) if theirs else "-"
        print(f"| {workers} | {' | '.join(cells)} | {f'{theirs:.1f}' if theirs else 'not importable'} | {ratio} |")


if __name__ == "__main__":
    main()
