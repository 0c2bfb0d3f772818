"""End-to-end training throughput: images/s of whole training epochs, detrain beside Ultralytics, same data.

Each run is a real training run in its own process, through each tool's Python API (``Model(...).train()`` and
``YOLO(...).train()``), from scratch on the same files with the same epochs, imgsz, batch, workers and device,
everything else at each tool's default (so each trains in the precision it picks: detrain bf16 where the GPU has it,
Ultralytics fp16 AMP). Both tools fire ``on_train_epoch_start`` before an epoch's first batch and
``on_train_epoch_end`` after its last, before validation; the time between the two is the epoch's training time,
loader included, measured the same way for both. The first epoch (workers starting, cuDNN choosing kernels) is left
out: the table gives ``n_train`` over the median of the other epochs' times.

The data is detrain's synthetic shapes set at ``--gen-imgsz``, its train images listed ``--repeat`` times as
distinct files (symlinks, as ``bench_data.py`` does), so no loader serves a mosaic from images it has kept decoded.
Ultralytics is never a dependency: it is used when importable (``PYTHONPATH=/path/to/ulib``), offline; its AMP
self-check (which would download yolo26n.pt) is replaced by a pass, as it passes on a GPU with working AMP.

    PYTHONPATH=/opt/ulib python scripts/bench_train_e2e.py --device 0 --models yolov8n,yolo11n,yolo26n
    python scripts/bench_train_e2e.py --device cpu --imgsz 128 --n-train 16 --repeat 2 --epochs 3 --batch 8 --workers 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

EPOCH_TIMES: list[list[float]] = []  # [start, end] per epoch, filled by the callbacks below in the child


def _epoch_start(*_: Any) -> None:
    EPOCH_TIMES.append([time.perf_counter()])


def _epoch_end(*_: Any) -> None:
    if EPOCH_TIMES and len(EPOCH_TIMES[-1]) == 1:
        if _synchronize is not None:
            _synchronize()
        EPOCH_TIMES[-1].append(time.perf_counter())


_synchronize: Any = None


def child(args: argparse.Namespace) -> None:
    """One training run; writes its epoch times (seconds) as JSON to ``args.out``."""
    global _synchronize
    import torch

    if torch.cuda.is_available() and args.device != "cpu":
        _synchronize = torch.cuda.synchronize
    kw: dict[str, Any] = dict(
        data=args.data, epochs=args.epochs, imgsz=args.imgsz, batch=args.batch, workers=args.workers,
        device=args.device, project=args.project, name=args.name, exist_ok=True, plots=False, val=False, seed=0,
    )  # fmt: skip
    if args.child == "detrain":
        from detrain import Model

        model: Any = Model(f"{args.model}.yaml")
        if args.augment_device != "cpu":
            kw["augment_device"] = args.augment_device
    else:
        import ultralytics.engine.trainer as trainer
        from ultralytics import YOLO

        trainer.check_amp = lambda *_a, **_k: True  # offline: the self-check would download yolo26n.pt
        model = YOLO(f"{args.model}.yaml")
    model.add_callback("on_train_epoch_start", _epoch_start)
    model.add_callback("on_train_epoch_end", _epoch_end)
    model.train(**kw)
    Path(args.out).write_text(json.dumps([end - start for start, end in EPOCH_TIMES if end]))


def make_data(work: Path, args: argparse.Namespace) -> tuple[Path, int]:
    """The shapes set, its train images listed ``--repeat`` times; (its data.yaml, the number of train images)."""
    import yaml
    from bench_data import mirror, train_images

    from detrain.data.synthetic import generate_shapes

    source = generate_shapes(work / "shapes", n_train=args.n_train, n_val=8, imgsz=args.gen_imgsz, seed=0)
    images, names = train_images(str(source / "data.yaml"))
    listed = mirror(images, args.repeat, work / "listed")
    data = work / "listed" / "data.yaml"
    val = str(source / "images" / "val")
    data.write_text(yaml.safe_dump({"path": str(work / "listed"), "train": "images/train", "val": val, "names": names}))
    return data, len(listed)


def run(
    impl: str, model: str, augment: str, data: Path, n: int, work: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """One training run in its own process: its row (images/s over the epochs after the first), or its error."""
    name = f"{impl}-{model}-{augment}"
    out = work / f"{name}.json"
    cmd = [
        sys.executable, __file__, "--child", impl, "--model", model, "--data", str(data), "--epochs", str(args.epochs),
        "--imgsz", str(args.imgsz), "--batch", str(args.batch), "--workers", str(args.workers), "--device", args.device,
        "--project", str(work / "runs"), "--name", name, "--out", str(out), "--augment-device", augment,
    ]  # fmt: skip
    env = {**os.environ, "YOLO_OFFLINE": "1", "YOLO_CONFIG_DIR": str(work / "ycfg"), "YOLO_VERBOSE": "False"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    row: dict[str, Any] = {"impl": impl, "model": model, "augment": augment, "wall_s": wall}
    if proc.returncode != 0 or not out.is_file():
        lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
        row["error"] = f"exit {proc.returncode}: {lines[-1] if lines else 'no output'}"[:300]
        return row
    times = json.loads(out.read_text())
    steady = times[1:] or times
    row.update(epoch_s=[round(t, 3) for t in times], images_per_s=n / statistics.median(steady))
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | tool | augment | images/s | vs Ultralytics | epoch s | wall s |",
        "|---|---|---|---:|---:|---|---:|",
    ]
    theirs = {r["model"]: r.get("images_per_s") for r in rows if r["impl"] == "ultralytics"}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['impl']} | {r['augment']} | failed: {r['error']} | | | |")
            continue
        ref = theirs.get(r["model"])
        ratio = f"{r['images_per_s'] / ref:.2f}x" if ref and r["impl"] == "detrain" else ""
        epochs = ", ".join(f"{t:.2f}" for t in r["epoch_s"])
        lines.append(
            f"| {r['model']} | {r['impl']} | {r['augment']} | {r['images_per_s']:.1f} | {ratio} | {epochs} |"
            f" {r['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="yolov8n", help="comma-separated: yolov8n, yolo11n, yolo26n (any scale)")
    p.add_argument("--impls", default="detrain,ultralytics")
    p.add_argument("--augment-devices", default="cpu", help="detrain's augment_device values to run (cpu,gpu)")
    p.add_argument("--device", default="0")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--gen-imgsz", type=int, default=640)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--n-train", type=int, default=128, help="distinct generated train images")
    p.add_argument("--repeat", type=int, default=8, help="times each is listed")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--work", type=Path, help="keep the data and runs here (default: a temporary folder)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--child", choices=("detrain", "ultralytics"), help=argparse.SUPPRESS)
    for hidden in ("--model", "--data", "--project", "--name", "--out"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--augment-device", default="cpu", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench_e2e_") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data, n = make_data(work, args)
        rows = []
        for model in args.models.split(","):
            for impl in args.impls.split(","):
                for augment in args.augment_devices.split(",") if impl == "detrain" else ["cpu"]:
                    rows.append(run(impl, model, augment, data, n, work, args))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                    if args.json:
                        args.json.write_text(json.dumps({"n_train": n, "rows": rows}, indent=1))
    print(f"{n} train images ({args.n_train} x {args.repeat} listed), imgsz {args.imgsz}, batch {args.batch}, "
          f"workers {args.workers}, device {args.device}, {args.epochs} epochs (the first left out)")  # fmt: skip
    print(table(rows))


if __name__ == "__main__":
    main()
