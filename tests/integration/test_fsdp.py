"""``parallel=fsdp`` (torch's fully_shard) beside DDP, with real processes (gloo on 127.0.0.1): 2 sharded workers
train what 2 DDP workers train, and a checkpoint of either resumes under the other and on 1 worker.

Tolerances: every weight, EMA weight and buffer within 1e-5 absolute and 1e-4 relative (the sums of a sharded
backward run in another order; measured: at most 1.2e-7 between the 2-epoch runs, 6.9e-7 after resuming on 1
worker); the loss columns within 2e-5 relative in the first epoch (the same weights) and 5e-4 in the second (as
tests/integration/test_train_distributed.py allows between 1 and 2 workers; measured 3.4e-6 and 2.1e-5). A
momentum buffer read with the wrong strides, a missing BatchNorm broadcast or a gradient averaged twice move them
by 1e-3 and more.
"""

from __future__ import annotations

import csv
import shutil
import sys
from pathlib import Path

import _exact
import _fsdp_workers as workers
import pytest
import torch
from _processes import child_env, run_together

from detrain.data.synthetic import generate_shapes
from detrain.distributed.launch.launcher import launch, parse_device

REPO = Path(__file__).resolve().parents[2]
LIMIT_S = 300

# as test_train_distributed's EXACT: augmentation off, one update per epoch of 16 images, sync_bn (so that 1 worker
# trains what 2 do); save_period=1 keeps epoch1.pt, which the resumes start from
EXACT = {**_exact.EXACT, "exist_ok": True, "epochs": 2, "save_period": 1}


def _together(commands: list[list[str]]) -> list[tuple[int, str]]:
    """``detrain train`` with each argument list, all started at once (each run spends much of its time starting
    processes and waiting in gloo, so runs side by side take less than one after the other): (exit code, output)."""
    cli = [sys.executable, "-m", "detrain.cli", "train"]
    return run_together([cli + args for args in commands], child_env(), REPO, LIMIT_S)


def _ok(ended: tuple[int, str]) -> None:
    code, out = ended
    assert code == 0, f"exit {code}\n{out[-3000:]}"


def _rows(run: Path) -> list[dict[str, str]]:
    with open(run / "results.csv") as f:
        return list(csv.DictReader(f))


