"""scripts/bench_ddp.py: its table (every setting a row, sync_bn's cost against the plain DDP step of the same
workers) and a real run of one, two and two sync_bn gloo workers at a tiny size."""

from __future__ import annotations

import doctest
import os
import subprocess
import sys

from _processes import REPO, child_env
from _scripts import load_script

bd = load_script("bench_ddp")


def test_the_table_gives_sync_bn_its_cost_against_the_same_workers() -> None:
    failures, _ = doctest.testmod(bd, verbose=False)
    assert failures == 0
    best = {
        (1, False): {"ips": 8.0, "ms_step": 2000.0, "cpu_ms_step": 2000.0},
        (4, False): {"ips": 16.0, "ms_step": 1000.0, "cpu_ms_step": 500.0},
        (4, True): {"ips": 12.0, "ms_step": 1500.0, "cpu_ms_step": 600.0},
    }
    rows = bd.table(best, 16).splitlines()[2:]
    assert rows[1] == "| 4 | false | 4 | 16.00 | 1000 | 500 | 50% | - |"
    assert rows[2] == "| 4 | true | 4 | 12.00 | 1500 | 600 | 38% | +50%, +20% |"  # against (4, False), not 1


def test_a_tiny_run_times_each_setting_and_prints_one_table() -> None:
    env = {k: v for k, v in child_env().items() if k != "OMP_NUM_THREADS"}
    args = ["--imgsz", "64", "--batch", "4", "--nc", "3", "--iters", "1", "--warmup", "0", "--rounds", "1"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_ddp.py"), *args, "--workers", "2", "--sync-bn"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.fspath(REPO),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "workers" not in line]
    assert [row.split(" | ")[:3] for row in rows] == [["| 1", "-", "4"], ["| 2", "false", "2"], ["| 2", "true", "2"]]
    assert rows[2].split(" | ")[-1].endswith("% |") and rows[1].split(" | ")[-1] == "- |"
