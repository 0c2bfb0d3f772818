"""Resume on every node after any restart, with no shared disk, and mid-epoch checkpoints (``save_interval``).

Rank 0 alone decides whether a start resumes and from which of its own checkpoints
(``engine/train/state/resume_state.py``); the other ranks get that checkpoint from it. The processes run on 127.0.0.1
with gloo, one thread each, on a tiny model and 64-pixel images; "nodes" are launchers with their own working folder
and project. Faults come from outside detrain (tests/_faults.py): SIGKILL sent by the test, or, where the point must be
exact, rank 0 killing or holding itself right after a checkpoint write (tests/_inject/sitecustomize.py). Bounded-time
requirements are checked with generous subprocess timeouts, never with timed asserts.
"""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _faults import fault_env, held, rank_of_torchrun, send
from _processes import child_env, free_port

from detrain.config.cfg import make_cfg
from detrain.data.loader import GlobalBatchSampler
from detrain.data.synthetic import generate_shapes
from detrain.distributed.world import World
from detrain.engine.train.state import resume_state
from detrain.engine.train.state.resume_state import Launch
from detrain.errors import CheckpointError, ConfigError
from detrain.run.preflight import check_inputs
from detrain.weights.checkpoint import save_checkpoint

REPO = Path(__file__).resolve().parents[2]
LIMIT_S = 300  # a run that has not ended by then hangs (each takes ~10-40 s on an idle 2-core machine)
TINY = dict(
    imgsz=64, workers=0, warmup_epochs=0, close_mosaic=0, val=False, plots=False, verbose=False, optimizer="SGD", seed=0
)


def _cli(args: dict) -> list[str]:
    return [sys.executable, "-m", "detrain.cli", "train", *(f"{k}={v}" for k, v in args.items())]


def _run(cmd: list[str], env: dict[str, str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LIMIT_S, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd[:6])}... did not end within {LIMIT_S} s; output:\n{e.stdout}\n{e.stderr}")


def _ok(proc: subprocess.CompletedProcess) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-4000:]}"
    return out


def _epochs(run: Path) -> list[str]:
    with open(run / "results.csv") as f:
        return [r["epoch"] for r in csv.DictReader(f)]


def _rows(run: Path) -> list[dict[str, str]]:
    with open(run / "results.csv") as f:
        return list(csv.DictReader(f))


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _assert_same_weights(a: Path, b: Path) -> None:
    one, two = _load(a), _load(b)
    for key in ("model", "ema"):
        assert one[key]["state_dict"].keys() == two[key]["state_dict"].keys()
        for name, tensor in one[key]["state_dict"].items():
            assert torch.equal(tensor, two[key]["state_dict"][name]), (key, name)
    assert one["ema"]["updates"] == two["ema"]["updates"] and one["last_update"] == two["last_update"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = generate_shapes(tmp_path_factory.mktemp("resume") / "shapes", n_train=16, n_val=2, imgsz=64, seed=0)
    return root / "data.yaml"


# ------------------------------------------------------------------ the sampler starts at a batch


def test_a_sampler_started_at_a_batch_yields_the_rest_of_the_uninterrupted_epoch_on_every_rank() -> None:
    ranks = [GlobalBatchSampler(40, 4, r, 2, seed=3) for r in (0, 1)]
    for s in ranks:
        s.set_epoch(2)
    whole = [[[(p.index, p.pool) for p in b] for b in s] for s in ranks]
    for s in ranks:
        s.start_at(3)
        assert len(s) == 5  # the epoch's length, as the trainer counts its batches
    rest = [[[(p.index, p.pool) for p in b] for b in s] for s in ranks]
    assert rest == [w[3:] for w in whole] and all(len(r) == 2 for r in rest)  # the same images and mosaic pools
    assert [len(list(s)) for s in ranks] == [5, 5]  # that pass ran to its end, so the next one is whole again
    ranks[0].start_at(2)
    ranks[0].set_epoch(3)  # another epoch: the start does not carry over
    assert len(list(ranks[0])) == 5


@pytest.mark.parametrize("bad", [-1, 6, True, 2.0, "1"])
def test_a_start_outside_the_epoch_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="a batch index from 0 to 5"):
        GlobalBatchSampler(40, 4, 0, 2).start_at(bad)


# ------------------------------------------------------------------ rank 0's choice (one process: no group)


