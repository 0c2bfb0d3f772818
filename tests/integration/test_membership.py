"""Membership changes under ``nnodes=MIN:MAX rdzv_backend=c10d`` beyond scripts/chaos.py's cases (a node leaving
and one joining are chaos cases b and c, tests/integration/test_chaos.py): rank 0 resuming from a checkpoint that
another node holds, and the loss of node 0, which hosts the rendezvous.

Each "node" is a launcher on 127.0.0.x with its own working folder and its own project (no shared disk). Faults
come from outside: signals from the test once a node's run folder shows the trigger; nothing in detrain/ helps.
The processes use gloo, one thread each, a tiny model and 64-pixel images. Bounded times are subprocess timeouts,
never timed asserts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _processes import child_env, free_port

from detrain.data.synthetic import generate_shapes
from detrain.weights.checkpoint import save_checkpoint

LIMIT_S = 240  # a node that has not ended by then hangs (each run takes ~10-60 s on an idle 2-core machine)
# 32 images in batches of 8: each epoch has steps enough that the signal lands before the run could finish
TINY = {
    "imgsz": 64,
    "workers": 0,
    "warmup_epochs": 0,
    "close_mosaic": 0,
    "val": False,
    "plots": False,
    "verbose": False,
    "optimizer": "SGD",
    "seed": 0,
    "batch": 8,
    "device": "cpu",
    "dist_timeout": 30,
    "project": "runs",
    "name": "x",
    "exist_ok": True,
}
AGREE_NODE = Path(__file__).resolve().parents[1] / "_agree_node.py"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = generate_shapes(tmp_path_factory.mktemp("membership") / "shapes", n_train=32, n_val=2, imgsz=64, seed=0)
    return root / "data.yaml"


def _start(home: Path, args: dict) -> subprocess.Popen:
    """A node: detrain's launcher in ``home``, in a session (and process group) of its own, as a machine is."""
    home.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "detrain.cli", "train", *(f"{k}={v}" for k, v in args.items())]
    with open(home / "out.txt", "w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            cmd, env=child_env(), cwd=home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def _wait_until(done: Callable[[], bool], nodes: list[subprocess.Popen], home: Path) -> None:
    deadline = time.monotonic() + LIMIT_S
    while not done():
        assert time.monotonic() < deadline, f"no trigger within {LIMIT_S} s:\n{(home / 'out.txt').read_text()[-3000:]}"
        assert all(p.poll() is None for p in nodes), f"a node ended early:\n{(home / 'out.txt').read_text()[-3000:]}"
        time.sleep(0.05)


def _session_alive(sid: int) -> list[int]:
    """The processes still in session ``sid`` (a node's launcher and everything it started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                zombie = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # gone, not yet reaped
                if os.getsid(int(entry.name)) == sid and not zombie:
                    pids.append(int(entry.name))
            except (OSError, IndexError):
                continue
    return pids


def _stop(nodes: list[subprocess.Popen]) -> None:
    for p in nodes:
        if _session_alive(p.pid):
            os.killpg(p.pid, signal.SIGKILL)
        if p.poll() is None:
            p.wait()


# ------------------------------------------------------------------ a node leaves


def test_losing_node_0_which_hosts_the_rendezvous_ends_the_other_nodes_with_one_line(
    data: Path, tmp_path: Path
) -> None:
    """torch's c10d rendezvous keeps the group's membership in one store, which node 0's launcher hosts: when
    node 0's machine dies the group cannot re-form, and node 1 ends (not hangs) with one line that says so."""
    homes = [tmp_path / "node0", tmp_path / "node1"]
    port = free_port()
    common = {
        **TINY,
        "data": str(data),
        "epochs": 6,
        "nnodes": "1:2",
        "rdzv_backend": "c10d",
        "master_addr": "127.0.0.1",
        "master_port": port,
        "max_restarts": 1,
    }
    nodes = [_start(home, {**common, "node_rank": r}) for r, home in enumerate(homes)]
    try:
        _wait_until((homes[0] / "runs" / "x" / "weights" / "last.pt").is_file, nodes, homes[0])
        os.killpg(nodes[0].pid, signal.SIGKILL)
        nodes[1].wait(timeout=LIMIT_S)
        nodes[0].wait(timeout=LIMIT_S)
        left = _session_alive(nodes[1].pid)
        deadline = time.monotonic() + 30  # what the launcher started may take a moment to exit after it
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = _session_alive(nodes[1].pid)
    finally:
        _stop(nodes)
    out = (homes[1] / "out.txt").read_text()
    assert nodes[1].returncode not in (0, None), out[-3000:]
    last_line = out.strip().splitlines()[-1]
    # one line saying node 0 is gone: the rendezvous' own error, or (on a loaded machine, where node 0's store has
    # been silent for the job watch's dist_timeout, 30 s, before the rendezvous notices) the job watch's
    assert last_line.startswith(
        (
            f"error: lost the rendezvous at 127.0.0.1:{port} (node_rank=1): node_rank=0, which "
            "hosts it, has stopped or cannot be reached",
            f"error: lost node 0's launcher at 127.0.0.1:{port} for 30s",
        )
    ), out[-3000:]
    assert not left, f"node 1 left processes behind: {left}"


# ------------------------------------------------------------------ rank 0 on another node than the checkpoint


def _resumable(path: Path, epoch: int, **extra: object) -> Path:
    """A small checkpoint of launch ``L`` with the fields a resume reads (the trainer writes the same)."""
    state = {
        "model": {
            "yaml": None,
            "scale": "n",
            "nc": 1,
            "names": {0: "a"},
            "imgsz": 64,
            "state_dict": {"w": torch.full((1,), float(epoch))},
        },
        "ema": None,
        "epoch": epoch,
        "optimizer": {"state": {}, "param_groups": []},
        "train_args": {"epochs": 5, "project": "runs", "name": path.parents[1].name},
        "batches_per_epoch": 4,
        "launch_id": "L",
        "job_id": None,
        **extra,
    }
    return save_checkpoint(state, path)


def _agree_on_two_nodes(homes: list[Path], cases: list[dict]) -> list[list[dict]]:
    """Rank 0 in homes[0], rank 1 in homes[1], each the first process of its node; what each agreed per case."""
    port = free_port()
    procs = []
    for rank, home in enumerate(homes):
        env = child_env(
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(AGREE_NODE), json.dumps(cases)],
                env=env,
                cwd=home,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=LIMIT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    homes[0].joinpath("out.txt").write_text(outs[0])
    return [json.loads((home / "agreed.json").read_text()) for home in homes]


def test_rank_0_resumes_from_the_checkpoint_another_node_holds_and_goes_on_with_its_record(tmp_path: Path) -> None:
    """Every node's first process reports the furthest checkpoint of this run on its own disk; the one that holds
    the furthest sends it to every rank, and, where that is not rank 0, its run record, which rank 0 puts in its
    own run folder (results.csv, events.jsonl, manifest.json, best.pt) before it writes anything."""
    homes = [tmp_path / "node0", tmp_path / "node1"]
    for home in homes:
        home.mkdir()
    # "x": node 0 holds epoch 1 of this run, node 1 (rank 0 until the group re-formed) epoch 2 and the record
    _resumable(homes[0] / "runs" / "x" / "weights" / "last.pt", epoch=0)
    theirs = homes[1] / "runs" / "x"
    _resumable(theirs / "weights" / "last.pt", epoch=1)
    (theirs / "results.csv").write_text("epoch,train/box_loss\n1,2.5\n2,2.25\n")
    (theirs / "events.jsonl").write_text('{"kind":"start","world_size":2}\n{"kind":"end","status":"failed"}\n')
    (theirs / "manifest.json").write_text('{"restarts": 0}\n')
    (theirs / "weights" / "best.pt").write_bytes(b"best weights")
    (theirs / "weights" / "epoch1.pt").write_bytes(b"not part of the record")
    # "tie": the same epoch on both: rank 0's own, and nothing travels
    _resumable(homes[0] / "runs" / "tie" / "weights" / "last.pt", epoch=1)
    _resumable(homes[1] / "runs" / "tie" / "weights" / "last.pt", epoch=1)
    (homes[1] / "runs" / "tie" / "results.csv").write_text("epoch\n1\n2\n")
    # "bad": what lies where node 1's mid.pt belongs is no checkpoint: every rank stops with the same line
    (homes[1] / "runs" / "bad" / "weights").mkdir(parents=True)
    (homes[1] / "runs" / "bad" / "weights" / "mid.pt").write_bytes(b"PK\x03\x04 not a checkpoint")
    cases = [
        {"save_dir": f"runs/{name}", "cfg": {"project": "runs", "name": name}} for name in ("x", "tie", "bad", "none")
    ]
    rank0, rank1 = _agree_on_two_nodes(homes, cases)
    assert rank0[0] == rank1[0] == {"epoch": 1, "resume": "runs/x/weights/last.pt", "save_dir": "runs/x"}
    mine = homes[0] / "runs" / "x"
    for name in ("results.csv", "events.jsonl", "manifest.json", "weights/best.pt"):
        assert (mine / name).read_bytes() == (theirs / name).read_bytes(), name
    assert not (mine / "weights" / "epoch1.pt").exists()
    assert "resuming from runs/x/weights/last.pt at epoch 3 (held by rank 1 on" in (homes[0] / "out.txt").read_text()
    assert rank0[1] == rank1[1] == {"epoch": 1, "resume": "runs/tie/weights/last.pt", "save_dir": "runs/tie"}
    assert not (homes[0] / "runs" / "tie" / "results.csv").exists()
    assert rank0[2] == rank1[2] and rank0[2]["error"].startswith(
        f"on {socket.gethostname()} (rank 1): cannot load weights file runs/bad/weights/mid.pt: "
    )
    assert rank0[3] == rank1[3] == {"epoch": None, "resume": False, "save_dir": "runs/none"}
