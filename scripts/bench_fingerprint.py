"""What ``fingerprint=content`` costs beside the default ``paths`` fingerprint: both over the same dataset's train
and val images, labels and json, from a warm page cache (the second of two reads) and, where the machine lets this
user drop the file's pages (``posix_fadvise(DONTNEED)``), from a cold one. Prints one table.

    python scripts/bench_fingerprint.py --data ../shared/data/coco128.yaml --repeat 3
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from detrain.data.dataset_yaml import load_dataset_yaml
from detrain.data.labels.verify import img2label_path
from detrain.engine.telemetry.manifest import dataset_fingerprint


def _drop_cache(paths: list[str]) -> None:
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(root: Path, images: list[str], content: bool, cold: bool) -> tuple[float, dict]:
    if cold:
        _drop_cache([*images, *(img2label_path(p) for p in images)])
    t0 = time.perf_counter()
    fp = dataset_fingerprint(root, images, content=content)
    return time.perf_counter() - t0, fp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="../shared/data/coco128.yaml")
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs per row")
    a = ap.parse_args()
    info = load_dataset_yaml(a.data, download=False)
    images = sorted(set(info.train) | set(info.val))
    print(f"{a.data}: {len(images)} images")
    print(f"| fingerprint | cache | files | MB | seconds (best of {a.repeat}) | MB/s |")
    print("|---|---|---:|---:|---:|---:|")
    base = None
    for content in (False, True):
        for cold in (False, True):
            best, fp = min((_timed(info.root, images, content, cold) for _ in range(a.repeat)), key=lambda r: r[0])
            mb = fp["bytes"] / 1e6
            name = "content" if content else "paths"
            rate = f"{mb / best:.0f}" if content else "-"
            print(f"| {name} | {'cold' if cold else 'warm'} | {fp['files']} | {mb:.1f} | {best:.4f} | {rate} |")
            base = base or best
    print(f"(paths, warm: {base:.4f} s)")


if __name__ == "__main__":
    main()
