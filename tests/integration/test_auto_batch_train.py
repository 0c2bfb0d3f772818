"""AutoBatch in a real run: ``batch=-1`` on the CPU trains at 16 with one line; with a fake GPU memory the trainer
measures the real steps of its model (forward, loss, backward; validation's forward) and trains at the batch that
fits; the chosen number is what args.yaml and the checkpoint record (so a resume or a rerun of args.yaml trains
with it); two gloo workers with different GPUs agree on one batch. Tiny runs: 64 px, 8 images, one epoch."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import _dist_workers as workers
import pytest
import torch
import yaml
from _fake_gpu import FakeMemory, sized_steps

from detrain import Model
from detrain.config.cfg import make_cfg
from detrain.data.prepare import load_split
from detrain.data.synthetic import generate_shapes
from detrain.distributed.launch.launcher import launch, parse_device
from detrain.engine.train import auto_batch
from detrain.engine.train.auto_batch import GIB

TINY = dict(epochs=1, imgsz=64, nbs=8, device="cpu", workers=0, warmup_epochs=0, close_mosaic=0, val=True)
TINY |= dict(plots=False, verbose=False, exist_ok=True, name="run")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_shapes(tmp_path_factory.mktemp("ab") / "shapes", n_train=8, n_val=2, imgsz=64, seed=0) / "data.yaml"


@pytest.fixture
def one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny convolutions run faster on one thread of a busy machine
    yield
    torch.set_num_threads(threads)


def _recorded_batches(save_dir: Path) -> tuple[Any, Any]:
    args = yaml.safe_load((save_dir / "args.yaml").read_text())["batch"]
    ckpt = torch.load(save_dir / "weights" / "last.pt", map_location="cpu", weights_only=True)
    return args, ckpt["train_args"]["batch"]


def test_on_the_cpu_autobatch_trains_at_16_with_one_line(data: Path, tmp_path: Path, one_thread: None, capsys) -> None:
    metrics = Model("n.yaml").train(data=str(data), batch=-1, amp="bf16", **TINY, project=str(tmp_path))
    out = capsys.readouterr().out
    assert out.count("AutoBatch: batch=-1 needs a CUDA device; this cpu run uses batch=16") == 1
    assert out.count("amp=bf16: mixed precision runs on CUDA only; this cpu run trains and validates in float32") == 1
    assert metrics is not None
    assert _recorded_batches(Path(metrics.save_dir)) == (16, 16)
    rerun = make_cfg({"cfg": str(Path(metrics.save_dir) / "args.yaml")}, "train")
    assert rerun.train.batch == 16 and rerun.train.amp == "bf16"  # args.yaml reruns the same run


def test_with_a_fake_gpu_the_real_steps_are_measured_and_the_fit_trains(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None, capsys
) -> None:
    # 4 GiB available, 60 %: (2.4 - 0.5) / 0.3 = 6 images per step
    memory = FakeMemory(total_bytes=8 * GIB, available_bytes=4 * GIB, fixed=0.5 * GIB, per_image=0.3 * GIB)
    real_steps = auto_batch.model_steps
    probed: list[tuple[Any, ...]] = []
    monkeypatch.setattr(auto_batch, "model_steps", lambda *a: (probed.append(a), sized_steps(real_steps(*a)))[1])
    monkeypatch.setattr(auto_batch, "pick_batch", functools.partial(auto_batch.pick_batch, memory=memory))
    metrics = Model("n.yaml").train(data=str(data), batch=-1, multi_scale=True, **TINY, project=str(tmp_path))
    assert metrics is not None
    crowded = max(len(r.cls) for r in load_split(str(data), "train", verbose=False).records)
    # training's largest size (multi_scale: 1.5 x 64 = 96), validation's; a mosaic's four images' boxes
    assert [(a[1], a[2]) for a in probed] == [((96, 64), 4 * crowded)]
    assert [b for kind, b in memory.runs if kind == "train"] == [1, 2, 4, 8, 16]  # real steps, on this CPU
    assert "AutoBatch: batch=6 (6 per worker x 1) for 60% of GPU memory" in capsys.readouterr().out
    assert _recorded_batches(Path(metrics.save_dir)) == (6, 6)


def test_two_workers_with_different_gpus_agree_on_the_smaller_fit() -> None:
    r0 = launch(workers.auto_batch, {}, parse_device("cpu,cpu"))
    assert r0 is not None
    # rank 0 fits 82 of 70 GiB, rank 1 40 of 35: 40 per worker on both, 80 in all
    assert r0["batch"] == 80 and r0["all"] == [80, 80]
    assert r0["said"] == [
        "AutoBatch: batch=80 (40 per worker x 2) for 60% of GPU memory: a step predicted at 21.00 of 35.00 GiB "
        "available on fake:1"
    ]
