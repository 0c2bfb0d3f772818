"""The keys that choose which classes a run sees: ``single_cls``, ``classes`` (train and val; predict has its own
filter) and ``agnostic_nms`` in validation, each tested by what it changes: the labels batches carry, the model's
classes, what validation scores and writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _val_data import ColourModel, make_coco_json_dataset, make_dataset
from torch import nn

from detrain.config.cfg import make_cfg, parse_cli_args
from detrain.data.labels.ground_truth import split_ground_truth
from detrain.data.prepare import build_train_loader, build_val_loader, load_split
from detrain.distributed.world import World
from detrain.engine.build import build_model
from detrain.engine.evaluate.score_file import score_predictions_file
from detrain.engine.evaluate.validator import predict_batch, validate
from detrain.errors import ConfigError
from detrain.weights.checkpoint import save_checkpoint


def _cfg(yaml_file: Path, **kw: Any):
    return make_cfg(
        {
            "data": str(yaml_file),
            "imgsz": 64,
            "batch": 4,
            "workers": 0,
            "verbose": False,
            "save_json": True,
            "plots": False,
            **kw,
        }
    )


def _validate(yaml_file: Path, save_dir: Path, model: nn.Module | None = None, **kw: Any) -> dict[str, Any]:
    cfg = _cfg(yaml_file, **kw)
    data = load_split(cfg.inputs.data, "val", cfg, verbose=False)
    loader = build_val_loader(data, cfg, cfg.train.batch, World())
    cpu = torch.device("cpu")
    return validate(model or ColourModel(), loader, data, cfg, cpu, World(), save_dir=save_dir, verbose=False)


def _rows(save_dir: Path) -> list[dict[str, Any]]:
    return json.loads((save_dir / "predictions.json").read_text())


def _all_labels(yaml_file: Path, split: str) -> np.ndarray:
    cfg = _cfg(yaml_file)
    return np.concatenate([r.cls for r in load_split(cfg.inputs.data, split, cfg, verbose=False).records])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("class_keys") / "ds", n_val=10, n_train=8)


@pytest.fixture(scope="module")
def plain_run(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    save_dir = tmp_path_factory.mktemp("plain") / "run"
    return {"metrics": _validate(dataset, save_dir), "save_dir": save_dir}


# ---------------------------------------------------------------------------------------------- single_cls
def test_single_cls_batches_carry_class_0_and_the_model_has_one_class(dataset: Path) -> None:
    cfg = _cfg(dataset, single_cls=True, mosaic=0.0)
    data = load_split(cfg.inputs.data, "train", cfg, verbose=False)
    assert data.nc == 1 and data.names == {0: "item"}
    raw = _all_labels(dataset, "train")
    assert len(set(raw.tolist())) > 1  # the dataset has several classes ...
    val = [b["cls"] for b in build_val_loader(data, cfg, 4, World())]
    assert torch.cat(val).view(-1).tolist() == [0.0] * len(raw)  # ... every object stays, as class 0
    train = torch.cat([b["cls"] for b in build_train_loader(data, cfg, 4, World())])
    assert len(train) and (train == 0).all()
    model, _ = build_model("n.yaml", nc=data.nc, names=data.names, verbose=False)
    assert model.nc == 1 and dict(model.names) == {0: "item"}


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny convolutions run faster on one thread of a busy machine
    yield
    torch.set_num_threads(threads)


def test_single_cls_training_writes_a_one_class_checkpoint(dataset: Path, tmp_path: Path, one_thread: None) -> None:
    from detrain import Model

    result = Model("n.yaml").train(
        data=str(dataset),
        epochs=1,
        imgsz=64,
        batch=4,
        nbs=4,
        device="cpu",
        workers=0,
        warmup_epochs=0,
        single_cls=True,
        val=False,
        fraction=0.5,
        project=str(tmp_path),
        verbose=False,
        plots=False,
    )
    last = Path(result.save_dir) / "weights" / "last.pt"
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    assert ckpt["model"]["nc"] == 1 and ckpt["model"]["names"] == {0: "item"}
    assert ckpt["train_args"]["single_cls"] is True
    # validating it on the 3-class dataset needs single_cls=true too, and the error says so
    common = dict(
        data=str(dataset),
        imgsz=64,
        batch=4,
        device="cpu",
        workers=0,
        project=str(tmp_path / "val"),
        verbose=False,
        plots=False,
    )
    with pytest.raises(
        ConfigError,
        match=r"predicts 1 classes but .* has 3; .*trained with single_cls=true: add "
        r"single_cls=true",
    ):
        Model(str(last)).val(**common)
    assert set(Model(str(last)).val(**common, single_cls=True).box.ap_class_index.tolist()) <= {0}
    # what a checkpoint says only shapes the hint: a train_args that is not a mapping gets none and breaks nothing
    save_checkpoint({**ckpt, "train_args": ["single_cls"]}, tmp_path / "odd.pt")
    with pytest.raises(ConfigError, match=r"has 3; fine-tune it on the dataset first$"):
        Model(str(tmp_path / "odd.pt")).val(**common)


def test_single_cls_validation_scores_every_object_as_one_class(
    dataset: Path, tmp_path: Path, plain_run: dict[str, Any]
) -> None:
    m = _validate(dataset, tmp_path / "run", single_cls=True)  # a 3-class model: its detections merge
    assert set(m["per_class"]) == {0}
    assert m["per_class"][0]["n_gt"] == sum(v["n_gt"] for v in plain_run["metrics"]["per_class"].values())
    assert m["map50"] == pytest.approx(1.0)
    assert {r["category_id"] for r in _rows(tmp_path / "run")} == {1}
    assert list(json.loads((tmp_path / "run" / "metrics.json").read_text())["per_class"]) == ["item"]


def test_single_cls_on_a_coco_json_split_keeps_its_ids_and_crowd(tmp_path: Path) -> None:
    yaml_file = make_coco_json_dataset(tmp_path / "ds")
    cfg = _cfg(yaml_file, single_cls=True)
    data = load_split(cfg.inputs.data, "val", cfg, verbose=False)
    gt = split_ground_truth(data)
    assert gt.category_ids.tolist() == [3]  # the first class's category id, not one the json lacks
    assert all((g.cls == 0).all() for g in gt.images.values())
    assert sum(int(g.crowd.sum()) for g in gt.images.values()) == 1
    m = _validate(yaml_file, tmp_path / "run", single_cls=True)
    assert set(m["per_class"]) == {0} and {r["category_id"] for r in _rows(tmp_path / "run")} == {3}


# ---------------------------------------------------------------------------------------------- classes
def test_classes_keep_every_image_and_only_those_labels(dataset: Path) -> None:
    cfg = _cfg(dataset, classes="0,2", mosaic=0.0)
    data = load_split(cfg.inputs.data, "train", cfg, verbose=False)
    everything = load_split(cfg.inputs.data, "train", _cfg(dataset), verbose=False)
    assert [r.im_file for r in data.records] == [r.im_file for r in everything.records]  # images stay
    raw = np.concatenate([r.cls for r in everything.records])
    kept = np.concatenate([r.cls for r in data.records])
    assert 1 in raw and sorted(kept.tolist()) == sorted(c for c in raw.tolist() if c in (0, 2))
    only_1 = [r for r, e in zip(data.records, everything.records) if set(e.cls.tolist()) == {1}]
    assert only_1 and all(len(r.cls) == 0 for r in only_1)  # an image of class 1 alone stays, as a background
    assert data.nc == 3 and data.names == everything.names  # the model keeps the dataset's classes
    train = torch.cat([b["cls"] for b in build_train_loader(data, cfg, 4, World())]).view(-1)
    assert len(train) and set(train.tolist()) <= {0.0, 2.0}


def test_classes_validation_scores_only_those_classes(dataset: Path, tmp_path: Path, plain_run: dict[str, Any]) -> None:
    m = _validate(dataset, tmp_path / "run", classes=[0])
    assert set(m["per_class"]) == {0}
    assert m["per_class"][0] == plain_run["metrics"]["per_class"][0]  # class 0 is scored as before
    assert m["map"] == pytest.approx(plain_run["metrics"]["per_class"][0]["ap"])
    rows = _rows(tmp_path / "run")
    assert rows and {r["category_id"] for r in rows} == {1}  # the other classes' detections are not written
    assert len(rows) == sum(r["category_id"] == 1 for r in _rows(plain_run["save_dir"]))
    # scoring the full predictions file with classes=0 counts the same detections
    cfg = _cfg(dataset, classes=[0], predictions=str(plain_run["save_dir"] / "predictions.json"))
    again = score_predictions_file(
        cfg, load_split(cfg.inputs.data, "val", cfg, verbose=False), tmp_path / "scored", World()
    )
    assert again["map"] == pytest.approx(m["map"], abs=1e-12) and set(again["per_class"]) == {0}


def test_classes_beyond_the_dataset_name_the_yaml(dataset: Path) -> None:
    cfg = _cfg(dataset, classes="1,7")
    with pytest.raises(ConfigError, match=r"'classes': \[7\] not among the 3 classes of .*data.yaml \(0 to 2\)"):
        load_split(cfg.inputs.data, "val", cfg, verbose=False)


# ---------------------------------------------------------------------------------------------- agnostic_nms
class TwoClassesOnOneBox(nn.Module):
    """Two anchors on almost the same box (IoU 0.9), one of class 0 (score 0.9) and one of class 1 (0.8)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], 6, 2)
        out[:, :4, 0] = torch.tensor([30.0, 30.0, 20.0, 20.0])
        out[:, :4, 1] = torch.tensor([31.0, 30.0, 20.0, 20.0])
        out[:, 4, 0], out[:, 5, 1] = 0.9, 0.8
        return out


