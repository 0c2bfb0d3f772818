"""Tiny worker functions for the distributed tests.

Spawned workers import their entry by name, so these live at the top level of an importable module.
Every worker takes one dict and the World its launcher hands it, and returns something small and picklable.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from detrain.distributed import dist
from detrain.distributed.world import World


def collectives(args: dict[str, Any], world: World) -> dict[str, Any]:
    """Exercise every collective; return what this rank saw."""
    info = dist.setup(world, timeout_s=args.get("timeout_s", 30.0))
    r, w = dist.rank(), dist.world_size()
    total = dist.all_reduce_sum(torch.tensor([float(r + 1)]))
    mean = dist.reduce_mean(torch.tensor([float(r)]))
    gathered = dist.all_gather_object({"rank": r})
    shared = dist.broadcast_object(f"from-{r}", src=0)
    branch = dist.agree(r == 0)  # rank 0 says True; everyone must take the same branch
    dist.barrier("end")
    return {
        "rank": r,
        "world": w,
        "local_rank": dist.local_rank(),
        "device": info.device,
        "backend": info.backend,
        "sum": total.item(),
        "mean": mean.item(),
        "gathered": gathered,
        "shared": shared,
        "agree": branch,
        "main": dist.is_main(),
        "threads": torch.get_num_threads(),
    }


def report(args: dict[str, Any], world: World) -> dict[str, Any]:
    """Join the world, check it with one all-reduce, report rank/world (used by torchrun and 2-node tests)."""
    dist.setup(world, timeout_s=30.0)
    total = dist.all_reduce_sum(torch.ones(1)).item()
    return {"rank": dist.rank(), "world": dist.world_size(), "sum": total, "pid": os.getpid()}


def die_once(args: dict[str, Any], world: World) -> dict[str, Any]:
    """Rank 1 SIGKILLs itself on the first attempt; after the restart everyone finishes."""
    dist.setup(world, timeout_s=20.0)
    marker = Path(args["marker"])
    if dist.rank() == 1 and world.restart_count == 0 and not marker.exists():
        marker.write_text("died")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier("after restart")
    return {"rank": dist.rank(), "restarts": world.restart_count}


def die_always(args: dict[str, Any], world: World) -> None:
    """Rank 1 is killed; rank 0 waits in a collective (its peer's death ends the run)."""
    dist.setup(world, timeout_s=20.0)
    if dist.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier("never passed")


def raise_error(args: dict[str, Any], world: World) -> None:
    """Rank 1 raises a plain Python error with a recognisable message (one of detrain's with ``detrain``)."""
    dist.setup(world, timeout_s=20.0)
    if dist.rank() == 1:
        if args.get("detrain"):
            from detrain.errors import DatasetError

            raise DatasetError("no data here")
        raise ValueError("boom from rank 1")
    dist.barrier("never passed")


def hang(args: dict[str, Any], world: World) -> None:
    """Rank 1 sleeps forever before the all-reduce; rank 0's all-reduce must time out."""
    dist.setup(world, timeout_s=args["timeout_s"])
    Path(args["pidfile"] + f".{dist.rank()}").write_text(str(os.getpid()))
    if dist.rank() == 1:
        while True:
            time.sleep(1)
    dist.all_reduce_sum(torch.ones(1))


# NCCL's watchdog line for a collective that waited 6 s (torch 2.4-2.14 wording; the [rankN]: prefix of the newer)
NCCL_WATCHDOG_LINE = (
    "[rank0]:[E1126 10:00:00.000000000 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=6000) ran for 6004 "
    "milliseconds before timing out.\n"
)


def nccl_watchdog_abort(args: dict[str, Any], world: World) -> None:
    """What NCCL's watchdog does to a rank whose collective waits for one that froze: rank 1 freezes (its heartbeat
    stops, it sleeps); rank 0, ``wait_s`` later, logs the watchdog's line on its stderr descriptor (as torch's C++
    logging does) and aborts (SIGABRT), with no Python error and no error file."""
    from detrain.distributed import heartbeat

    dist.setup(world, timeout_s=30.0)
    if dist.rank() == 1:
        heartbeat.stop()
        while True:
            time.sleep(1)
    time.sleep(args["wait_s"])
    os.write(2, NCCL_WATCHDOG_LINE.encode())
    os.abort()


def late_to_barrier(args: dict[str, Any], world: World) -> None:
    """Rank ``late`` reaches the 'end of epoch' barrier 5 s after the others, with a 1 s training timeout."""
    dist.setup(world, timeout_s=1.0)
    dist.barrier("start")
    if dist.rank() == args["late"]:
        time.sleep(5.0)
    dist.barrier("end of epoch")


def sleep_forever(args: dict[str, Any], world: World) -> None:
    """Every rank writes its pid and sleeps: used to test Ctrl-C."""
    dist.setup(world, timeout_s=30.0)
    Path(args["pidfile"] + f".{dist.rank()}").write_text(str(os.getpid()))
    while True:
        time.sleep(1)


def listeners(args: dict[str, Any], world: World) -> list[dict[str, Any]]:
    """Join the world and pass one all-reduce (gloo's connections are up), then every rank lists the sockets its
    process listens on, rank 0 also its launcher's (the parent, which hosts the rendezvous store), and the
    interface variables it ran with; rank 0 gets everyone's."""
    from _sockets import listening

    dist.setup(world, timeout_s=30.0)
    dist.all_reduce_sum(torch.ones(1))
    mine: dict[str, Any] = {
        "rank": dist.rank(),
        "listening": listening(os.getpid()),
        "env": {k: os.environ.get(k, "") for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR")},
    }
    if dist.rank() == 0:
        mine["launcher"] = listening(os.getppid())
    everyone = dist.all_gather_object(mine)
    dist.barrier("listed")  # nobody leaves (closing its sockets) before every rank has looked
    return everyone


def device_env(args: dict[str, Any], world: World) -> dict[str, Any]:
    """The device the launcher handed this worker in its World, who that World says launched it, and every
    ``DETRAIN_DEVICE*`` variable in its environment (there should be none: no device travels that way)."""
    return {
        "device_vars": sorted(k for k in os.environ if k.startswith("DETRAIN_DEVICE")),
        "omp": os.environ.get("OMP_NUM_THREADS", ""),
        "world_device": world.device,
        "world_omp": world.omp_threads,
        "launcher": world.launcher,
    }


def ram_cache_batches(args: dict[str, Any], world: World) -> list[dict[str, Any]]:
    """Build the training loader with cache=ram (one loader worker), take two batches; every rank's view."""
    import glob

    from detrain.config.cfg import make_cfg
    from detrain.data.prepare import build_train_loader, load_split
    from detrain.engine.train.batch_plan import check_split

    dist.setup(world, timeout_s=60.0)
    cfg = make_cfg(
        {
            "data": args["data"],
            "imgsz": 64,
            "batch": args["batch"],
            "workers": 1,
            "cache": "ram",
            "epochs": 3,
            "seed": 0,
        }
    )
    data = load_split(args["data"], "train", cfg, verbose=False)
    loader = build_train_loader(data, cfg, check_split(cfg.train.batch, world.world_size), world)
    cache = loader.dataset._ram
    it = iter(loader)
    batches = [next(it)["img"] for _ in range(2)]
    worker_pids = [w.pid for w in it._workers]
    seen = {
        "rank": dist.rank(),
        "pid": os.getpid(),
        "stem": cache.stem,
        "owner_pid": cache.owner_pid,
        "modes": (os.stat(os.path.dirname(cache.stem)).st_mode & 0o777, os.stat(cache.path).st_mode & 0o777),
        "files": sorted(glob.glob(f"{os.path.dirname(cache.stem)}/detrain-ram-*.bin")),
        "start_method": loader.multiprocessing_context.get_start_method(),
        "worker_maps_cache": [_maps(pid, cache.stem) for pid in worker_pids],
        "batches": batches,
    }
    everyone = dist.all_gather_object(seen)
    del it, loader
    return everyone


def slow_prepare(args: dict[str, Any], world: World) -> int:
    """``load_split`` under a 2 s training timeout while rank ``slow_rank`` (the first process of its node) takes
    4 s to prepare the dataset, as a download or a large label check would; returns the number of records."""
    from unittest import mock

    from detrain.config.cfg import make_cfg
    from detrain.data import prepare as engine_data

    dist.setup(world, timeout_s=2.0)
    cfg = make_cfg({"data": args["data"], "dist_timeout": 2, "prepare_timeout": args["prepare_timeout"]})
    real = engine_data.load_dataset_yaml

    def slow(*a: Any, **k: Any) -> Any:
        time.sleep(4.0)
        return real(*a, **k)

    with mock.patch.object(engine_data, "load_dataset_yaml", slow if dist.rank() == args["slow_rank"] else real):
        return len(engine_data.load_split(args["data"], "train", cfg, verbose=False).records)


def _maps(pid: int, stem: str) -> bool:
    """Whether process ``pid`` has the cache file mapped."""
    with open(f"/proc/{pid}/maps") as f:
        return any(f"{stem}.bin" in line for line in f)


def _main(argv: list[str]) -> int:
    """Entry points for the tests that need a process of their own.

    * ``torchrun OUT``: run under ``python -m torch.distributed.run``; launch() must join that world;
    * ``node NODE_RANK PORT OUT NNODES [ENTRY ARGS_JSON]``: one of two "nodes" on 127.0.0.1 (one CPU worker
      each) running ``report`` or the worker ``ENTRY`` of this module;
    * ``sleep PIDFILE``: two CPU workers that sleep until Ctrl-C.
    """
    import json

    import _dist_workers as mod  # by module name, so spawned workers can import the entry

    from detrain.distributed.launch.launcher import launch, parse_device

    mode = argv[0]
    if mode == "torchrun":
        result = launch(mod.report, {}, parse_device("cpu"))
        assert result is not None
        result["launcher_pid"] = os.getpid()
        Path(f"{argv[1]}.{result['rank']}").write_text(json.dumps(result))
    elif mode == "node":
        node_rank, port, out, nnodes = int(argv[1]), int(argv[2]), argv[3], argv[4]
        entry, entry_args = (getattr(mod, argv[5]), json.loads(argv[6])) if len(argv) > 5 else (mod.report, {})
        result = launch(entry, entry_args, parse_device("cpu"), nnodes=nnodes, node_rank=node_rank, master_port=port)
        Path(f"{out}.{node_rank}").write_text(json.dumps(result))
    elif mode == "sleep":
        try:
            launch(mod.sleep_forever, {"pidfile": argv[1]}, parse_device("cpu,cpu"))
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))


