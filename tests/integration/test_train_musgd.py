"""Training with ``optimizer=MuSGD`` end to end, in real processes: a run killed right after its ``mid.pt`` (gradients
waiting, mid-epoch) resumes to the uninterrupted run's weights bit for bit (the optimizer state holds Muon's and SGD's
momentum buffers), and 2 gloo workers equal 1 worker at the same global batch.

Tiny runs as in test_resume_every_node.py and test_train_distributed.py (whose patterns these follow): scale n,
64 px, 16 images, workers=0, one thread per process; the fault (rank 0 killing itself right after a checkpoint
write) comes from tests/_inject through tests/_faults.py.
"""

from __future__ import annotations

import csv
import signal
import subprocess
import sys
from pathlib import Path

import _exact
import pytest
import torch
from _faults import fault_env
from _processes import child_env

from detrain.config.cfg import make_cfg
from detrain.data.synthetic import generate_shapes
from detrain.engine.build import build_model
from detrain.engine.train.recipe import optim
from detrain.engine.train.recipe.musgd import MUON_GAIN

REPO = Path(__file__).resolve().parents[2]
LIMIT_S = 300  # a run that has not ended by then hangs
# 4 batches an epoch; updates of 3 batches (accumulation ramping from 1 in warmup), so gradients wait across
# epoch ends and in mid-epoch checkpoints; warmup spans epoch 1 and the first batch of epoch 2
RESUME = dict(
    imgsz=64,
    workers=0,
    close_mosaic=0,
    val=False,
    plots=False,
    verbose=False,
    seed=0,
    optimizer="MuSGD",
    epochs=3,
    batch=4,
    nbs=12,
    warmup_epochs=1,
    device="cpu",
    name="run",
)


def _cli(args: dict) -> list[str]:
    return [sys.executable, "-m", "detrain.cli", "train", *(f"{k}={v}" for k, v in args.items())]


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LIMIT_S, cwd=REPO)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd[:6])}... did not end within {LIMIT_S} s; output:\n{e.stdout}\n{e.stderr}")


def _ok(proc: subprocess.CompletedProcess) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-4000:]}"
    return out


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _rows(run: Path) -> list[dict[str, str]]:
    with open(run / "results.csv") as f:
        return list(csv.DictReader(f))


def _assert_same_weights(a: Path, b: Path) -> None:
    one, two = _load(a), _load(b)
    for key in ("model", "ema"):
        assert one[key]["state_dict"].keys() == two[key]["state_dict"].keys()
        for name, tensor in one[key]["state_dict"].items():
            assert torch.equal(tensor, two[key]["state_dict"][name]), (key, name)
    assert one["ema"]["updates"] == two["ema"]["updates"] and one["last_update"] == two["last_update"]


def _assert_musgd_state(ckpt: dict) -> None:
    """The saved optimizer is MuSGD's: its eight groups, and Muon's and SGD's momentum for every Muon parameter."""
    groups, state = ckpt["optimizer"]["param_groups"], ckpt["optimizer"]["state"]
    assert [g["param_group"] for g in groups] == [r for r in ("weight", "bn", "bias", "muon") for _ in "12"]
    muon = [i for g in groups if g["use_muon"] for i in g["params"]]
    assert len(muon) > 50 and all(set(state[i]) == {"momentum_buffer", "momentum_buffer_SGD"} for i in muon)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = generate_shapes(tmp_path_factory.mktemp("musgd") / "shapes", n_train=16, n_val=2, imgsz=64, seed=0)
    return root / "data.yaml"


