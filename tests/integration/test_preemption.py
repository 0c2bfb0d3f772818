"""Preemption as clusters do it: SIGTERM or SIGUSR1 to one process of a running ``detrain train`` (a plain process,
one of two gloo workers, or the launcher above them), sent from outside by the test. Every rank saves ``mid.pt`` at
the same step, the run exits 75 with one line, and a resumed run ends with the uninterrupted run's weights, bit for
bit; under SLURM the job is requeued and its next start resumes by itself.

Where the signal lands is made exact with ``tests/_inject``'s hold: rank 0's training loop waits right after writing
epoch 1's ``results.csv`` row (just before that epoch's save: checkpoints are written by a thread beside the loop, so
holding that thread would not hold the loop) while the test sends the signal, so the agreed stop is the first step of
epoch 2 (``1/4 batches done``), whose ``mid.pt`` is written once epoch 1's ``last.pt`` is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _faults import fault_env, wait_for, workers_of
from _processes import REPO, child_env, free_port

from detrain.data.synthetic import generate_shapes

pytestmark = pytest.mark.integration

ARGS = dict(
    model="n.yaml",
    imgsz=64,
    batch=4,
    workers=0,
    close_mosaic=0,
    warmup_epochs=0,
    optimizer="SGD",
    val=False,
    plots=False,
    verbose=False,
    seed=0,
    epochs=2,
    name="run",
)
LIMIT_S = 240.0
# one process: an update every 2 batches, so mid.pt holds a batch's waiting gradients; two workers: an update
# every batch (waiting gradients are averaged over the ranks when mid.pt is saved, which rounds differently from
# the uninterrupted run's one all-reduce at the update: equal to about 1e-7, not bit for bit)
NBS = {"cpu": 8, "cpu,cpu": 4}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = generate_shapes(tmp_path_factory.mktemp("preempt") / "shapes", n_train=16, n_val=2, imgsz=64, seed=0)
    return root / "data.yaml"


def _cmd(args: dict) -> list[str]:
    return [sys.executable, "-m", "detrain.cli", "train", *(f"{k}={v}" for k, v in args.items())]


def _run(args: dict, env: dict[str, str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(_cmd(args), env=env, capture_output=True, text=True, timeout=LIMIT_S, cwd=REPO)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"detrain train did not end within {LIMIT_S:g} s:\n{e.stdout}\n{e.stderr}")


def _weights(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    ckpt = torch.load(run / "weights" / "last.pt", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == ARGS["epochs"] - 1
    return {key: ckpt[key]["state_dict"] for key in ("model", "ema")}


def _assert_same(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> None:
    for key in a:
        assert a[key].keys() == b[key].keys()
        for name, tensor in a[key].items():
            assert torch.equal(tensor, b[key][name]), (key, name)


@pytest.fixture(scope="module")
def straight(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """The uninterrupted runs, on one process and on two gloo workers: what every resumed run must end with."""
    out = {}
    for device in ("cpu", "cpu,cpu"):
        project = tmp_path_factory.mktemp("straight")
        done = _run(
            {**ARGS, "data": str(data), "project": str(project), "device": device, "nbs": NBS[device]}, child_env()
        )
        assert done.returncode == 0, done.stderr[-3000:]
        out[device] = _weights(project / "run")
    return out


def _preempt(
    data: Path,
    project: Path,
    device: str,
    target: str,
    sig: signal.Signals,
    env: dict[str, str] | None = None,
    torchrun: bool = False,
    **extra: object,
) -> tuple[subprocess.CompletedProcess, Path]:
    """Start a run whose rank 0 holds after epoch 1's results.csv row, send ``sig`` to ``target`` ("launcher": the
    process the test started; "rank 1": the second worker; "group": every process of the run), release rank 0,
    and collect the run's end. ``torchrun``: the ranks of ``device`` started by torchrun instead of detrain."""
    until = project / "release"
    env = {**fault_env("results.csv", 0, "hold", until=until), **(env or {})}
    args = {**ARGS, "data": str(data), "project": str(project), "device": device, "nbs": NBS[device], **extra}
    cmd = _cmd(args)
    if torchrun:  # torchrun gives each rank its place; detrain's own device list is not given
        del args["device"]
        ranks = ["--nproc-per-node", str(len(device.split(","))), "--master-addr", "127.0.0.1"]
        launch = [sys.executable, "-m", "torch.distributed.run", *ranks, "--master-port", str(free_port())]
        cmd = [*launch, *_cmd(args)[1:]]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True
    )
    try:
        wait_for(lambda: Path(f"{until}.held").exists() or proc.poll() is not None, LIMIT_S, "rank 0 never held")
        assert proc.poll() is None, proc.communicate()
        if target == "group":  # SLURM, `kill -- -PGID` and container runtimes signal every process at once
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid if target == "launcher" else workers_of(proc.pid)[1], sig)
        time.sleep(0.5)  # the handler runs as soon as the process is next in Python; a signal is never lost
        until.touch()
        out, err = proc.communicate(timeout=LIMIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), project / "run"


