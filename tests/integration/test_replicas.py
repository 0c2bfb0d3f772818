"""Node 0 is not the only holder of a run's checkpoints and record (``save_replicas``, engine/train/state/replicas.py).

Two launchers on 127.0.0.1 are two nodes, each in its own working folder with a relative ``project``: two disks.
Node 0's rank 0 is SIGKILLed right after it wrote the second epoch's ``last.pt`` (tests/_inject's rule: before that
file could be sent on), so the whole of node 0 is as good as lost; node 1 then holds the first epoch's checkpoint on
its own disk, and a run started there alone resumes from it, as a user would after losing node 0.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
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


def _two_nodes(tmp_path: Path, data: Path, envs: list[dict[str, str]], **args: object) -> list[subprocess.Popen]:
    homes = [tmp_path / "node0", tmp_path / "node1"]
    common = {**FAST, "data": data, "epochs": 3, "device": "cpu", "nnodes": 2, "master_addr": "127.0.0.1", **args}
    common["master_port"] = free_port()
    return [
        subprocess.Popen(
            _cli({**common, "node_rank": r}), cwd=homes[r], env=envs[r], text=True, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        for r in (0, 1)
    ]  # fmt: skip


def _ends(procs: list[subprocess.Popen]) -> list[str]:
    try:
        return [p.communicate(timeout=LIMIT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the node's whole process group, as a lost machine
                p.wait()


def _rows(run: Path) -> list[str]:
    with open(run / "results.csv") as f:
        return [row["epoch"] for row in csv.DictReader(f)]


def test_losing_node_0_loses_nothing_the_copy_on_node_1_holds_the_record_and_resumes(tmp_path: Path) -> None:
    """Node 0 is lost after epoch 2's last.pt (its rank 0 SIGKILLed before it could send it, its process group
    killed, its whole run folder deleted); node 1's disk holds epoch 1's checkpoint and the run's record (results,
    events, args, manifest, best.pt, epoch1.pt), and a run there alone finishes with every results row and a best.pt.
    A leftover of a copy killed mid-write on node 1 is removed when the run starts there."""
    data = generate_shapes(tmp_path / "shapes", n_train=16, n_val=2, imgsz=64, seed=0) / "data.yaml"
    homes = [tmp_path / "node0", tmp_path / "node1"]
    for home in homes:
        home.mkdir()
    killed_copy = homes[1] / "runs" / "run" / "weights" / ".best.pt.0123456789ab.tmp"
    killed_copy.parent.mkdir(parents=True)
    killed_copy.write_bytes(b"half a copy")
    envs = [fault_env("last.pt", 1, "kill"), child_env()]  # node 0's rank 0 dies after epoch 2's last.pt
    procs = _two_nodes(tmp_path, data, envs, val=True, save_period=1)
    outs = _ends(procs)
    assert all(p.returncode != 0 for p in procs), outs  # node 0 lost its rank 0; node 1 could not go on alone
    assert "rank 1: removed 1 temporary file(s) of copies that never finished" in outs[1], outs[1][-3000:]
    assert not killed_copy.exists()
    node0, node1 = (home / "runs" / "run" for home in homes)
    assert _load(node0 / "weights" / "last.pt")["epoch"] == 1  # written, then rank 0 died before sending it
    # node 1's disk: the first epoch's checkpoint, byte for byte what node 0 wrote (now its last.prev.pt) ...
    assert (node1 / "weights" / "last.pt").read_bytes() == (node0 / "weights" / "last.prev.pt").read_bytes()
    assert _load(node1 / "weights" / "last.pt")["epoch"] == 0
    # ... and the record as it stood then
    assert (node1 / "weights" / "epoch1.pt").read_bytes() == (node0 / "weights" / "epoch1.pt").read_bytes()
    assert (node1 / "weights" / "best.pt").is_file() and _rows(node1) == ["1"]
    for name in ("args.yaml", "manifest.json", "events.jsonl"):
        assert (node1 / name).is_file(), name
    shutil.rmtree(node0)  # node 0's disk is gone with the machine

    resumed = subprocess.run(
        _cli({"resume": "runs/run/weights/last.pt", "device": "cpu"}), cwd=homes[1], env=child_env(),
        capture_output=True, text=True, timeout=LIMIT_S,
    )  # fmt: skip
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-3000:]
    assert "resuming from runs/run/weights/last.pt at epoch 2" in out, out[-3000:]
    assert _rows(node1) == ["1", "2", "3"]  # every epoch once: nothing lost, nothing trained twice
    assert _load(node1 / "weights" / "best.pt")["epoch"] >= 0


def test_a_copy_that_fails_is_a_warning_and_an_event_and_the_run_goes_on(tmp_path: Path) -> None:
    """Node 1's run folder is a link (a copy there is refused): node 0 says so once per copy and finishes."""
    data = generate_shapes(tmp_path / "shapes", n_train=16, n_val=2, imgsz=64, seed=0) / "data.yaml"
    homes = [tmp_path / "node0", tmp_path / "node1"]
    for home in homes:
        home.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (homes[1] / "runs").mkdir()
    (homes[1] / "runs" / "run").symlink_to(elsewhere)
    procs = _two_nodes(tmp_path, data, [child_env(), child_env()], epochs=1)
    outs = _ends(procs)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "warning: a copy of the run on another node failed (rank 1: " in outs[0]
    assert "run folder refused" in outs[0] and list(elsewhere.iterdir()) == []
    events = [json.loads(line) for line in (homes[0] / "runs" / "run" / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["kind"] == "replica_failed"]
    assert failed and all("run folder refused" in e["problem"] for e in failed)
    assert events[-1]["kind"] == "end" and events[-1]["status"] == "completed"


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
