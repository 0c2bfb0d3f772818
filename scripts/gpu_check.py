"""One command that proves detrain's GPU paths on a machine with a GPU, and its CPU-safe parts anywhere.

Each check is a function that returns one row (check, status ok / skipped / failed with the reason, a one-line
result, its figures, seconds); the table is printed once, at the end, in markdown, and ``--json OUT`` writes the
rows. Training runs go through the real command (``python -m detrain.cli train``), each in its own process.

With CUDA (the whole run is sized for under 8 minutes on one GPU):

* ``versions``: torch, CUDA, cuDNN, NCCL, the GPU;
* ``train``: bf16 training on a synthetic 640 px set: images/s, data-wait share, GPU memory and utilisation,
  mAP50-95, every loss finite (from the run's results.csv);
* ``fp16``: the fp16 + gradient-scaler path: losses finite, the scaler's final scale;
* ``resume``: a run whose rank 0 is SIGKILLed right after writing ``mid.pt`` (``tests/_inject``'s rule, the test
  suite's own mechanism) and resumed, against an uninterrupted run, to within the GPU's own run-to-run difference
  (the uninterrupted run is trained twice to measure it). Two ranks on two GPUs (NCCL, DDP, SyncBatchNorm, the
  launcher's restart); with one GPU, one rank resumed by hand: NCCL refuses two ranks on one GPU ("Duplicate GPU
  detected", NCCL 2.5 and later);
* ``nccl-one-rank``: a one-rank NCCL group on the GPU: DDP around a SyncBatchNorm model, and every collective
  (the code paths and NCCL's setup; with one rank nothing travels between ranks);
* ``nccl-watchdog`` (two GPUs): how long NCCL's watchdog takes to abort a collective that a sleeping rank never
  joins, and whether detrain's launcher words (``nccl_watch``) recognise its line;
* ``ultralytics-step`` (when ``ultralytics`` is importable): one timed training step of detrain beside
  Ultralytics' in bf16, fp16 and fp32 (``scripts/bench_train.py``'s steps under autocast);
* ``compile``: detrain's step compiled (``compile=true``) against eager: first-step cost and step time.

``--cpu`` (automatic without CUDA, under a minute, run by the test suite): versions; a tiny training run (128 px);
the resume check on a 2-process gloo group (``device=cpu,cpu``, bitwise or within 1e-6); the GPU-only checks are
rows that say ``skipped: no CUDA``.

Example::

    python scripts/gpu_check.py --json gpu_check.json         # on a GPU machine
    python scripts/gpu_check.py --cpu --json gpu_check.json   # anywhere
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a source checkout too

INJECT = REPO / "tests" / "_inject"  # the test suite's fault rule (a sitecustomize that kills after mid.pt)
RUN_LIMIT_S = 240  # one training process that has not ended by then hangs
CPU_FLOOR = 1e-6  # on a CPU a resumed run matches bitwise, or within rounding of this size
WATCHDOG_TIMEOUT_S = 10  # the stuck collective's timeout in the watchdog check
LOSSES = ("train/box_loss", "train/cls_loss", "train/dfl_loss")
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


class Skip(Exception):
    """A check that cannot run here; its message is the reason the row gives."""


@dataclass
class Row:
    """One check's line of the table."""

    check: str
    status: str  # ok, skipped or failed
    result: str  # one line: what was found, or why it was skipped or failed
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class Context:
    """What every check may use: where to write, and what the machine has."""

    work: Path
    cuda: bool
    gpus: int
    outcome: dict[str, Any] = field(default_factory=dict)  # a check's findings that a later one reads


Check = Callable[[Context], tuple[str, dict[str, Any]]]  # returns (result line, figures); raises Skip or fails


# ---------------------------------------------------------------------------------------------- table and rows


