"""Total resident memory of a ``cache=ram`` training run on 1 rank and on 2 ranks (same global batch), and of
Ultralytics' ``cache=ram`` on the same ranks when it is importable (e.g. ``PYTHONPATH=/opt/ulib``).

Each run is a fresh ``python`` process that does what ``detrain train`` does with ``device=cpu`` or
``device=cpu,cpu``: one rank in the process itself, or two ranks started by
``detrain.distributed.launch.launcher.launch`` (torch's elastic agent). Every rank verifies the labels, builds the
training loader of ``detrain.data.prepare`` with ``cache=ram`` and ``--workers`` loader workers, and runs
``--steps`` training steps of YOLOv8 ``--scale`` (the DDP model, loss and SGD of a real run) on its slice of each
global batch. The Ultralytics run builds its own ``YOLODataset(cache="ram")`` and ``InfiniteDataLoader`` on each rank
instead, and trains the same detrain model.

Memory is sampled every ``--interval`` s over the whole process tree (the launcher, the ranks and their loader
workers) from ``/proc/<pid>/smaps``: the sum of every process's proportional set size (PSS: a page shared by k
processes counts 1/k in each, so shared pages count once), except that the RAM cache file in ``/dev/shm``
counts by the pages it holds (``st_blocks``) instead of by the mapped part of it. The table gives the peak.

The train images are listed ``--repeat`` times (distinct symlinks in a temporary folder) so the cache is as
large as a real dataset's would be next to the per-process overhead of torch.

    python scripts/bench_ram_cache.py                                 # coco128 x 8, imgsz 640, 4 steps
    PYTHONPATH=/opt/ulib python scripts/bench_ram_cache.py --repeat 16 --steps 0
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import glob
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_data import mirror, train_images, ultralytics_importable, ultralytics_loader  # noqa: E402

if TYPE_CHECKING:
    from detrain.distributed.world import World

# this user's private folders, the usual one and the fallbacks (detrain/data/memory/private_dir.py)
CACHE_GLOBS = (f"/dev/shm/detrain-{os.geteuid()}/detrain-ram-*", f"/dev/shm/detrain-{os.geteuid()}-*/detrain-ram-*")
KB = 1024


# ---------------------------------------------------------------- memory of a process tree


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in (...) may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def pss_bytes(pid: int) -> tuple[int, int]:
    """(PSS of every mapping, PSS of the mappings of detrain's RAM cache files) of one process, in bytes."""
    total = cache = 0
    in_cache = False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if line.startswith("Pss:"):
                    kb = int(line.split()[1]) * KB
                    total += kb
                    cache += kb if in_cache else 0
                elif "-" in line.split(" ", 1)[0] and line[0] in "0123456789abcdef":  # a mapping's header line
                    parts = line.split(None, 5)
                    in_cache = len(parts) == 6 and any(fnmatch.fnmatch(parts[5].rstrip("\n"), g) for g in CACHE_GLOBS)
    except (OSError, ValueError):
        pass  # the process ended while being read
    return total, cache


def cache_file_bytes() -> int:
    """Pages held in /dev/shm by detrain's RAM cache files (allocated blocks: a file still filling is sparse)."""
    total = 0
    for path in (p for g in CACHE_GLOBS for p in glob.glob(g)):
        with contextlib.suppress(OSError):  # a file removed since the glob
            total += os.stat(path).st_blocks * 512
    return total


class TreeMemory:
    """Samples a process tree's memory in a thread and keeps the peak."""

    def __init__(self, root: int, interval: float):
        self.root, self.interval = root, interval
        self.peak: dict[str, int] = {"total": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> dict[str, int]:
        pids = descendants(self.root)
        mapped = cache_mapped = 0
        for pid in pids:
            t, c = pss_bytes(pid)
            mapped, cache_mapped = mapped + t, cache_mapped + c
        cache = cache_file_bytes()
        return {"total": mapped - cache_mapped + cache, "cache": cache, "processes": len(pids)}

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            s = self.sample()
            if s["total"] > self.peak["total"]:
                self.peak = s


# ---------------------------------------------------------------- what every rank runs


def rank_main(args: dict[str, Any], here: World) -> dict[str, Any]:
    """Build the cached loader (detrain's or Ultralytics'), run the training steps, return what rank 0 saw."""
    import torch

    from detrain.config.keys import Loss
    from detrain.distributed import dist
    from detrain.engine.train.batch_plan import check_split
    from detrain.nn.loss import DetectionLoss, LossGains
    from detrain.nn.model import DetectionModel

    dist.setup(here, timeout_s=1800.0)
    world, rank = here.world_size, here.rank
    local_batch = check_split(args["batch"], world)
    t0 = time.perf_counter()
    if args["impl"] == "ultralytics":
        loader = _ultralytics_loader(args, local_batch, rank, world)
    else:
        loader = _detrain_loader(args, local_batch, here)
    dist.barrier("loaders built")
    build_s = time.perf_counter() - t0

    torch.manual_seed(0)
    model = DetectionModel(scale=args["scale"], nc=80).train()
    criterion = DetectionLoss(
        80,
        model.stride,
        reg_max=model.reg_max,
        gains=LossGains(**asdict(Loss())),
        normalizer_reduce=dist.all_reduce_sum if world > 1 else None,
        world_size=world,
    )
    net: torch.nn.Module = model
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.937, nesterov=True)
    batches = 0
    it = iter(loader)
    for _ in range(max(args["steps"], 1)):
        batch = next(it)
        batches += 1
        if args["steps"] == 0:
            break  # loader only: one batch so that every worker has started and read the cache
        optimizer.zero_grad(set_to_none=True)
        loss, _ = criterion(
            net(batch["img"].float() / 255),
            batch["batch_idx"],
            batch["cls"].view(-1, 1),
            batch["bboxes"],
            global_batch=args["batch"],
        )
        loss.backward()
        optimizer.step()
    dist.barrier("steps done")
    time.sleep(2 * args["interval"] + 0.5)  # let the sampler see the settled state before anything is freed
    dist.barrier("sampled")
    return {"build_s": build_s, "batches": batches}


def _detrain_loader(args: dict[str, Any], local_batch: int, world: World) -> Any:
    from detrain.config.cfg import make_cfg
    from detrain.data.prepare import build_train_loader, load_split

    cfg = make_cfg(
        {
            "data": args["yaml"],
            "imgsz": args["imgsz"],
            "batch": args["batch"],
            "workers": args["workers"],
            "cache": "ram",
            "epochs": 100,
        }
    )
    data = load_split(args["yaml"], "train", cfg, verbose=world.is_main)
    return build_train_loader(data, cfg, local_batch, world)


def _ultralytics_loader(args: dict[str, Any], local_batch: int, rank: int, world: int) -> Any:
    import multiprocessing

    # Ultralytics starts its ranks with torchrun, whose ranks fork their loader workers; ours are spawned by the
    # elastic agent and would spawn them (a fresh torch import per worker) unless told otherwise.
    multiprocessing.set_start_method("fork", force=True)
    names = {int(k): v for k, v in args["names"].items()}
    # Each rank builds and caches its own dataset, as Ultralytics' DDP trainer does.
    build = ultralytics_loader(
        Path(args["folder"]), names, args["imgsz"], local_batch, cache="ram", rank=rank if world > 1 else -1
    )
    assert build is not None, "ultralytics is not importable"
    return build(args["workers"])


# ---------------------------------------------------------------- one run, in its own process


def child(ns: argparse.Namespace) -> None:
    from detrain.distributed.launch.launcher import launch, parse_device

    args = json.loads(ns.child)
    result = launch(rank_main, args, parse_device(",".join(["cpu"] * args["ranks"])))
    print("RESULT " + json.dumps(result), flush=True)


def measure(args: dict[str, Any], interval: float, log: Path) -> dict[str, Any]:
    """Start one run and sample its tree until it ends."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps(args)], stdout=out, stderr=subprocess.STDOUT, env=env
        )
        with TreeMemory(proc.pid, interval) as mem:
            rc = proc.wait(timeout=3600)
    text = log.read_text()
    results = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if rc != 0 or not results:
        raise SystemExit(f"{args['impl']} with {args['ranks']} rank(s) failed (exit {rc}):\n{text[-8000:]}")
    return {**json.loads(results[-1][len("RESULT ") :]), **mem.peak}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "coco128.yaml"))
    p.add_argument("--repeat", type=int, default=8, help="how many times each train image is listed")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch", type=int, default=16, help="global batch, split over the ranks")
    p.add_argument("--workers", type=int, default=2, help="loader workers per rank")
    p.add_argument("--steps", type=int, default=4, help="training steps per run (0: build the loader only)")
    p.add_argument("--scale", default="n")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between memory samples")
    p.add_argument(
        "--impls",
        nargs="+",
        choices=["detrain", "ultralytics"],
        default=["detrain", "ultralytics"],
        help="loaders to measure (ultralytics only where it is importable)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.child:
        child(ns)
        return

    images, names = train_images(ns.data)
    impls = [i for i in ns.impls if i != "ultralytics" or ultralytics_importable()]
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_ram_cache_") as tmp:
        folder = Path(tmp)
        n = len(mirror(images, ns.repeat, folder / "data"))
        yaml_file = folder / "data.yaml"
        yaml_file.write_text(
            json.dumps({"path": str(folder / "data"), "train": "images/train", "val": "images/train", "names": names})
        )
        for impl in impls:
            for ranks in (1, 2):
                args = {
                    "impl": impl,
                    "ranks": ranks,
                    "yaml": str(yaml_file),
                    "folder": str(folder / "data"),
                    "names": names,
                    "imgsz": ns.imgsz,
                    "batch": ns.batch,
                    "workers": ns.workers,
                    "steps": ns.steps,
                    "scale": ns.scale,
                    "interval": ns.interval,
                }
                row = measure(args, ns.interval, folder / f"{impl}-{ranks}.log")
                rows[(impl, ranks)] = row
                print(
                    f"{impl}, {ranks} rank(s): peak {row['total'] / 1e9:.2f} GB over {row['processes']} processes "
                    f"(cache files {row['cache'] / 1e9:.2f} GB); loader built in {row['build_s']:.0f} s",
                    flush=True,
                )

    print(
        f"\n{n} images ({len(images)} files x {ns.repeat}), imgsz {ns.imgsz}, global batch {ns.batch}, "
        f"{ns.workers} loader workers per rank, {ns.steps} training steps of YOLOv8{ns.scale}; "
        f"peak total PSS of the process tree; {os.cpu_count()} CPUs"
    )
    print("| loader | ranks | processes | peak memory GB | of which detrain's shared cache GB | vs 1 rank |")
    print("|---|---|---|---|---|---|")
    for impl in impls:
        one = rows[(impl, 1)]["total"]
        for ranks in (1, 2):
            r = rows[(impl, ranks)]
            shared = f"{r['cache'] / 1e9:.2f}" if impl == "detrain" else "-"
            print(
                f"| {impl} | {ranks} | {r['processes']} | {r['total'] / 1e9:.2f} | {shared} | {r['total'] / one:.2f}x |"
            )


if __name__ == "__main__":
    main()