def _ckpt(
    path: Path, epoch: int, launch: object = "L1", job: object = None, mid: object = None, nb: int = 4, **extra: object
) -> Path:
    """A small checkpoint with the fields the choice reads (the trainer writes the same, with real weights)."""
    state = {
        "model": {
            "yaml": None,
            "scale": "n",
            "nc": 1,
            "names": {0: "a"},
            "imgsz": 64,
            "state_dict": {"w": torch.zeros(1)},
        },
        "ema": None,
        "epoch": epoch,
        "optimizer": {"state": {}, "param_groups": []},
        "train_args": {"epochs": 5, "project": str(path.parents[2]), "name": path.parents[1].name},
        "batches_per_epoch": nb,
        "launch_id": launch,
        "job_id": job,
        **extra,
    }
    if mid is not None:
        state["mid_epoch"] = {"next_batch": mid, "step_images": 4, "mean_items": torch.ones(3), "n_images": 4}
    return save_checkpoint(state, path)


def _launch(launch_id: str | None = "L1", job: str | None = None, requeued: int = 0, series: bool = False) -> Launch:
    return Launch(launch_id, job, requeued, 0, series)


def _agree(tmp: Path, launch: Launch, save_dir: Path | None = None, **cfg: object) -> resume_state.Start:
    return resume_state.agree(make_cfg({"project": str(tmp), "name": "run", **cfg}), save_dir, launch, World())


def test_a_restart_resumes_from_the_furthest_checkpoint_of_its_launch(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    _ckpt(run / "weights" / "last.pt", epoch=1)
    _ckpt(run / "weights" / "mid.pt", epoch=1, mid=3)  # 3 batches into epoch 2 (0-based 2)
    start = _agree(tmp_path, _launch(), save_dir=run)
    assert start.ckpt is not None and start.ckpt["mid_epoch"]["next_batch"] == 3
    assert (
        start.save_dir == run
        and start.cfg.train.resume == str(run / "weights" / "mid.pt")
        and start.cfg.train.epochs == 5
    )
    assert f"resuming from {run / 'weights' / 'mid.pt'} at epoch 3, 3/4 batches done" in capsys.readouterr().out
    # a mid.pt that the epoch's last.pt has superseded (the run died between the two files) is behind it
    _ckpt(run / "weights" / "last.pt", epoch=2)
    assert _agree(tmp_path, _launch(), save_dir=run).cfg.train.resume == str(run / "weights" / "last.pt")


def test_checkpoints_of_another_run_in_the_same_folder_are_not_resumed(tmp_path: Path) -> None:
    """exist_ok=True reuses a folder whose last.pt belongs to an older run: a new launch starts afresh."""
    run = tmp_path / "run"
    _ckpt(run / "weights" / "last.pt", epoch=3, launch="OLD")
    _ckpt(run / "weights" / "mid.pt", epoch=3, launch=7, mid=1)  # a forged, non-text id is nobody's
    start = _agree(tmp_path, _launch("NEW"), save_dir=run)
    assert start.ckpt is None and start.save_dir == run and not start.cfg.train.resume
    # a plain process (no launcher id) resumes nothing on its own
    assert _agree(tmp_path, _launch(None), save_dir=run).ckpt is None


def test_a_requeued_slurm_job_finds_its_newest_run_folder_by_its_job_id(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()  # an older run, then this job's
    _ckpt(tmp_path / "run2" / "weights" / "last.pt", epoch=0, launch="first-attempt", job="slurm:42")
    requeue = _launch("second-attempt", job="slurm:42", requeued=1, series=True)
    start = _agree(tmp_path, requeue)
    assert start.ckpt is not None and start.save_dir == tmp_path / "run2"
    # the same job id without a requeue (a second run in one allocation) is a new run
    assert _agree(tmp_path, _launch("second-attempt", job="slurm:42", series=True)).ckpt is None
    assert _agree(tmp_path, _launch("x", job="slurm:43", requeued=1, series=True)).ckpt is None


def test_resume_last_pt_goes_on_from_a_mid_pt_of_the_same_launch_beside_it(tmp_path: Path) -> None:
    weights = tmp_path / "run" / "weights"
    last = _ckpt(weights / "last.pt", epoch=0, launch="A")
    _ckpt(weights / "mid.pt", epoch=0, launch="A", mid=2)
    assert _agree(tmp_path, _launch("NEW"), resume=str(last)).cfg.train.resume == str(weights / "mid.pt")
    _ckpt(weights / "mid.pt", epoch=0, launch="B", mid=2)  # another launch's mid.pt: not this last.pt's run
    assert _agree(tmp_path, _launch("NEW"), resume=str(last)).cfg.train.resume == str(last)


def test_a_restart_after_an_explicit_resume_continues_from_what_it_wrote(tmp_path: Path) -> None:
    weights = tmp_path / "run" / "weights"
    _ckpt(weights / "epoch2.pt", epoch=1, launch="OLD")
    _ckpt(weights / "last.pt", epoch=3, launch="NOW")  # written by this launch after resume=epoch2.pt
    start = _agree(tmp_path, _launch("NOW"), resume=str(weights / "epoch2.pt"))
    assert start.ckpt is not None and start.ckpt["epoch"] == 3


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("next_batch", 10**9),
        ("next_batch", 0),
        ("next_batch", "2"),
        ("step_images", -4),
        ("mean_items", torch.ones(2)),
        ("mean_items", torch.tensor([1.0, float("nan"), 0.0])),
    ],
)
def test_a_malformed_mid_epoch_position_is_one_line_naming_the_file(tmp_path: Path, field, value) -> None:
    mid = tmp_path / "run" / "weights" / "mid.pt"
    _ckpt(mid, epoch=0, mid=1)
    state = _load(mid)
    state["mid_epoch"][field] = value
    save_checkpoint(state, mid)
    with pytest.raises(CheckpointError, match=re.escape(f"{mid}: its mid-epoch position")):
        _agree(tmp_path, _launch(), save_dir=tmp_path / "run")