def run_check(name: str, check: Check, ctx: Context) -> Row:
    """``check`` run and timed as one row: ok with its result, skipped (Skip) or failed (any other error, or an
    AssertionError whose message is the reason)."""
    start = time.perf_counter()
    try:
        result, figures = check(ctx)
        row = Row(name, "ok", result, figures)
    except Skip as e:
        row = Row(name, "skipped", str(e))
    except Exception as e:  # noqa: BLE001 (a failed check is a row, and the next check still runs)
        row = Row(name, "failed", f"{type(e).__name__}: {e}".splitlines()[0][:300])
    row.seconds = round(time.perf_counter() - start, 1)
    return row


def _figure(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(rows: list[Row]) -> str:
    """The rows as one markdown table; ``|`` inside a cell is escaped.

    >>> print(table([Row("versions", "ok", "torch 2.4", {"cuda": None, "x": 0.123456}, 0.04)]))
    | check | status | result | figures | s |
    |---|---|---|---|---|
    | versions | ok | torch 2.4 | cuda=None, x=0.1235 | 0.0 |
    """
    lines = ["| check | status | result | figures | s |", "|---|---|---|---|---|"]
    for r in rows:
        figures = ", ".join(f"{k}={_figure(v)}" for k, v in r.figures.items())
        cells = [r.check, r.status, r.result, figures, f"{r.seconds:.1f}"]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- weights compared


def max_weight_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest absolute difference between two checkpoints' model and EMA tensors; inf when their names,
    shapes or integer tensors differ (not the same run at all)."""
    worst = 0.0
    for key in ("model", "ema"):
        one, two = a[key]["state_dict"], b[key]["state_dict"]
        if one.keys() != two.keys():
            return math.inf
        for name, x in one.items():
            y = two[name]
            if x.shape != y.shape:
                return math.inf
            if not x.dtype.is_floating_point:
                if not torch.equal(x, y):
                    return math.inf
                continue
            if x.numel():
                worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


def within_noise(diff: float, noise: float, floor: float = CPU_FLOOR) -> bool:
    """Whether a resumed run's distance to the uninterrupted one (``diff``) is within the machine's own run-to-run
    difference (``noise``: two uninterrupted runs' distance; 0 on a CPU, where runs repeat bitwise), or within
    ``floor`` where that is smaller.

    >>> within_noise(0.0, 0.0), within_noise(3e-4, 5e-4), within_noise(1e-3, 5e-4), within_noise(5e-7, 0.0)
    (True, True, False, True)
    """
    return diff <= max(noise, floor)


# ---------------------------------------------------------------------------------------------- training runs


def child_env(**extra: str) -> dict[str, str]:
    """A training process's environment: this checkout first on the path, outside any launcher or SLURM job."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCH_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_", "TEST_FAULT"))
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def kill_after_mid_pt_env(epoch: int, next_batch: int) -> dict[str, str]:
    """The environment whose rank 0 (on the launcher's first attempt) SIGKILLs itself right after writing
    ``mid.pt`` of ``epoch`` at ``next_batch`` or later (tests/_inject/sitecustomize.py reads the rule)."""
    if not (INJECT / "sitecustomize.py").is_file():
        raise Skip(f"{INJECT} is absent (the kill rule lives in a source checkout's tests)")
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(INJECT), env["PYTHONPATH"]])
    env["TEST_FAULT"] = json.dumps({"after": "mid.pt", "epoch": epoch, "then": "kill", "next_batch": next_batch})
    return env