def pending_grads(args: dict[str, Any], world: World) -> dict[str, Any]:
    """Each rank's own gradients (rank r: r + 1 everywhere, no gradient for one parameter on rank 1) are replaced
    by their mean over the ranks; rank 0 returns what it then holds."""
    from detrain.engine.train import accumulation

    dist.setup(world, timeout_s=30.0)
    net = torch.nn.Linear(3, 2)
    net.weight.grad = torch.full_like(net.weight, float(dist.rank() + 1))
    net.bias.grad = None if dist.rank() == 1 else torch.full_like(net.bias, 4.0)
    accumulation.load_flat_gradients(net, dist.reduce_mean(accumulation.flat_gradients(net)))  # as the trainer does
    return {k: v.tolist() for k, v in accumulation.saved(net).items()}


def auto_batch(args: dict[str, Any], world: World) -> dict[str, Any]:
    """AutoBatch on two ranks whose fake GPUs differ (rank 1 has half the memory): what each chose."""
    from _fake_gpu import FakeMemory, fake_steps

    from detrain.engine.train.auto_batch import GIB, pick_batch

    dist.setup(world, timeout_s=30.0)
    memory = FakeMemory(available_bytes=(70 if dist.rank() == 0 else 35) * GIB, name=f"fake:{dist.rank()}")
    said: list[str] = []
    chosen = pick_batch(-1, torch.device("cpu"), fake_steps, dist.world_size(), 10_000, said.append, memory)
    dist.barrier("end")
    return {"rank": dist.rank(), "batch": chosen, "said": said, "all": dist.all_gather_object(chosen)}


def ema_buffers(args: dict[str, Any], world: World) -> dict[str, Any]:
    """Two ranks train a BatchNorm net under DDP on their own data (an accumulating batch, then the batch that updates)
    and the EMA takes the model as the trainer gives it (``share``: through ``parallel.share_main_buffers``). Rank 0
    returns every rank's EMA running mean, and its own model's before the share."""
    from detrain.distributed import parallel
    from detrain.engine.train.ema import ModelEMA

    dist.setup(world, timeout_s=30.0)
    torch.manual_seed(0)
    bare = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4))
    model = parallel.wrap(bare, world, torch.device("cpu"), sync_bn=False)
    ema = ModelEMA(bare, tau=1.0)
    opt = torch.optim.SGD(bare.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + dist.rank())  # each rank its own images
    for will_step in (False, True):
        with parallel.gradient_sync(model, will_step):
            model(torch.randn(2, 3, 4, 4, generator=data) * (dist.rank() + 1)).square().mean().backward()
    opt.step()
    own = bare[1].running_mean.tolist()
    ema.update(parallel.share_main_buffers(model) if args["share"] else model)
    return {"own": own, "ema": dist.all_gather_object(ema.ema[1].running_mean.tolist())}