@pytest.mark.parametrize("epoch", [True, "1", -2, 1.5])
def test_a_malformed_epoch_is_one_line_naming_the_file(tmp_path: Path, epoch) -> None:
    last = _ckpt(tmp_path / "run" / "weights" / "last.pt", epoch=0)
    state = _load(last)
    state["epoch"] = epoch
    save_checkpoint(state, last)
    with pytest.raises(CheckpointError, match=re.escape(f"{last}: 'epoch' is")):
        _agree(tmp_path, _launch(), save_dir=tmp_path / "run")


def test_a_file_that_is_no_checkpoint_where_mid_pt_belongs_is_named(tmp_path: Path) -> None:
    mid = tmp_path / "run" / "weights" / "mid.pt"
    mid.parent.mkdir(parents=True)
    mid.write_bytes(b"PK\x03\x04 not a zip, not a checkpoint")
    with pytest.raises(CheckpointError, match=re.escape(str(mid))):
        _agree(tmp_path, _launch(), save_dir=tmp_path / "run")


def test_resuming_weights_without_a_training_state_is_one_line(tmp_path: Path) -> None:
    weights = tmp_path / "w.pt"
    save_checkpoint(
        {
            "model": {
                "yaml": None,
                "scale": "n",
                "nc": 1,
                "names": {0: "a"},
                "imgsz": 64,
                "state_dict": {"w": torch.zeros(1)},
            },
            "ema": None,
            "epoch": -1,
        },
        weights,
    )
    with pytest.raises(CheckpointError, match="holds weights but no training state"):
        _agree(tmp_path, _launch(), resume=str(weights))


def test_the_launch_identity_under_an_agent_is_kept_by_its_restarts(monkeypatch) -> None:
    for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    here = Launch.here(World.from_env())
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")  # the agent restarted its workers three times
    restarted = Launch.here(World.from_env())
    assert here.id is not None and here.search_series and (here.restarts, restarted.restarts) == (0, 3)
    assert restarted.id == here.id  # torchrun: the same agent, so the same launch
    assert restarted.reason() == "restart 3"
    monkeypatch.setattr(os, "getppid", lambda: 1)  # another agent (another parent process) is another launch
    assert Launch.here(World.from_env()).id not in (None, here.id)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert Launch.here(World.from_env(), "given") == Launch("given", None, 0, 0, False)  # detrain's launcher's id
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert Launch.here(World.from_env(), "given") == Launch("given", "slurm:77", 2, 0, True)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "two")
    with pytest.raises(Exception, match="SLURM_RESTART_COUNT='two' is not an integer"):
        World.from_env()


def test_only_the_node_that_hosts_rank_0_needs_the_resume_file(tmp_path: Path, monkeypatch) -> None:
    for key in ("RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    missing = str(tmp_path / "nowhere" / "last.pt")
    check_inputs("train", make_cfg({"resume": missing, "nnodes": 2, "node_rank": 1}))
    with pytest.raises(ConfigError, match="checkpoint not found"):
        check_inputs("train", make_cfg({"resume": missing, "nnodes": 2, "node_rank": 0}))
    check_inputs("train", make_cfg({"resume": missing}), World(rank=3, world_size=4, launcher="torchrun"))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-1", "a value from 0.0 to 10080.0"),
        ("nan", "a finite number"),
        ("1e9", "a value from 0.0 to 10080.0"),
        ("soon", "a number"),
        ("5", "0 with save=false"),
    ],
)
def test_a_bad_save_interval_is_one_line(value, message) -> None:
    with pytest.raises(ConfigError, match=re.escape("invalid value for 'save_interval': ")) as err:
        make_cfg({"save_interval": value, "save": message != "0 with save=false"})
    assert message in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------ processes