def train(args: dict[str, Any], env: dict[str, str] | None = None, ok: bool = True) -> tuple[str, int]:
    """``detrain train`` with ``args`` in its own process: (its output, its exit status); with ``ok``, a failed
    run is an AssertionError holding its last line."""
    cmd = [sys.executable, "-m", "detrain.cli", "train", *(f"{k}={v}" for k, v in args.items())]
    try:
        proc = subprocess.run(
            cmd, env=env or child_env(), cwd=REPO, capture_output=True, text=True, timeout=RUN_LIMIT_S
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(f"a training run did not end within {RUN_LIMIT_S} s") from None
    out = proc.stdout + proc.stderr
    if ok and proc.returncode != 0:
        last = [line for line in out.splitlines() if line.strip()][-1:] or ["no output"]
        raise AssertionError(f"training exited {proc.returncode}: {last[0]}")
    return out, proc.returncode


def results(run: Path) -> list[dict[str, str]]:
    with open(run / "results.csv") as f:
        return list(csv.DictReader(f))


def losses_finite(rows: list[dict[str, str]]) -> bool:
    """Every epoch's every loss column is a finite number (and there is at least one epoch)."""
    return bool(rows) and all(math.isfinite(float(r[c])) for r in rows for c in LOSSES if c in r)


def run_figures(rows: list[dict[str, str]]) -> dict[str, Any]:
    """The last epoch's throughput, data-wait share, GPU memory and utilisation (where recorded), and mAP50-95."""
    last = rows[-1]
    figures: dict[str, Any] = {
        "images_per_s": float(last["images_per_s"]),
        "data_wait_share": float(last["data_wait_share_slowest_rank"]),
        "mAP50-95": float(last["metrics/mAP50-95"]),
        "losses_finite": losses_finite(rows),
    }
    for column, name in (("node0/gpu_mem_gb", "gpu_mem_gb"), ("node0/gpu_util_pct", "gpu_util_pct")):
        if last.get(column):
            figures[name] = float(last[column])
    return figures


def shapes_set(ctx: Context, imgsz: int, n_train: int, n_val: int) -> Path:
    """The synthetic shapes set at ``imgsz``, generated once per size into the work folder; its data.yaml."""
    from detrain.data.synthetic import generate_shapes

    root = ctx.work / f"shapes{imgsz}"
    if not (root / "data.yaml").is_file():
        generate_shapes(root, n_train=n_train, n_val=n_val, imgsz=imgsz, seed=0)
    return root / "data.yaml"


def _common(ctx: Context, tag: str) -> dict[str, Any]:
    return dict(project=str(ctx.work / tag), name="run", exist_ok=True, plots=False, verbose=False, seed=0)


# ---------------------------------------------------------------------------------------------- the checks


def check_versions(ctx: Context) -> tuple[str, dict[str, Any]]:
    """torch, CUDA, cuDNN and NCCL as this torch was built and finds them; the GPU."""
    figures: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": None,
        "gpus": ctx.gpus,
    }
    if ctx.cuda:
        figures["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        figures["gpu"] = torch.cuda.get_device_name(0)
        figures["bf16"] = torch.cuda.is_bf16_supported()
    where = figures.get("gpu", f"CPU only ({platform.machine()}, {os.cpu_count()} cores)")
    return f"torch {torch.__version__} on {where}", figures


def check_train(ctx: Context) -> tuple[str, dict[str, Any]]:
    """A short training run: bf16 on a 640 px set on the GPU, float32 at 128 px on a CPU."""
    if ctx.cuda:
        data = shapes_set(ctx, 640, 256, 32)
        args = dict(data=data, epochs=3, imgsz=640, batch=32, workers=8, device=0, amp="bf16")
    else:
        data = shapes_set(ctx, 128, 16, 4)
        args = dict(data=data, epochs=1, imgsz=128, batch=8, workers=0, device="cpu", warmup_epochs=0)
    train({**args, **_common(ctx, "train")})
    rows = results(ctx.work / "train" / "run")
    figures = run_figures(rows)
    assert figures["losses_finite"], f"a loss is not finite: {rows[-1]}"
    assert figures["images_per_s"] > 0, "no images/s recorded"
    what = "bf16 at 640 px, 3 epochs of 256 images" if ctx.cuda else "float32 on the CPU at 128 px, 16 images"
    return f"{what}: {figures['images_per_s']:.1f} images/s, every loss finite", figures


def check_fp16(ctx: Context) -> tuple[str, dict[str, Any]]:
    """amp=fp16: the gradient scaler's path; its losses finite and its scale after the run."""
    if not ctx.cuda:
        raise Skip("no CUDA")
    data = shapes_set(ctx, 640, 256, 32)
    args = dict(data=data, epochs=1, imgsz=640, batch=32, workers=8, device=0, amp="fp16", val=False)
    train({**args, **_common(ctx, "fp16")})
    rows = results(ctx.work / "fp16" / "run")
    figures = run_figures(rows)
    last = torch.load(ctx.work / "fp16" / "run" / "weights" / "last.pt", map_location="cpu", weights_only=True)
    scaler = last.get("scaler") or {}
    figures["grad_scale"] = float(scaler.get("scale", float("nan")))
    assert figures["losses_finite"], f"a loss is not finite: {rows[-1]}"
    assert scaler, "last.pt holds no gradient scaler state: the fp16 path did not scale"
    return f"fp16 + GradScaler: every loss finite, final scale {figures['grad_scale']:g}", figures


def _resume_args(ctx: Context, devices: str) -> dict[str, Any]:
    data = shapes_set(ctx, 64, 16, 2)
    return dict(
        data=data, epochs=2, imgsz=64, batch=4, nbs=4, device=devices, workers=0, warmup_epochs=0,
        close_mosaic=0, val=False, optimizer="SGD",
    )  # fmt: skip


def _resumed_by_hand(ctx: Context, args: dict[str, Any], run: Path) -> str:
    """One rank: no launcher restarts it; the killed run is resumed from its own folder (mid.pt is the newer)."""
    killed = {**args, **_common(ctx, "resume-killed"), "save_interval": 1e-9}
    out, rc = train(killed, kill_after_mid_pt_env(0, 2), ok=False)
    assert rc == -signal.SIGKILL, f"the rank was not killed after mid.pt (exit {rc})"
    out, _ = train({"resume": run / "weights" / "last.pt", "device": args["device"]})
    return out


def check_resume(ctx: Context) -> tuple[str, dict[str, Any]]:
    """Rank 0 SIGKILLed right after mid.pt (batch 2 of epoch 2), resumed, against an uninterrupted run: two ranks
    on two GPUs or on a CPU's gloo, one rank on a single GPU."""
    return resume_on(ctx, ("0,1" if ctx.gpus >= 2 else "0") if ctx.cuda else "cpu,cpu", repeats=2 if ctx.cuda else 1)


def resume_on(ctx: Context, devices: str, repeats: int) -> tuple[str, dict[str, Any]]:
    """:func:`check_resume` on ``devices``, the uninterrupted run trained ``repeats`` times."""
    args = _resume_args(ctx, devices)
    straight = [ctx.work / f"resume-straight{i}" / "run" / "weights" / "last.pt" for i in range(repeats)]
    for path in straight:  # on a GPU twice: the run-to-run difference a resume is held to
        train({**args, **_common(ctx, path.parents[2].name)})
    run = ctx.work / "resume-killed" / "run"
    if "," in devices:  # the launcher restarts both ranks, which resume from mid.pt
        extra = {"save_interval": 1e-9, "max_restarts": 1}
        out, _ = train({**args, **_common(ctx, "resume-killed"), **extra}, kill_after_mid_pt_env(0, 2))
    else:
        out = _resumed_by_hand(ctx, args, run)
    assert f"resuming from {run / 'weights' / 'mid.pt'}" in out, "the run did not resume from mid.pt"

    def load(path: Path) -> dict[str, Any]:
        return torch.load(path, map_location="cpu", weights_only=True)

    reference = load(straight[0])
    noise = max_weight_diff(reference, load(straight[1])) if len(straight) > 1 else 0.0
    diff = max_weight_diff(reference, load(run / "weights" / "last.pt"))
    figures = {"ranks": devices.count(",") + 1, "max_abs_diff": diff, "run_to_run": noise}
    assert within_noise(diff, noise), f"resumed weights differ by {diff:.3g}, more than the run-to-run {noise:.3g}"
    how = "bitwise" if diff == 0 else f"within {max(noise, CPU_FLOOR):.3g}"
    return f"{figures['ranks']} rank(s) on {devices}: killed after mid.pt, resumed, {how} of uninterrupted", figures


def check_nccl_one_rank(ctx: Context) -> tuple[str, dict[str, Any]]:
    """A one-rank NCCL group in its own process (``--_nccl-one-rank``): DDP, SyncBatchNorm, every collective, and
    parallel=fsdp's sharding, steps and checkpoint gathers (:func:`fsdp_steps`)."""
    if not ctx.cuda:
        raise Skip("no CUDA")
    cmd = [sys.executable, __file__, "--_nccl-one-rank", str(_free_port())]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=180)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 0, f"exit {proc.returncode}: {lines[-1] if lines else 'no output'}"
    figures = json.loads(lines[-1])
    return "DDP(SyncBatchNorm model) and fsdp steps, every collective, on a one-rank NCCL group", figures


