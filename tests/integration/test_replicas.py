"""Node 0 is not the only holder of a run's checkpoints (``save_replicas``, engine/train/state/replicas.py).

Two launchers on 127.0.0.1 are two nodes, each in its own working folder with a relative ``project``: two disks.
Node 0's rank 0 is SIGKILLed right after it wrote the second epoch's ``last.pt`` (tests/_inject's rule: before that
file could be sent on), so the whole of node 0 is as good as lost; node 1 then holds the first epoch's checkpoint on
its own disk, and a run started there alone resumes from it, as a user would after losing node 0.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _faults import fault_env
from _processes import child_env, free_port

from detrain.data.synthetic import generate_shapes
from detrain.engine.train.state.replicas import targets, write_copy

REPO = Path(__file__).resolve().parents[2]
LIMIT_S = 300  # a run that has not ended by then hangs
FAST = dict(
    imgsz=64, batch=8, workers=0, warmup_epochs=0, close_mosaic=0, val=False, plots=False, verbose=False,
    optimizer="SGD", seed=0, project="runs", name="run", exist_ok=True,
)  # fmt: skip


def _cli(args: dict) -> list[str]:
    return [sys.executable, "-m", "detrain.cli", "train", *(f"{k}={v}" for k, v in args.items())]


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_losing_node_0_loses_no_checkpoint_the_copy_on_node_1_resumes(tmp_path: Path) -> None:
    data = generate_shapes(tmp_path / "shapes", n_train=16, n_val=2, imgsz=64, seed=0) / "data.yaml"
    homes = [tmp_path / "node0", tmp_path / "node1"]
    for home in homes:
        home.mkdir()
    common = {**FAST, "data": data, "epochs": 3, "device": "cpu", "nnodes": 2, "master_addr": "127.0.0.1"}
    common["master_port"] = free_port()
    envs = [fault_env("last.pt", 1, "kill"), child_env()]  # node 0's rank 0 dies after epoch 2's last.pt
    procs = [
        subprocess.Popen(
            _cli({**common, "node_rank": r}),
            cwd=homes[r],
            env=envs[r],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=LIMIT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode != 0 for p in procs), outs  # node 0 lost its rank 0; node 1 could not go on alone
    node0, node1 = (home / "runs" / "run" / "weights" for home in homes)
    assert _load(node0 / "last.pt")["epoch"] == 1  # written, then rank 0 died before sending it
    # node 1's disk holds the first epoch's checkpoint, byte for byte what node 0 wrote (now its last.prev.pt)
    assert (node1 / "last.pt").read_bytes() == (node0 / "last.prev.pt").read_bytes()
    assert _load(node1 / "last.pt")["epoch"] == 0
    assert not (node1.parent / "results.csv").exists()  # a copy of the checkpoints, not a second run folder

    # node 0 is gone: the run goes on from node 1's copy, on node 1 alone
    resumed = subprocess.run(
        _cli({"resume": "runs/run/weights/last.pt", "device": "cpu"}), cwd=homes[1], env=child_env(),
        capture_output=True, text=True, timeout=LIMIT_S,
    )  # fmt: skip
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-3000:]
    assert "resuming from runs/run/weights/last.pt at epoch 2" in out, out[-3000:]
    with open(node1.parent / "results.csv") as f:
        assert [row["epoch"] for row in csv.DictReader(f)] == ["2", "3"]  # nothing trained twice, nothing skipped


def test_the_copies_go_to_the_first_process_of_the_next_nodes() -> None:
    layout = [{"rank": r, "node": n} for r, n in enumerate((0, 0, 1, 1, 2, 2))]
    assert targets(layout, 1) == [] and targets(layout, 2) == [2] and targets(layout, 3) == [2, 4]
    assert targets(layout, 9) == [2, 4]  # no more copies than other nodes
    assert targets([{"rank": 0, "node": 0}, {"rank": 1, "node": 0}], 2) == []  # one node: nothing to send
    # rank 0 need not be on the node numbered 0 (a re-formed group)
    assert targets([{"rank": 1, "node": 0}, {"rank": 0, "node": 1}, {"rank": 2, "node": 2}], 2) == [1]


def test_a_copy_is_atomic_keeps_the_previous_and_skips_a_shared_disk(tmp_path: Path) -> None:
    path = tmp_path / "run" / "weights" / "last.pt"
    assert write_copy(path, b"first", "last.prev.pt") is True  # the folder is made
    assert write_copy(path, b"second", "last.prev.pt") is True
    assert path.read_bytes() == b"second" and (path.parent / "last.prev.pt").read_bytes() == b"first"
    before = path.stat().st_mtime_ns
    assert write_copy(path, b"second", "last.prev.pt") is False  # the same bytes: node 0's own file, shared disk
    assert path.stat().st_mtime_ns == before and (path.parent / "last.prev.pt").read_bytes() == b"first"
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.prev.pt", "last.pt"]  # no temporary left


def test_a_planted_link_receives_no_copy(tmp_path: Path) -> None:
    from detrain.errors import CheckpointError

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "weights").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="run folder refused"):
        write_copy(tmp_path / "run" / "weights" / "last.pt", b"x", None)
    assert list(elsewhere.iterdir()) == []
