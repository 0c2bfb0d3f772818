"""A head detrain does not ship, added as a user adds one: a module of the tests' own (``tests/_toy_head.py``: the head,
its own loss and its own postprocess, registered with ``detrain.nn.head.register_head``) and a model yaml this test
writes, which names it on its last row. Nothing in detrain knows it, yet it trains two epochs (its loss items are
the progress columns and results.csv's), validates and predicts through its own postprocess, saves and reloads by
its name, and exports to ONNX and TorchScript, whose files serve val's and predict's detections."""

from __future__ import annotations

import csv
import json
import os
import pickle
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from _processes import REPO, child_env, one_thread  # noqa: F401 (a fixture)
from _toy_head import TOY_YAML, ToyHead, ToyLoss

from detrain import Model
from detrain.config.keys import Loss
from detrain.data.synthetic import generate_shapes
from detrain.engine.export import OUTPUTS
from detrain.engine.run_plan import RunPlan, user_heads
from detrain.nn.head import register_head
from detrain.weights.checkpoint import load_checkpoint, model_from_checkpoint

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:FutureWarning"),
]

IMGSZ = 64
SMALL = dict(imgsz=IMGSZ, batch=4, nbs=8, device="cpu", workers=0, warmup_epochs=0, close_mosaic=0, optimizer="SGD")
QUIET = dict(plots=False, verbose=False, exist_ok=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Path, Path]:
    """Two epochs of the toy head on 8 shapes: (the Model, holding best.pt; the data yaml; the run folder)."""
    tmp = tmp_path_factory.mktemp("toy_head")
    root = generate_shapes(tmp / "shapes", n_train=8, n_val=4, imgsz=IMGSZ, seed=0)
    yaml = tmp / "toy.yaml"
    yaml.write_text(TOY_YAML)
    model = Model(str(yaml))
    metrics = model.train(data=str(root / "data.yaml"), epochs=2, project=str(tmp), name="run", **SMALL, **QUIET)
    assert metrics is not None
    return model, root / "data.yaml", Path(metrics.save_dir)


def test_it_trains_two_epochs_with_its_own_loss(trained: tuple[Model, Path, Path]) -> None:
    model, _, save_dir = trained
    with open(save_dir / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["1", "2"]
    assert {"train/ltrb_loss", "train/class_loss", "metrics/mAP50-95"} <= rows[0].keys()
    assert not {"train/box_loss", "train/dfl_loss"} & rows[0].keys()
    assert all(float(r["train/ltrb_loss"]) > 0 and float(r["train/class_loss"]) > 0 for r in rows)
    # the config's loss section as a mapping: the head takes cls from it, keeps its own ltrb, leaves box and dfl
    criterion = model.net.criterion(asdict(Loss()), epochs=2)
    assert isinstance(criterion, ToyLoss) and criterion.gains == {"ltrb": 1.0, "cls": Loss().cls}
    # what it saved rebuilds the toy head by the name its yaml gives, with finite weights
    ckpt = load_checkpoint(save_dir / "weights" / "best.pt")
    assert ckpt["model"]["yaml"]["head"][-1][2] == "ToyHead"
    net = model_from_checkpoint(ckpt)
    assert type(net.head) is ToyHead and net.loss_names == ("ltrb_loss", "class_loss")
    assert all(torch.isfinite(p).all() for p in net.parameters())
    assert model.info(imgsz=IMGSZ, verbose=False).table[-1].args == [
        3,
        [32, 64, 128],
        16,
    ]  # its own yaml_args, 3 shapes


def _picture(data_yaml: Path) -> np.ndarray:
    image = sorted((data_yaml.parent / "images" / "val").iterdir())[0]
    picture = cv2.imread(str(image))
    assert picture is not None
    return picture


def test_it_validates_and_predicts_through_its_own_postprocess(trained: tuple[Model, Path, Path]) -> None:
    model, data_yaml, save_dir = trained
    before = ToyHead.postprocessed
    metrics = model.val(data=str(data_yaml), imgsz=IMGSZ, batch=4, device="cpu", workers=0, project=str(save_dir))
    assert metrics is not None and 0.0 <= metrics.box.map <= 1.0
    validated = ToyHead.postprocessed
    assert validated > before  # its own postprocess, not NMS
    results = model.predict(_picture(data_yaml), imgsz=IMGSZ, conf=0.0, max_det=7)
    assert ToyHead.postprocessed > validated
    boxes = results[0].boxes
    assert 0 < len(boxes.conf) <= 7 and np.isfinite(boxes.xyxy).all()


@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
def test_it_exports_and_the_exported_file_serves(trained: tuple[Model, Path, Path], fmt: str) -> None:
    model, data_yaml, save_dir = trained
    out = model.export(format=fmt, imgsz=IMGSZ)
    assert out.is_file() and out.parent == save_dir / "weights"
    if fmt == "torchscript":
        extra = {"detrain.json": ""}
        graph = torch.jit.load(str(out), _extra_files=extra)
        meta = json.loads(extra["detrain.json"])
        assert meta["output"] == OUTPUTS["boxes"] and meta["end2end"] is False and meta["free_size"] is True
        x = torch.rand(2, 3, IMGSZ, IMGSZ)
        with torch.no_grad():
            want = model.net.eval()(x)
            torch.testing.assert_close(graph(x), want, rtol=1e-4, atol=1e-4)
    served = Model(str(out))  # val and predict run the file: its boxes and scores through NMS
    metrics = served.val(data=str(data_yaml), imgsz=IMGSZ, batch=4, device="cpu", workers=0, project=str(save_dir))
    assert metrics is not None and 0.0 <= metrics.box.map <= 1.0
    results = served.predict(_picture(data_yaml), imgsz=IMGSZ, conf=0.0, max_det=5)
    assert len(results[0].boxes.conf) == 5


_CHILD = """
import pickle, sys
from detrain.nn.head import head_class
plan = pickle.loads(sys.stdin.buffer.read())  # imports _toy_head: ToyHead registers itself, ToyAlias does not
before = head_class("ToyAlias")
plan.register_heads()
print(before is None, head_class("ToyAlias") is head_class("ToyHead") is not None)
"""


def test_spawned_workers_register_the_heads_the_launching_process_registered() -> None:
    """What ``run_task`` hands every worker (``RunPlan.heads``) registers a user's heads in a fresh process, which
    ``train_worker`` and ``val_worker`` do before anything is built; by reference, so the head's module is imported."""
    register_head(ToyHead, "ToyAlias")  # a name only this process gives it: importing _toy_head there does not
    plan = RunPlan(heads=user_heads())
    assert ("ToyAlias", ToyHead) in plan.heads and ("ToyHead", ToyHead) in plan.heads
    assert all(not cls.__module__.startswith("detrain.") for _, cls in plan.heads)
    tests = Path(__file__).resolve().parents[1]
    env = child_env(PYTHONPATH=os.pathsep.join([str(REPO), str(tests)]))
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], input=pickle.dumps(plan), env=env, capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split() == ["True", "True"]