def one_rank_group(port: int, backend: str = "nccl") -> None:
    """``--_nccl-one-rank``: the worker of :func:`check_nccl_one_rank` (``backend`` gloo: the same on a CPU, which
    the test suite runs); prints its figures as one JSON line."""
    import torch.distributed as tdist
    from torch import nn

    from detrain.nn.model import DetectionModel

    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tdist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timedelta(seconds=60),
        device_id=device if device.type == "cuda" else None,
    )  # fmt: skip
    model = DetectionModel(scale="n", nc=3).to(device).train()
    if device.type == "cuda":  # torch's SyncBatchNorm runs on GPUs only
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ids = [0] if device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        out = ddp(torch.rand(2, 3, 64, 64, device=device))
        _scalar(out).backward()
        optimizer.step()
    t = torch.arange(4.0, device=device)
    tdist.all_reduce(t)
    tdist.broadcast(t, 0)
    tdist.reduce(t, 0)
    gathered = torch.empty(4, device=device)
    # torch 2.14 renamed these two (the old names warn); the machine's torch may predate the new ones
    getattr(tdist, "all_gather_single", tdist.all_gather_into_tensor)(gathered, t)
    getattr(tdist, "reduce_scatter_single", tdist.reduce_scatter_tensor)(torch.empty(4, device=device), gathered)
    tdist.all_to_all_single(torch.empty(4, device=device), t)
    objects: list[Any] = [None]
    tdist.all_gather_object(objects, {"rank": 0})
    box = [{"hello": 1}]
    tdist.broadcast_object_list(box, 0)
    tdist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(gathered, torch.arange(4.0, device=device)) and objects == [{"rank": 0}]
    assert box == [{"hello": 1}], box
    fsdp = fsdp_steps(device)
    version = ".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else None
    print(json.dumps({"backend": backend, "nccl": version, "ddp_steps": 3, "collectives": 9, **fsdp}))
    tdist.destroy_process_group()