def _stop(nodes: list[subprocess.Popen]) -> None:
    for p in nodes:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_single_process_killed_mid_epoch_resumes_at_that_step_exactly(data: Path, tmp_path: Path) -> None:
    """Gradients accumulate over 2 batches (nbs=8, batch=4) and the kill comes after batch 3 of epoch 2, with
    one batch's gradients waiting in mid.pt: the resumed run ends with the uninterrupted run's weights."""
    args = {**TINY, "data": str(data), "epochs": 2, "batch": 4, "nbs": 8, "device": "cpu", "name": "run"}
    _ok(_run(_cli({**args, "project": str(tmp_path / "a")}), child_env()))  # the same thread count as the others
    straight = tmp_path / "a" / "run"
    died = tmp_path / "b" / "run"
    proc = _run(
        _cli({**args, "project": str(tmp_path / "b"), "save_interval": 1e-9}),
        fault_env("mid.pt", 0, "kill", next_batch=3),
    )  # within epoch 2, after batch 3
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-3000:] + proc.stderr[-3000:]
    mid = _load(died / "weights" / "mid.pt")
    assert (mid["epoch"], mid["mid_epoch"]["next_batch"], mid["last_update"]) == (0, 3, 5)
    assert mid["pending_grads"] is not None and _epochs(died) == ["1"]
    out = _ok(_run(_cli({"resume": str(died / "weights" / "last.pt"), "device": "cpu"}), child_env()))
    assert f"resuming from {died / 'weights' / 'mid.pt'} at epoch 2, 3/4 batches done" in out
    _assert_same_weights(straight / "weights" / "last.pt", died / "weights" / "last.pt")
    assert _epochs(died) == ["1", "2"] and not (died / "weights" / "mid.pt").exists()
    for col in ("train/box_loss", "train/cls_loss", "train/dfl_loss"):  # the epoch's running means went on
        assert _rows(died)[1][col] == _rows(straight)[1][col]


# Two workers restarted by the launcher after rank 0 was killed right after mid.pt (batch 2 of epoch 2), resumed at
# that step to the uninterrupted run's weights: tests/integration/test_gpu_check.py's
# test_two_workers_restarted_mid_epoch_resume_at_the_step_with_the_uninterrupted_weights, on the runs of
# scripts/gpu_check.py --cpu's resume check (the same two runs this file trained for it).


def test_torchrun_max_restarts_resumes_in_the_first_attempts_folder(data: Path, tmp_path: Path) -> None:
    """torchrun restarts both ranks after rank 1 is SIGKILLed between epochs 1 and 2 (rank 0 holds right after
    epoch 1's last.pt); rank 0 finds the run folder the first attempt made (runs/run, not runs/run2) by the agent it
    runs under, and goes on from its last.pt."""
    args = {
        **TINY,
        "data": str(data),
        "epochs": 2,
        "batch": 8,
        "device": "cpu",
        "name": "run",
        "project": str(tmp_path / "runs"),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "detrain.cli",
        "train",
        *(f"{k}={v}" for k, v in args.items()),
    ]
    go = tmp_path / "go"  # never made: torchrun stops the held rank 0 when rank 1 dies
    with open(tmp_path / "out.txt", "w") as log:  # the child keeps its own descriptor
        torchrun = subprocess.Popen(
            cmd, env=fault_env("last.pt", 0, "hold", until=go), cwd=REPO, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        held(go, LIMIT_S)
        rank1 = rank_of_torchrun(torchrun.pid, 1)
        assert rank1 is not None, "rank 1 not found among torchrun's children"
        send(rank1, signal.SIGKILL)
        torchrun.wait(timeout=LIMIT_S)
    finally:
        _stop([torchrun])
    out = (tmp_path / "out.txt").read_text()
    assert torchrun.returncode == 0, out[-4000:]
    run = tmp_path / "runs" / "run"
    assert f"restart 1: resuming from {run / 'weights' / 'last.pt'} at epoch 2" in out, out[-3000:]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["run"]
    assert _epochs(run) == ["1", "2"] and _load(run / "weights" / "last.pt")["epoch"] == 1


def test_a_requeued_slurm_job_resumes_in_its_own_folder(data: Path, tmp_path: Path) -> None:
    args = {
        **TINY,
        "data": str(data),
        "epochs": 2,
        "batch": 8,
        "device": "cpu",
        "name": "run",
        "project": str(tmp_path / "runs"),
    }
    first = _run(_cli(args), fault_env("last.pt", 0, "kill", SLURM_JOB_ID="4242"))  # dies after epoch 1's last.pt
    assert first.returncode == -signal.SIGKILL, first.stdout[-3000:] + first.stderr[-3000:]
    run = tmp_path / "runs" / "run"
    assert _epochs(run) == ["1"]
    out = _ok(_run(_cli(args), child_env(SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="1")))
    assert f"requeue 1: resuming from {run / 'weights' / 'last.pt'} at epoch 2" in out, out[-3000:]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["run"]
    assert _epochs(run) == ["1", "2"]