def _last(run: Path) -> dict:
    return torch.load(run / "weights" / "last.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """2 epochs on 2 workers under DDP and under fsdp (each keeps epoch1.pt)."""
    root = tmp_path_factory.mktemp("fsdp")
    data = generate_shapes(root / "shapes", n_train=16, n_val=2, imgsz=64, seed=0) / "data.yaml"
    kinds = ("ddp", "fsdp")
    args = [
        {**EXACT, "data": data, "device": "cpu,cpu", "parallel": kind, "project": root, "name": kind} for kind in kinds
    ]
    for ended in _together([[f"{k}={v}" for k, v in a.items()] for a in args]):
        _ok(ended)
    return {kind: root / kind for kind in kinds}


def _same(run: Path, reference: Path) -> None:
    """``run``'s last.pt and results.csv agree with ``reference``'s (see the module for the tolerances)."""
    a, b = _last(reference), _last(run)
    for part in ("model", "ema"):
        one, two = a[part]["state_dict"], b[part]["state_dict"]
        assert one.keys() == two.keys()
        for name, x in one.items():
            if x.is_floating_point():
                torch.testing.assert_close(two[name], x, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
            else:
                assert torch.equal(x, two[name]), name
    momentum = [(a["optimizer"]["state"][k], b["optimizer"]["state"][k]) for k in a["optimizer"]["state"]]
    for x, y in momentum:  # the same parameter order, whole tensors
        torch.testing.assert_close(y["momentum_buffer"], x["momentum_buffer"], atol=1e-4, rtol=1e-3)
    for r1, r2, rel in zip(_rows(reference), _rows(run), (2e-5, 5e-4), strict=True):
        for col in ("train/box_loss", "train/cls_loss", "train/dfl_loss"):
            assert float(r2[col]) == pytest.approx(float(r1[col]), rel=rel), (r1["epoch"], col)


def test_two_fsdp_workers_train_what_two_ddp_workers_train(runs: dict[str, Path]) -> None:
    _same(runs["fsdp"], runs["ddp"])
    # the checkpoint is DDP's format: whole tensors, optimizer state by parameter index, each rank's generators
    # (BatchNorm statistics are rank 0's on every rank: parallel.share_main_buffers)
    ddp, fsdp = _last(runs["ddp"]), _last(runs["fsdp"])
    assert ddp["optimizer"]["state"].keys() == fsdp["optimizer"]["state"].keys()
    assert ddp["rng_per_rank"].keys() == fsdp["rng_per_rank"].keys() == {"0", "1"}
    assert "buffers_per_rank" not in ddp and "buffers_per_rank" not in fsdp


RESUMES = {  # name: (the run whose epoch1.pt is resumed, parallel= of the resumed run, its devices)
    "ddp-to-fsdp": ("ddp", "fsdp", "cpu,cpu"),
    "fsdp-to-ddp": ("fsdp", "ddp", "cpu,cpu"),
    "fsdp-2-workers-to-1": ("fsdp", "fsdp", "cpu"),
    "ddp-to-hsdp": ("ddp", "hsdp", "cpu,cpu"),  # one node: a 1 x 2 mesh, its shards read on the mesh's 2nd dimension
}


@pytest.fixture(scope="module")
def resumed(runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, tuple[int, str]]]:
    """epoch1.pt of each RESUMES run resumed for epoch 2 as named (the three side by side; a resumed run writes in
    the checkpoint's run folder: a copy of it): name -> (its folder, its process result)."""
    folders = {}
    for name, (written_by, _, _) in RESUMES.items():
        folders[name] = tmp_path_factory.mktemp(name) / "run"
        shutil.copytree(runs[written_by], folders[name])
        (folders[name] / "weights" / "last.pt").unlink()
    commands = [
        [f"resume={folders[name] / 'weights' / 'epoch1.pt'}", f"parallel={kind}", f"device={device}"]
        for name, (_, kind, device) in RESUMES.items()
    ]
    return {name: (folders[name], ended) for name, ended in zip(RESUMES, _together(commands), strict=True)}


@pytest.mark.parametrize("name", list(RESUMES))
def test_a_checkpoint_resumes_across_ddp_fsdp_hsdp_and_world_sizes(
    runs: dict[str, Path], resumed: dict[str, tuple[Path, tuple[int, str]]], name: str
) -> None:
    """epoch1.pt of one run resumed for epoch 2 under the other choice (or 1 worker) ends where the uninterrupted
    DDP run ended."""
    run, ended = resumed[name]
    _ok(ended)
    _same(run, runs["ddp"])


def test_ddp_and_fsdp_steps_agree_rank_by_rank() -> None:
    """The same steps of a tiny model in one 2-rank group: weights, EMA, each rank's own BatchNorm statistics (rank
    0's sent before a forward that follows an update, as DDP sends them), waiting gradients (one accumulation
    step and an epoch's end), momentum; a whole optimizer state cut to each rank's rows and gathered again is
    itself."""
    got = launch(workers.ddp_and_fsdp, {}, parse_device("cpu,cpu"))
    buffer = "model.0.1.running_mean"
    assert not torch.equal(got[0]["ddp"]["buffers"][buffer], got[1]["ddp"]["buffers"][buffer])  # ranks differ
    for rank in got:
        ddp, fsdp = rank["ddp"], rank["fsdp"]
        for part in ("model", "ema", "buffers", "grads"):
            assert ddp[part].keys() == fsdp[part].keys(), part
            for name, x in ddp[part].items():
                torch.testing.assert_close(fsdp[part][name], x, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        for x, y in zip(ddp["momentum"], fsdp["momentum"], strict=True):
            torch.testing.assert_close(y, x, atol=1e-6, rtol=1e-5)
        for x, y in zip(fsdp["reloaded"], fsdp["momentum"], strict=True):
            assert torch.equal(x, y)
        # MuSGD needs whole matrices: refused where sharded with one line (a ConfigError raised on every rank
        # before the first epoch, which the launcher reports as one line and exit 2, as for any worker's), and
        # left alone under DDP
        assert ddp["musgd"] is None
        assert "parallel=fsdp cannot train with MuSGD" in fsdp["musgd"] and "\n" not in fsdp["musgd"]


def test_a_bad_parallel_value_is_one_line() -> None:
    ((code, out),) = _together([["parallel=zero", "data=coco8.yaml"]])
    assert code == 2, f"exit {code}\n{out[-2000:]}"
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert lines == ["error: invalid value for 'parallel': 'zero'; expected one of ddp, fsdp, hsdp"], out[-2000:]