def fsdp_steps(device: torch.device) -> dict[str, Any]:
    """parallel=fsdp's pieces on the group that is up (one rank): detrain's ``fsdp.shard`` of a YOLOv8n, three
    SGD steps (AMP as training uses it on this device, clipped with the trainer's norm), then the whole model and
    optimizer state a checkpoint gathers, cut back to this rank's rows and loaded again."""
    from detrain.distributed.parallel import fsdp
    from detrain.engine.train.nonfinite import gradient_norm
    from detrain.engine.train.recipe import optim
    from detrain.nn.model import DetectionModel

    model = fsdp.shard(DetectionModel(scale="n", nc=3).to(device).train(), device, (1,))
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9, **optim.kernel_options(params))
    amp = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    norms = []
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            out = model(torch.rand(2, 3, 64, 64, device=device))
        _scalar(out).backward()
        norms.append(float(gradient_norm(model.parameters(), 10.0)))
        optimizer.step()
    whole = fsdp.full_state_dict(model)
    state = fsdp.full_optimizer_state(optimizer)
    optimizer.load_state_dict(fsdp.local_optimizer_state(optimizer, state))
    again = fsdp.full_optimizer_state(optimizer)["state"]
    assert all(math.isfinite(n) for n in norms), norms
    assert all(torch.isfinite(v).all() for v in whole.values() if v.is_floating_point())
    assert all(torch.equal(again[k]["momentum_buffer"], v["momentum_buffer"]) for k, v in state["state"].items())
    return {"fsdp_steps": 3, "fsdp_amp": str(amp).replace("torch.", "") if amp else None, "fsdp_tensors": len(whole)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scalar(out: Any) -> torch.Tensor:
    """A scalar that depends on every tensor of a model's output (a list, tuple, dict or tensor), to back-propagate
    through."""
    if isinstance(out, torch.Tensor):
        return out.float().mean()
    parts = [_scalar(v) for v in (out.values() if isinstance(out, dict) else out)]
    return torch.stack(parts).sum()  # on the output's own device


def check_nccl_watchdog(ctx: Context) -> tuple[str, dict[str, Any]]:
    """Two NCCL ranks on two GPUs; rank 1 sleeps instead of joining an all-reduce; how long until the watchdog
    ends rank 0, and whether detrain's launcher (``nccl_watch.watchdog_finding``) recognises its line."""
    if not ctx.cuda:
        raise Skip("no CUDA")
    if ctx.gpus < 2:
        raise Skip("needs 2 GPUs: NCCL refuses two ranks on one GPU (Duplicate GPU detected, NCCL >= 2.5)")
    from detrain.distributed.launch.nccl_watch import watchdog_finding

    port, marker = _free_port(), ctx.work / "watchdog-started"
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"  # the watchdog tears the process down (torch's default)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--_watchdog-rank", str(rank), str(marker)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        out, _ = procs[0].communicate(timeout=WATCHDOG_TIMEOUT_S + 120)
        ended = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert marker.is_file(), f"rank 0 never reached the stuck collective (exit {procs[0].returncode})"
    abort_s = ended - float(marker.read_text())
    findings = [f for f in map(watchdog_finding, out.splitlines()) if f is not None]
    figures = {"timeout_s": WATCHDOG_TIMEOUT_S, "abort_s": abort_s, "exit": procs[0].returncode}
    assert procs[0].returncode != 0, "rank 0 finished a collective that its peer never joined"
    assert findings, (
        "no line of rank 0's output is recognised as NCCL's watchdog by detrain.distributed.launch.nccl_watch"
    )
    return f"rank 0 ended {abort_s:.1f} s into a {WATCHDOG_TIMEOUT_S} s collective timeout: {findings[0].text}", figures


def watchdog_rank(rank: int, marker: Path) -> None:
    """``--_watchdog-rank``: one rank of :func:`check_nccl_watchdog`. Both join an all-reduce; then rank 1 sleeps
    while rank 0 waits in the next, until the watchdog ends it."""
    import torch.distributed as tdist

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    tdist.init_process_group("nccl", timeout=timedelta(seconds=WATCHDOG_TIMEOUT_S), device_id=device)
    t = torch.ones(1, device=device)
    tdist.all_reduce(t)
    torch.cuda.synchronize()
    if rank == 1:
        time.sleep(600)  # never joins; the check kills it once rank 0 has ended
        return
    marker.write_text(repr(time.time()))
    tdist.all_reduce(t)
    torch.cuda.synchronize()  # waits here until the watchdog aborts the collective and ends this process
    print("the collective finished without its peer", flush=True)


def _bench_train() -> Any:
    """scripts/bench_train.py as a module: its detrain and Ultralytics training steps."""
    spec = importlib.util.spec_from_file_location("bench_train", REPO / "scripts" / "bench_train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_train"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _step_ms(
    step: Callable[[], Any], device: torch.device, dtype: torch.dtype | None, iters: int
) -> tuple[float, float, Any]:
    """(the first step's ms, the median of the ``iters`` after it, the last loss), each step under autocast to
    ``dtype`` (None: float32). The first is a compiled model's compile, or an eager one's warmup."""
    times, loss = [], None
    for _ in range(iters + 1):
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1000)
    return times[0], statistics.median(times[1:]), loss


def step_side_by_side(
    device: torch.device,
    dtypes: dict[str, torch.dtype | None],
    imgsz: int,
    batch: int,
    iters: int,
    family: str = "yolov8",
) -> dict[str, Any]:
    """detrain's and Ultralytics' training steps (bench_train's: same batch, same family and scale) in each dtype:
    median ms and whether the loss is finite; the figures' names start with the family unless it is yolov8.
    Raises Skip when Ultralytics is not importable."""
    bt = _bench_train()
    args = bt.parse_args(["--imgsz", str(imgsz), "--batch", str(batch), "--device", str(device), "--family", family])
    data = bt.make_batch(batch, imgsz, args.nc, args.boxes, device, seed=0)
    prefix = _prefix(family)
    figures: dict[str, Any] = {}
    for name, dtype in dtypes.items():
        steps = {"detrain": bt.detrain_step(args, data, device), "ultralytics": bt.ultralytics_step(args, data, device)}
        for impl, step in steps.items():
            if step is None:
                raise Skip("ultralytics is not importable (PYTHONPATH=/path/to/ulib to compare)")
            _, ms, loss = _step_ms(step, device, dtype, iters)
            figures[f"{prefix}{name}_{impl}_ms"] = ms
            figures[f"{prefix}{name}_{impl}_finite"] = bool(loss is not None and torch.isfinite(loss).all())
        theirs, ours = figures[f"{prefix}{name}_ultralytics_ms"], figures[f"{prefix}{name}_detrain_ms"]
        figures[f"{prefix}{name}_ratio"] = theirs / ours
    return figures


FAMILIES = ("yolov8", "yolo11", "yolo26")


def check_ultralytics_step(ctx: Context) -> tuple[str, dict[str, Any]]:
    """One training step of detrain beside Ultralytics in bf16, fp16 and fp32 (640 px, batch 16), for each family
    (the n scale)."""
    if not ctx.cuda:
        raise Skip("no CUDA")
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
    figures: dict[str, Any] = {}
    for family in FAMILIES:
        figures.update(step_side_by_side(torch.device("cuda", 0), dtypes, 640, 16, 10, family))
    bad = [k for k, v in figures.items() if k.endswith("_finite") and not v]
    assert not bad, f"a loss is not finite: {', '.join(bad)}"
    speed = "; ".join(
        f"{family} " + ", ".join(f"{n} {figures[f'{_prefix(family)}{n}_ratio']:.2f}x" for n in dtypes)
        for family in FAMILIES
    )
    return f"detrain's step vs Ultralytics' (their ms / ours): {speed}", figures


def _prefix(family: str) -> str:
    return "" if family == "yolov8" else f"{family}_"


def compile_vs_eager(
    device: torch.device, dtype: torch.dtype | None, imgsz: int, batch: int, mode: str, iters: int
) -> dict[str, Any]:
    """detrain's step (bench_train's) eager, then compiled in ``mode`` as ``compile=`` does: each one's first step
    (the compiled one's compile) and median step after it, in ms, and the speed-up."""
    bt = _bench_train()
    args = bt.parse_args(["--imgsz", str(imgsz), "--batch", str(batch), "--device", str(device)])
    data = bt.make_batch(batch, imgsz, args.nc, args.boxes, device, seed=0)
    figures: dict[str, Any] = {}
    for name, how in (("eager", None), ("compiled", mode)):
        first, median, loss = _step_ms(bt.detrain_step(args, data, device, how), device, dtype, iters)
        figures.update({f"{name}_first_ms": first, f"{name}_ms": median})
        assert torch.isfinite(loss).all(), f"the {name} step's loss is not finite"
    figures["speedup"] = figures["eager_ms"] / figures["compiled_ms"]
    return figures


def check_compile(ctx: Context) -> tuple[str, dict[str, Any]]:
    """compile=true's model (inductor, default mode) against eager, in bf16 as training runs on a GPU that has it,
    at 640 px, batch 16."""
    if not ctx.cuda:
        raise Skip("no CUDA (inductor on a CPU costs minutes: scripts/bench_train.py --compile measures it)")
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    figures = compile_vs_eager(torch.device("cuda", 0), dtype, 640, 16, "default", 10)
    first_s = figures["compiled_first_ms"] / 1000
    return f"compiled step {figures['speedup']:.2f}x eager's, its first step {first_s:.0f} s", figures


CHECKS: list[tuple[str, Check]] = [
    ("versions", check_versions),
    ("train", check_train),
    ("fp16", check_fp16),
    ("resume", check_resume),
    ("nccl-one-rank", check_nccl_one_rank),
    ("nccl-watchdog", check_nccl_watchdog),
    ("ultralytics-step", check_ultralytics_step),
    ("compile", check_compile),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="the CPU-safe checks only (automatic without CUDA)")
    p.add_argument("--json", type=Path, help="also write the rows to this file")
    p.add_argument("--work", type=Path, help="folder for the runs (default: a temporary one, removed after)")
    p.add_argument("--only", nargs="+", choices=[name for name, _ in CHECKS], help="run these checks only")
    p.add_argument(
        "--deadline-s",
        type=float,
        help="start no check after this many seconds (its row says so): a leased GPU's time is counted",
    )
    p.add_argument("--_nccl-one-rank", dest="nccl_one_rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_watchdog-rank", dest="watchdog_rank", nargs=2, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_all(
    ctx: Context,
    only: list[str] | None,
    deadline_s: float | None = None,
    report: Callable[[list[Row]], None] | None = None,
) -> list[Row]:
    """Each check (of ``only``) in turn; one that would start after ``deadline_s`` is a skipped row. ``report``
    sees the rows after each one (the JSON written as the run goes, so a run cut off still leaves its rows)."""
    rows: list[Row] = []
    start = time.perf_counter()
    for name, check in CHECKS:
        if only and name not in only:
            continue
        elapsed = time.perf_counter() - start
        if deadline_s is not None and elapsed > deadline_s:
            rows.append(Row(name, "skipped", f"out of time: {elapsed:.0f} s gone of --deadline-s {deadline_s:g}"))
        else:
            rows.append(run_check(name, check, ctx))
        row = rows[-1]
        print(f"{row.check}: {row.status} ({row.seconds:.1f} s): {row.result}", file=sys.stderr, flush=True)
        if report is not None:
            report(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.nccl_one_rank is not None:
        one_rank_group(args.nccl_one_rank)
        return 0
    if args.watchdog_rank is not None:
        watchdog_rank(int(args.watchdog_rank[0]), Path(args.watchdog_rank[1]))
        return 0
    cuda = torch.cuda.is_available() and not args.cpu
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ctx = Context(work=work, cuda=cuda, gpus=torch.cuda.device_count() if cuda else 0)
        start = time.perf_counter()

        def write(rows: list[Row]) -> None:
            if args.json:
                seconds = time.perf_counter() - start
                report = {"cuda": cuda, "seconds": seconds, "rows": [asdict(r) for r in rows]}
                args.json.write_text(json.dumps(report, indent=1))

        rows = run_all(ctx, args.only, args.deadline_s, write)
    total = time.perf_counter() - start
    print(table(rows))
    print(f"\n{'CUDA' if cuda else 'CPU only (--cpu)'}: {total:.0f} s in all, {time.strftime('%Y-%m-%d %H:%M')}")
    write(rows)
    return 1 if any(r.status == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
