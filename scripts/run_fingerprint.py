"""Fingerprints of a few small training runs, to check that a change of code shape changed no result.

Runs three short trainings on the built-in shapes set (tiny images, scale n) that reach the corners a refactor can
break - two gloo workers with accumulation across epochs and close_mosaic; an early stop; a mid-epoch checkpoint
with multi_scale - then a val and a predict of the first run's best.pt, and prints one sha256 per artefact:

* every tensor of each checkpoint (model, EMA, optimizer state, RNG states, waiting gradients), by key;
* results.csv without its wall-clock columns;
* the val metrics and the predict boxes.

Run it before and after a change and compare the two tables (``diff``); equal lines mean bit-identical results.

    python scripts/run_fingerprint.py --out /tmp/fp_before
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

TIME_COLUMNS = ("time", "images_per_s", "step_ms", "slowest_rank", "data_wait", "cpu_pct", "rss_gb", "gpu_")

RUNS: dict[str, dict[str, Any]] = {
    "ddp_accumulate": dict(
        device="cpu,cpu", epochs=3, batch=4, nbs=16, close_mosaic=1, imgsz=64, workers=0, warmup_epochs=1
    ),
    "early_stop": dict(device="cpu", epochs=6, batch=8, patience=1, imgsz=64, workers=1, lr0=0.1),
    "mid_multiscale": dict(
        device="cpu", epochs=2, batch=4, imgsz=64, workers=0, multi_scale=True, save_interval=1e-6, close_mosaic=0
    ),
}


def _digest(value: Any) -> str:
    hasher = hashlib.sha256()

    def feed(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            hasher.update(str((item.dtype, tuple(item.shape))).encode())
            hasher.update(item.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(item, np.ndarray):
            hasher.update(str((item.dtype, item.shape)).encode())
            hasher.update(np.ascontiguousarray(item).tobytes())
        elif isinstance(item, dict):
            for key in sorted(item, key=repr):
                hasher.update(repr(key).encode())
                feed(item[key])
        elif isinstance(item, list | tuple):
            hasher.update(f"{type(item).__name__}{len(item)}".encode())
            for sub in item:
                feed(sub)
        elif isinstance(item, torch.nn.Module):
            feed(item.state_dict())
        else:
            hasher.update(repr(item).encode())

    feed(value)
    return hasher.hexdigest()[:16]


def _checkpoint_rows(path: Path) -> list[tuple[str, str]]:
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    skip = {"date", "train_args", "git", "version", "launch_id", "run_dir"}
    rows = []
    for key in sorted(ckpt):
        if key in skip:
            continue
        rows.append((f"{path.parent.parent.name}/{path.name}:{key}", _digest(ckpt[key])))
    return rows


def _results_rows(run_dir: Path) -> list[tuple[str, str]]:
    text = (run_dir / "results.csv").read_text()
    rows = list(csv.reader(io.StringIO(text)))
    keep = [i for i, name in enumerate(rows[0]) if not any(t in name.strip() for t in TIME_COLUMNS)]
    kept = [[row[i].strip() for i in keep] for row in rows]
    return [(f"{run_dir.name}/results.csv", _digest(kept))]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the runs (made anew)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these runs")
    parser.add_argument("--no-train", action="store_true", help="fingerprint the runs already in --out")
    args = parser.parse_args(argv)
    from detrain import Model

    rows: list[tuple[str, str]] = []
    first_best = None
    for name, keys in RUNS.items():
        if args.only and name not in args.only:
            continue
        if not args.no_train:
            Model("n.yaml").train(project=str(args.out), name=name, exist_ok=True, seed=1, **keys)
        run_dir = args.out / name
        for ckpt in sorted((run_dir / "weights").glob("*.pt")):
            rows += _checkpoint_rows(ckpt)
        rows += _results_rows(run_dir)
        first_best = first_best or run_dir / "weights" / "best.pt"
    if first_best is not None:
        if not args.no_train:
            Model(str(first_best)).val(device="cpu", imgsz=64, project=str(args.out), name="val", workers=0)
        metrics = json.loads((args.out / "val" / "metrics.json").read_text())
        kept = {k: v for k, v in metrics.items() if k not in ("speed", "time", "save_dir")}
        rows.append(("val:metrics", _digest(json.loads(json.dumps(kept, default=repr)))))
        from detrain.data.synthetic import generate_shapes

        source = generate_shapes(args.out / "predict_source", n_train=1, n_val=4, imgsz=64, seed=5)
        results = Model(str(first_best)).predict(
            source=str(source / "images" / "val"), device="cpu", imgsz=64, conf=0.001, save=False
        )
        rows.append(("predict:boxes", _digest([np.asarray(r.boxes.xyxy) for r in results])))
    width = max(len(k) for k, _ in rows)
    table = "".join(f"{key:<{width}}  {digest}\n" for key, digest in rows)
    (args.out / "fingerprint.txt").write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