@pytest.mark.parametrize("multi_label", [False, True])
def test_agnostic_nms_removes_an_overlapping_box_of_another_class(multi_label: bool) -> None:
    imgs = torch.zeros(1, 3, 64, 64, dtype=torch.uint8)
    kw = dict(conf=0.25, iou=0.7, max_det=300, multi_label=multi_label)
    per_class = predict_batch(TwoClassesOnOneBox(), imgs, torch.device("cpu"), **kw)[0]
    agnostic = predict_batch(TwoClassesOnOneBox(), imgs, torch.device("cpu"), agnostic=True, **kw)[0]
    assert per_class[:, 5].tolist() == [0.0, 1.0]  # different classes: both survive class-wise NMS
    assert agnostic[:, 5].tolist() == [0.0] and agnostic[0, 4].item() == pytest.approx(0.9)


class ColourModelWithEchoes(ColourModel):
    """ColourModel plus, on each box it finds, an echo of the next class scoring 0.5."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        echoes = out[:, :, :3].clone()
        echoes[:, 4:] = 0
        for c in range(3):
            echoes[:, 4 + (c + 1) % 3, c] = torch.where(out[:, 4 + c, c] > 0, 0.5, 0.0)
        return torch.cat((out, echoes), 2)


def test_agnostic_nms_in_validation(dataset: Path, tmp_path: Path, plain_run: dict[str, Any]) -> None:
    _validate(dataset, tmp_path / "echoed", ColourModelWithEchoes())
    agnostic = _validate(dataset, tmp_path / "agnostic", ColourModelWithEchoes(), agnostic_nms=True)
    plain_rows = _rows(plain_run["save_dir"])
    n_objects = sum(v["n_gt"] for v in plain_run["metrics"]["per_class"].values())
    assert len(_rows(tmp_path / "echoed")) == len(plain_rows) + n_objects  # every echo survives class-wise NMS
    assert len(_rows(tmp_path / "agnostic")) == len(plain_rows)  # and none survives agnostic NMS
    assert agnostic["map"] == pytest.approx(plain_run["metrics"]["map"], abs=1e-12)


# ---------------------------------------------------------------------------------------------- the keys
def test_the_keys_belong_to_the_right_commands() -> None:
    for command in ("train", "val"):
        cfg = make_cfg(parse_cli_args(["single_cls=true", "classes=0,2", "agnostic_nms=true"], command))
        assert (cfg.inputs.single_cls, cfg.inputs.classes, cfg.predict.agnostic_nms) == (True, [0, 2], True)
    cfg = make_cfg(parse_cli_args(["cutmix=0.5", "copy_paste=0"], "train"))
    assert (cfg.augment.cutmix, cfg.augment.copy_paste) == (0.5, 0.0)
    make_cfg(parse_cli_args(["classes=1", "agnostic_nms=true"], "predict"))
    for command, key in (("predict", "single_cls=true"), ("predict", "cutmix=0.1"), ("val", "cutmix=0.1")):
        with pytest.raises(ConfigError, match="is not used by"):
            parse_cli_args([key], command)