@pytest.fixture(scope="module")
def straight(data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The uninterrupted run (the same thread count as the killed ones) and its output."""
    project = tmp_path_factory.mktemp("straight")
    out = _ok(_run(_cli({**RESUME, "data": str(data), "project": str(project)}), child_env()))
    return project / "run", out


def test_a_musgd_run_says_so_and_saves_its_state(straight: tuple[Path, str]) -> None:
    run, out = straight
    assert "optimizer: MuSGD lr0=0.01 momentum=0.937 weight_decay=0.0005; accumulate to 12 images" in out
    _assert_musgd_state(_load(run / "weights" / "last.pt"))


def test_a_musgd_run_killed_after_mid_pt_resumes_exactly(
    straight: tuple[Path, str], data: Path, tmp_path: Path
) -> None:
    """Killed after batch 3 of epoch 2 with one batch's gradients waiting in mid.pt."""
    died = tmp_path / "run"
    args = {**RESUME, "data": str(data), "project": str(tmp_path), "save_interval": 1e-9}
    proc = _run(_cli(args), fault_env("mid.pt", 0, "kill", next_batch=3))
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-3000:] + proc.stderr[-3000:]
    mid = _load(died / "weights" / "mid.pt")
    assert (mid["epoch"], mid["mid_epoch"]["next_batch"], mid["last_update"]) == (0, 3, 5)
    assert mid["pending_grads"] is not None
    _assert_musgd_state(mid)
    out = _ok(_run(_cli({"resume": str(died / "weights" / "last.pt"), "device": "cpu"}), child_env()))
    assert f"resuming from {died / 'weights' / 'mid.pt'} at epoch 2, 3/4 batches done" in out
    _assert_same_weights(straight[0] / "weights" / "last.pt", died / "weights" / "last.pt")


# augmentation off, one update of all 16 images: 1 and 2 workers take it from the same weights and data
EXACT = {**_exact.EXACT, "epochs": 1, "optimizer": "MuSGD", "name": "run"}


def _names_in_optimizer_order() -> list[str]:
    """The parameter names in the order a saved optimizer state numbers them (the trainer's own builder)."""
    model = build_model("n.yaml", nc=3, verbose=False)[0]
    opt, _, _ = optim.build_optimizer(model, make_cfg({"optimizer": "MuSGD"}), 3, 1, 5e-4)
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in opt.param_groups for p in g["params"]]


def test_two_musgd_workers_equal_one_worker_at_the_same_global_batch(data: Path, tmp_path: Path) -> None:
    """What world-size invariance can promise for Muon. The gradient 2 ranks average is the 1-rank gradient summed
    in another order (float noise: 3e-4 of a tensor's norm at most, measured, as for SGD), so MuSGD's momentum
    buffers and its SGD-only parameters agree to float noise. The Muon step orthogonalises in bfloat16, and
    Newton-Schulz lifts a gradient's small singular values (bfloat16 rounding among them) to about 1: a float-noise
    change of the gradient moves the Muon step by a few percent of its norm (at most 4.7% here, measured; Ultralytics'
    Muon alike). A lost average, a rank's missing Muon step or another lr would move it by about 100%."""
    runs = {}
    for device in ("cpu", "cpu,cpu"):
        project = tmp_path / device.replace(",", "_")
        out = _ok(_run(_cli({**EXACT, "data": str(data), "device": device, "project": str(project)}), child_env()))
        assert "optimizer: MuSGD" in out and f"{device.count('cpu')} worker(s) on cpu" in out
        runs[device] = _load(project / "run" / "weights" / "last.pt")
    one, two = runs["cpu"], runs["cpu,cpu"]
    assert one["ema"]["updates"] == two["ema"]["updates"] == 1
    names = _names_in_optimizer_order()
    groups = one["optimizer"]["param_groups"]
    muon_lr = {names[i]: g["initial_lr"] for g in groups if g["use_muon"] for i in g["params"]}
    assert len(muon_lr) > 50 and set(muon_lr.values()) == {0.01, 0.03}
    for i, name in enumerate(names):
        for key, a in one["optimizer"]["state"][i].items():  # Muon's and SGD's momentum: the gradients agree
            b = two["optimizer"]["state"][i][key]
            assert float((a - b).norm()) <= 1e-3 * float(a.norm()), (name, key)
        a, b = one["model"]["state_dict"][name], two["model"]["state_dict"][name]
        if name in muon_lr:
            step = muon_lr[name] * MUON_GAIN * min(a.shape[0], a[0].numel()) ** 0.5  # a Muon step's norm
            assert float((a - b).norm()) <= 0.1 * step, (name, float((a - b).norm()) / step)
        else:
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    for key in ("model", "ema"):  # BatchNorm statistics (sync_bn) and the EMA follow the weights
        for name, a in one[key]["state_dict"].items():
            if name not in muon_lr and a.is_floating_point():
                torch.testing.assert_close(two[key]["state_dict"][name], a, atol=1e-4, rtol=1e-3)
