"""End to end: a tiny model really learns the synthetic set; runs write what they promise; resume is exact."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _processes import one_thread  # noqa: F401 (a fixture)

from detrain import Model
from detrain.data.synthetic import generate_shapes


def _fit_yaml(tmp: Path, n: int, imgsz: int) -> Path:
    """A shapes set validated on its own training images (a test of learning, not of generalisation)."""
    root = generate_shapes(tmp / "shapes", n_train=n, n_val=2, imgsz=imgsz, seed=0)
    yaml = root / "fit.yaml"
    yaml.write_text("path: .\ntrain: images/train\nval: images/train\nnames: [circle, rectangle, triangle]\n")
    return yaml


def _rows(save_dir: str) -> list[dict[str, str]]:
    return list(csv.DictReader(open(Path(save_dir) / "results.csv")))


pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_tiny_model_learns_the_synthetic_set(tmp_path):
    data = _fit_yaml(tmp_path, n=32, imgsz=96)
    epochs = 40
    result = Model("n.yaml").train(
        data=str(data),
        epochs=epochs,
        imgsz=96,
        batch=8,
        nbs=8,
        device="cpu",
        workers=0,
        warmup_epochs=0,
        close_mosaic=0,
        project=str(tmp_path / "runs"),
        verbose=False,
    )
    rows = _rows(result.save_dir)
    assert [int(r["epoch"]) for r in rows] == list(range(1, epochs + 1))
    map50 = [float(r["metrics/mAP50"]) for r in rows]
    assert map50[-1] >= 0.1 and map50[-1] > map50[0] + 0.1, map50
    assert abs(result.box.map50 - map50[-1]) < 1e-4  # train() returns the final metrics
    run = Path(result.save_dir)
    for name in ("args.yaml", "results.csv", "results.png", "weights/last.pt", "weights/best.pt", "labels_train.txt"):
        assert (run / name).is_file(), name
    for name in ("last.pt", "best.pt"):
        ckpt = torch.load(run / "weights" / name, map_location="cpu", weights_only=True)
        assert ckpt["model"]["nc"] == 3
    assert float(rows[-1]["train/box_loss"]) < float(rows[0]["train/box_loss"])


def _tiny_args(data: Path, project: Path, epochs: int) -> dict:
    return dict(
        data=str(data),
        epochs=epochs,
        imgsz=64,
        batch=8,
        nbs=16,
        device="cpu",
        workers=0,
        warmup_epochs=1,
        close_mosaic=1,
        project=str(project),
        name="run",
        exist_ok=True,
        verbose=False,
        optimizer="SGD",
    )


# Updates are counted over the run (2 batches an epoch here): of 2 batches they end with each epoch; of 3 (nbs 24),
# or of 2 behind a warmup's single-batch first update, batch 3's gradients wait in epoch 2's checkpoint.
@pytest.mark.parametrize(("nbs", "warmup", "last_update"), [(16, 0, 3), (24, 0, 2), (16, 1, 2)])
def test_resume_continues_exactly(tmp_path, nbs, warmup, last_update):
    import shutil

    data = _fit_yaml(tmp_path, n=16, imgsz=64)
    args = {**_tiny_args(data, tmp_path / "a", epochs=3), "nbs": nbs, "warmup_epochs": warmup}
    straight = Path(Model("n.yaml").train(**args, save_period=1).save_dir)
    saved = torch.load(straight / "weights" / "epoch2.pt", weights_only=True)
    assert saved["last_update"] == last_update
    assert (saved["pending_grads"] is not None) == (last_update < 3)
    # a run that died after epoch 2: its folder holds that epoch's checkpoint as last.pt and two rows
    died = tmp_path / "b" / "run"
    (died / "weights").mkdir(parents=True)
    shutil.copy(straight / "weights" / "epoch2.pt", died / "weights" / "last.pt")
    shutil.copy(straight / "args.yaml", died / "args.yaml")
    rows = (straight / "results.csv").read_text().splitlines()
    (died / "results.csv").write_text("\n".join(rows[:3] + ["3,9,9,9"]) + "\n")  # a half-logged epoch 3
    resumed = Path(Model("n.yaml").train(resume=str(died / "weights" / "last.pt"), device="cpu").save_dir)
    assert resumed == died
    a = torch.load(straight / "weights" / "last.pt", weights_only=True)
    b = torch.load(died / "weights" / "last.pt", weights_only=True)
    assert a["epoch"] == b["epoch"] == 2
    for key in ("model", "ema"):
        for name, tensor in a[key]["state_dict"].items():
            assert torch.equal(tensor, b[key]["state_dict"][name]), (key, name)
    assert [r["epoch"] for r in _rows(str(died))] == ["1", "2", "3"]
    assert _rows(str(died))[2]["train/box_loss"] == _rows(str(straight))[2]["train/box_loss"]


def test_cli_train_with_a_bad_dataset_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "detrain.cli", "train", f"data={tmp_path / 'nope.yaml'}", "epochs=1"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "nope.yaml" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_nbs_auto_updates_every_batch_from_scratch_and_gathers_64_images_when_fine_tuning(tmp_path):
    """optimizer=auto, nbs=auto (the defaults): a short run from a yaml updates after every batch; the same run
    from weights gathers 64 images (8 batches of 8) per update, as YOLO's nominal batch."""
    data = _fit_yaml(tmp_path, n=16, imgsz=64)
    common = dict(
        data=str(data),
        epochs=4,
        imgsz=64,
        batch=8,
        device="cpu",
        workers=0,
        close_mosaic=0,
        val=False,
        plots=False,
        verbose=False,
        exist_ok=True,
    )
    scratch = Path(Model("n.yaml").train(**common, project=str(tmp_path / "a"), name="run").save_dir)
    first = torch.load(scratch / "weights" / "last.pt", weights_only=True)
    assert first["accumulate"] == 1 and first["last_update"] == 7  # 2 batches x 4 epochs, each one an update
    tuned = Path(
        Model(str(scratch / "weights" / "last.pt")).train(**common, project=str(tmp_path / "b"), name="run").save_dir
    )
    second = torch.load(tuned / "weights" / "last.pt", weights_only=True)
    assert second["accumulate"] == 8 and second["train_args"]["nbs"] == "auto"