def _check_preempted(ended: subprocess.CompletedProcess, run: Path, said: str) -> Path:
    text = ended.stdout + ended.stderr
    assert ended.returncode == 75, text[-3000:]
    last = [line for line in ended.stderr.splitlines() if line.strip()][-1]
    mid = run / "weights" / "mid.pt"
    assert last.startswith(f"preempted {said}: saved {mid} at epoch 2, 1/4 batches done; "), ended.stderr[-4000:]
    ckpt = torch.load(mid, map_location="cpu", weights_only=True)
    assert (ckpt["epoch"], ckpt["mid_epoch"]["next_batch"]) == (0, 1)  # the first step of epoch 2, on every rank
    assert "Traceback" not in text
    return mid


def _resume(mid: Path, device: str) -> dict[str, dict[str, torch.Tensor]]:
    resumed = _run({"resume": str(mid), "device": device}, child_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {mid} at epoch 2, 1/4 batches done" in resumed.stdout + resumed.stderr
    return _weights(mid.parent.parent)


def test_sigusr1_to_one_of_two_workers_stops_both_at_one_step_and_the_resume_is_bitwise(
    data, straight, tmp_path: Path
) -> None:
    """Only rank 1 was told; rank 0 saves at the same step, and the launcher ends 75 without a restart."""
    ended, run = _preempt(data, tmp_path, "cpu,cpu", "rank 1", signal.SIGUSR1)
    mid = _check_preempted(ended, run, "by SIGUSR1")  # rank 0 was not signalled: the group's flags say which
    assert "restart 1" not in ended.stdout + ended.stderr  # no restart of the agent
    _assert_same(_resume(mid, "cpu,cpu"), straight["cpu,cpu"])


def test_sigterm_to_the_launcher_is_passed_on_to_its_workers_and_ends_resumable(data, tmp_path: Path) -> None:
    ended, run = _preempt(data, tmp_path, "cpu,cpu", "launcher", signal.SIGTERM)
    _check_preempted(ended, run, "by SIGTERM")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_to_every_process_of_a_two_worker_run_saves_and_the_resume_is_bitwise(
    data, straight, tmp_path: Path, sig: signal.Signals
) -> None:
    """The launcher and both workers signalled at once, as SLURM, ``kill -- -PGID`` and container runtimes do: the
    workers' own SIGTERM is the preemption (their launcher says it got one too), not the agent's stop; the line
    names the signal that came. Loader workers and multiprocessing's resource tracker are in the group as well and
    must outlive the signal (augmentations draw from (seed, epoch, image): the loader's workers change no pixel)."""
    ended, run = _preempt(data, tmp_path, "cpu,cpu", "group", sig, workers=1)  # loader workers get it too
    mid = _check_preempted(ended, run, f"by {sig.name}")
    assert "restart 1" not in ended.stdout + ended.stderr
    if sig == signal.SIGTERM:  # the same mid.pt either way: one resume is enough (CI time)
        _assert_same(_resume(mid, "cpu,cpu"), straight["cpu,cpu"])


def test_sigterm_to_both_nodes_process_groups_saves_on_node_0_and_ends_both_resumable(
    data, straight, tmp_path: Path
) -> None:
    """Two launchers (nodes, each with its own folder) of one run of two ranks; SIGTERM to each node's whole
    process group: every rank saves at the same step, node 0 holds mid.pt, both launchers end 75; the resume (two
    workers on one node: the same world of two) ends with the uninterrupted run's weights."""
    until = tmp_path / "release"
    env = fault_env("results.csv", 0, "hold", until=until)
    port = free_port()
    procs = []
    for node in (0, 1):
        args = {
            **ARGS,
            "data": str(data),
            "project": str(tmp_path / f"node{node}"),
            "device": "cpu",
            "nbs": NBS["cpu,cpu"],
            "nnodes": 2,
            "node_rank": node,
            "master_addr": "127.0.0.1",
            "master_port": port,
        }
        procs.append(
            subprocess.Popen(
                _cmd(args),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO,
                start_new_session=True,
            )
        )
    ends = []
    try:
        wait_for(lambda: Path(f"{until}.held").exists() or any(p.poll() is not None for p in procs), LIMIT_S, "no hold")
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        time.sleep(0.5)
        until.touch()
        for p in procs:
            out, err = p.communicate(timeout=LIMIT_S)
            ends.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    mid = _check_preempted(ends[0], tmp_path / "node0" / "run", "by SIGTERM")
    assert ends[1].returncode == 75, (ends[1].stdout + ends[1].stderr)[-3000:]
    assert not (tmp_path / "node1" / "run" / "weights" / "mid.pt").exists()  # only rank 0 writes the checkpoint
    _assert_same(_resume(mid, "cpu,cpu"), straight["cpu,cpu"])


def test_under_torchrun_sigterm_to_every_process_saves_mid_pt(data, tmp_path: Path) -> None:
    """torchrun's agent says nothing to its workers: their SIGTERM is the preemption; each worker ends 75 after
    the agreed save (torchrun itself reports its workers' end as it does for any signal)."""
    ended, run = _preempt(data, tmp_path, "cpu,cpu", "group", signal.SIGTERM, torchrun=True)
    text = ended.stdout + ended.stderr
    mid = run / "weights" / "mid.pt"
    assert f"preempted by SIGTERM: saved {mid} at epoch 2, 1/4 batches done" in text, text[-3000:]
    ckpt = torch.load(mid, map_location="cpu", weights_only=True)
    assert (ckpt["epoch"], ckpt["mid_epoch"]["next_batch"]) == (0, 1)


def test_under_slurm_the_job_is_requeued_and_its_next_start_resumes_by_itself(data, straight, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    slurm = {"SLURM_JOB_ID": "4242", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    ended, run = _preempt(data, tmp_path, "cpu", "launcher", signal.SIGTERM, slurm)  # a single process: SIGTERM
    _check_preempted(ended, run, "by SIGTERM")
    assert ended.stderr.rstrip().endswith("; requeued SLURM job 4242")
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    # counted in the run folder: a job preempted again at this point is requeued at most requeue_without_progress times
    count = {"job": "4242", "point": "epoch 2, 1/4 batches done", "count": 1}
    assert json.loads((run / "requeues.json").read_text()) == count
    # a save killed mid-write (SIGKILL, a full disk) leaves its temporary file: the next start removes it
    killed = run / "weights" / ".last.pt.0123456789ab.tmp"
    killed.write_bytes(b"half a checkpoint")
    # the requeued job: the same id, SLURM_RESTART_COUNT 1, the same command; no resume= needed
    again = _run(
        {**ARGS, "data": str(data), "project": str(tmp_path), "device": "cpu", "nbs": NBS["cpu"]},
        {**child_env(), **slurm, "SLURM_RESTART_COUNT": "1"},
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "requeue 1: resuming from " in again.stdout + again.stderr
    assert "mid.pt at epoch 2, 1/4 batches done" in again.stdout + again.stderr
    assert "removed 1 temporary file(s) of writes that never finished: .last.pt.0123456789ab.tmp" in again.stdout
    assert not killed.exists()
    _assert_same(_weights(run), straight["cpu"])
