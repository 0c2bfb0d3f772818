"""freeze=, time= and pretrained=, each tested by what it changes in a real (tiny) training run or model.

Runs are tiny (64 px, 16 images, scale n, one thread, workers=0). ``time=`` runs on a controlled clock
(``detrain.engine.train.time_budget.clock`` replaced), so the number of epochs it computes is exact, not timed.
"""

from __future__ import annotations

import csv
import shutil
from collections.abc import Iterator
from pathlib import Path

import _keys_workers as workers
import pytest
import torch

from detrain import Model
from detrain.config.cfg import make_cfg
from detrain.data.dataset import DetectionDataset
from detrain.data.synthetic import generate_shapes
from detrain.distributed.launch.launcher import launch, parse_device
from detrain.engine.train import freeze, pretrained, time_budget
from detrain.errors import CheckpointError, ConfigError
from detrain.nn.model import DetectionModel
from detrain.weights.checkpoint import load_checkpoint, model_meta, save_checkpoint

NAMES = {0: "circle", 1: "rectangle", 2: "triangle"}
RELEASE_N = Path(__file__).resolve().parents[2] / ".." / "shared" / "weights" / "yolov8n.pt"
# every run: no augmentation randomness that matters, one optimizer step per batch, no warmup
TINY = dict(
    epochs=2,
    imgsz=64,
    batch=8,
    nbs=8,
    device="cpu",
    workers=0,
    warmup_epochs=0,
    close_mosaic=0,
    optimizer="SGD",
    lr0=0.01,
    val=False,
    plots=False,
    verbose=False,
    exist_ok=True,
    name="run",
)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny convolutions run faster on one thread of a busy 2-core machine
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = generate_shapes(tmp_path_factory.mktemp("keys") / "shapes", n_train=16, n_val=2, imgsz=64, seed=0)
    return root / "data.yaml"


def _save_model(model: DetectionModel, path: Path) -> Path:
    return save_checkpoint(
        {"model": {**model_meta(model, 64), "state_dict": model.state_dict()}, "ema": None, "epoch": -1}, path
    )


@pytest.fixture(scope="module")
def start(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Weights to fine-tune from (a fresh model of the dataset's classes, saved as a detrain checkpoint)."""
    torch.manual_seed(1)
    return _save_model(DetectionModel(nc=3, names=NAMES), tmp_path_factory.mktemp("start") / "start.pt")


def _state(path: Path, key: str = "model") -> dict[str, torch.Tensor]:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    return (ckpt[key] or ckpt["model"])["state_dict"]


def _rows(run: Path) -> list[dict[str, str]]:
    with open(run / "results.csv") as f:
        return list(csv.DictReader(f))


def _param_names(freeze_first: int) -> tuple[set[str], set[str]]:
    """(parameters of the first ``freeze_first`` layers, the other parameters that train) of an n model."""
    fresh = DetectionModel(nc=3)
    frozen = {n for n, _ in fresh.named_parameters() if int(n.split(".")[1]) < freeze_first}
    trained = {n for n, p in fresh.named_parameters() if p.requires_grad} - frozen
    return frozen, trained


def _check_frozen(run: Path, start: Path, freeze_first: int) -> None:
    """Frozen parameters bit-identical to ``start`` in last.pt's model and EMA, the others changed; the optimizer
    holds only the trained ones; frozen BatchNorm's running statistics followed the data (as in Ultralytics)."""
    frozen, trained = _param_names(freeze_first)
    before = _state(start)
    for key in ("model", "ema"):
        after = _state(run / "weights" / "last.pt", key)
        for name in frozen:
            assert torch.equal(after[name], before[name]), (key, name)
        changed = {name for name in trained if not torch.equal(after[name], before[name])}
        # every decayed weight moves; a bias or BatchNorm weight whose output got no gradient (a head level no
        # target was assigned to, in a run this short) may stay
        decayed = {name for name in trained if name.endswith("weight") and ".bn." not in name}
        assert decayed <= changed, (key, sorted(decayed - changed)[:5])
        assert {n.split(".")[1] for n in changed} == {n.split(".")[1] for n in trained}, key  # every layer trains
    after = _state(run / "weights" / "last.pt")
    assert not torch.equal(after["model.0.bn.running_mean"], before["model.0.bn.running_mean"])
    groups = torch.load(run / "weights" / "last.pt", weights_only=True)["optimizer"]["param_groups"]
    assert sum(len(g["params"]) for g in groups) == len(trained)


# ------------------------------------------------------------------------------------------------ freeze


def test_frozen_layers_stay_bit_identical_and_the_others_train(data: Path, start: Path, tmp_path: Path) -> None:
    run = Path(Model(str(start)).train(data=str(data), **TINY, freeze=3, project=str(tmp_path)).save_dir)
    _check_frozen(run, start, freeze_first=3)


def test_frozen_layers_stay_identical_on_two_ddp_workers(data: Path, start: Path, tmp_path: Path) -> None:
    """Every rank freezes the same layers before DDP: the gradient buckets match, training runs through, and the
    frozen weights (broadcast from rank 0 at the start) never move."""
    args = {**TINY, "batch": 16, "nbs": 16, "epochs": 1, "device": "cpu,cpu", "freeze": "0,1,2"}
    run = Path(Model(str(start)).train(data=str(data), **args, project=str(tmp_path)).save_dir)
    _check_frozen(run, start, freeze_first=3)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("10", list(range(10))),
        ("0,1,2", [0, 1, 2]),
        ("[0, 1]", [0, 1]),
        ([4, 2, 4], [2, 4]),
        ("[5]", [5]),
        ("", []),
        ("null", []),
        (0, []),
    ],
)
def test_freeze_names_the_first_layers_or_the_ones_listed(value, expected) -> None:
    model = DetectionModel(nc=2)
    assert freeze.freeze_layers(model, make_cfg({"freeze": value}).train.freeze) == expected
    fixed = sorted(
        {int(n.split(".")[1]) for n, p in model.named_parameters() if not p.requires_grad and ".dfl." not in n}
    )  # the DFL's fixed kernel never trains
    assert fixed == [i for i in expected if any(True for _ in model.model[i].parameters())]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (23, "the model has 23 layers (0 to 22) and freezing all of them leaves nothing to train"),
        ([0, 23], "the model has layers 0 to 22, not 23"),
        (list(range(23)), "names all 23 layers"),
    ],
)
def test_freeze_beyond_the_model_is_one_line(value, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        freeze.freeze_layers(DetectionModel(nc=2), value)
    assert "\n" not in str(err.value) and "'freeze'" in str(err.value)


def test_freeze_of_a_model_yaml_is_checked_from_its_layer_count(tmp_path: Path) -> None:
    small = tmp_path / "tiny.yaml"  # a hostile or odd yaml: only its layer count is read
    small.write_text("backbone:\n  - [-1, 1, Conv, [16, 3, 2]]\nhead:\n  - [[0], 1, Detect, [nc]]\n")
    freeze.check_freeze(str(small), 1)
    with pytest.raises(ConfigError, match="the model has 2 layers"):
        freeze.check_freeze(str(small), 2)
    freeze.check_freeze("yolov8s.yaml", 22)
    freeze.check_freeze("runs/x/weights/last.pt", 500)  # weights: checked when training builds the model


# -------------------------------------------------------------------------------------------------- time


def _clock(monkeypatch: pytest.MonkeyPatch, ticks: list[float]) -> list[float]:
    """Replace time_budget's clock by one reading ``ticks`` in turn; returns the list of the values read."""
    read: list[float] = []
    values = iter(ticks)

    def clock() -> float:
        read.append(next(values, 1e9))
        return read[-1]

    monkeypatch.setattr(time_budget, "clock", clock)
    return read


def _mosaic_closings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The epochs at whose start the training set's mosaic is switched off."""
    closed: list[int] = []
    original = DetectionDataset.close_mosaic

    def close_mosaic(self: DetectionDataset) -> None:
        closed.append(self.epoch)
        original(self)

    monkeypatch.setattr(DetectionDataset, "close_mosaic", close_mosaic)
    return closed


def _lf(epochs: int, e: int, lrf: float = 0.1) -> float:
    return (1 - e / epochs) * (1 - lrf) + lrf  # the linear schedule (optim.lr_lambda)


# 0.05 h = 180 s. The first epoch takes 60 s, the next ones 30 s: after epoch 1 three epochs fit (60 + 2 * 60
# left), after epoch 2 four (mean 45: 90 s left = 2 more), after 3 and 4 still four (means 40, 37.5).
TICKS = [0, 60, 90, 120, 150]


def test_time_replans_the_epochs_and_keeps_the_lr_schedule_whole(data: Path, tmp_path: Path, monkeypatch) -> None:
    read = _clock(monkeypatch, TICKS)
    closings = _mosaic_closings(monkeypatch)
    args = {**TINY, "epochs": 100, "time": 0.05, "lrf": 0.1, "close_mosaic": 1, "save_period": 1}
    run = Path(Model("n.yaml").train(data=str(data), **args, project=str(tmp_path)).save_dir)
    assert read == TICKS  # the start, then one reading after each epoch
    rows = _rows(run)
    assert [r["epoch"] for r in rows] == ["1", "2", "3", "4"]
    # the lr each epoch trained with: epoch 1 on the first plan (100 epochs), then the re-planned schedules
    planned = [(100, 0), (3, 1), (4, 2), (4, 3)]
    for row, (epochs, e) in zip(rows, planned):
        assert float(row["lr/pg1"]) == pytest.approx(0.01 * _lf(epochs, e), rel=1e-9), row["epoch"]
    last = torch.load(run / "weights" / "last.pt", weights_only=True)
    assert last["train_args"]["epochs"] == 4 and last["train_args"]["time"] == 0.05
    assert last["train_time_s"] == 150
    assert last["scheduler"]["last_epoch"] == 4
    for group in last["optimizer"]["param_groups"]:  # the schedule ended where lrf puts it
        assert group["lr"] == pytest.approx(0.01 * 0.1, rel=1e-9)
    assert closings == [3]  # close_mosaic=1: the last epoch of the run as re-planned, not of epochs=100
    assert "metrics/mAP50" in rows[-1]  # val=false still scores the last epoch


def test_a_resumed_time_run_has_only_what_is_left_and_keeps_freeze(
    data: Path, start: Path, tmp_path: Path, monkeypatch
) -> None:
    _clock(monkeypatch, [0, 60])  # 60 s an epoch: 3 epochs fit in 180 s; then the time is up (1e9 s)
    args = {**TINY, "epochs": 100, "time": 0.05, "lrf": 0.1, "freeze": 3, "save_period": 1}
    straight = Path(Model(str(start)).train(data=str(data), **args, project=str(tmp_path / "a")).save_dir)
    assert len(_rows(straight)) == 2
    saved = torch.load(straight / "weights" / "epoch1.pt", weights_only=True)
    assert saved["train_time_s"] == 60 and saved["train_args"]["epochs"] == 3
    died = tmp_path / "b" / "run"  # a run that died after epoch 1
    (died / "weights").mkdir(parents=True)
    shutil.copy(straight / "weights" / "epoch1.pt", died / "weights" / "last.pt")
    shutil.copy(straight / "results.csv", died / "results.csv")
    # resumed on a machine where an epoch takes 50 s: 120 s of the 180 are left, so 2 more epochs fit (a fresh
    # 180 s would fit 3)
    read = _clock(monkeypatch, [1000, 1050, 1100])
    Model("n.yaml").train(resume=str(died / "weights" / "last.pt"), device="cpu")
    assert read == [1000, 1050, 1100]
    assert [r["epoch"] for r in _rows(died)] == ["1", "2", "3"]
    last = torch.load(died / "weights" / "last.pt", weights_only=True)
    assert last["train_time_s"] == 160 and last["train_args"]["epochs"] == 3 and last["train_args"]["freeze"] == 3
    for group in last["optimizer"]["param_groups"]:
        assert group["lr"] == pytest.approx(0.01 * 0.1, rel=1e-9)
    _check_frozen(died, start, freeze_first=3)


def test_the_estimate_counts_whole_epochs_of_what_is_left(monkeypatch) -> None:
    _clock(monkeypatch, [0, 100, 130, 200, 400])
    budget = time_budget.TimeBudget(hours=0.1, spent_s=60)  # 360 s, 60 of them used before a resume
    assert budget.estimate(3) == 5  # 200 s left, 100 s an epoch: 2 more after the 3 done
    assert budget.estimate(4) == 6  # 170 s left, 65 s an epoch: 2 more
    assert budget.estimate(5) == 6  # 100 s left, 66.7 s an epoch: 1 more
    assert budget.estimate(6) == 6  # the time is up (overrun by 100 s): none more
    assert budget.spent_s == 460


def test_rank_0s_estimate_is_every_ranks(tmp_path: Path) -> None:
    """Rank 1's clock runs twice as fast as rank 0's: every rank still gets rank 0's number of epochs."""
    ticks = [[0, 60, 90, 120], [0, 120, 180, 240]]
    per_epoch = launch(workers.time_estimates, {"hours": 0.05, "ticks": ticks}, parse_device("cpu,cpu"))
    assert per_epoch == [[3, 3], [4, 4], [4, 4]]


def test_the_new_schedule_stands_where_the_old_one_stood() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    for group in opt.param_groups:
        group["initial_lr"] = 0.01
    scheduler = time_budget.rescheduled(opt, lambda e: _lf(4, e), next_epoch=2)
    assert scheduler.last_epoch == 2 and opt.param_groups[0]["lr"] == pytest.approx(0.01 * _lf(4, 2))
    opt.step()  # (no gradient: nothing moves) the order torch expects before a scheduler step
    scheduler.step()
    scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.001)


# -------------------------------------------------------------------------------------------- pretrained


def test_pretrained_copies_tensors_of_the_same_key_and_shape_and_says_how_many(tmp_path: Path, capsys) -> None:
    torch.manual_seed(5)
    source = DetectionModel(nc=5)  # another class count: its class outputs do not fit
    path = _save_model(source, tmp_path / "other.pt")
    torch.manual_seed(6)
    model = DetectionModel(nc=3, names=NAMES)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = make_cfg({"model": "n.yaml", "pretrained": str(path)})
    assert pretrained.start_weights(model, cfg) is model
    head = {f"model.22.cv3.{i}.2.{p}" for i in range(3) for p in ("weight", "bias")}
    total = len(init)
    out = capsys.readouterr().out
    assert f"transferred {total - len(head)}/{total} items from pretrained weights {path}" in out
    assert "; left out (kept their init): model.22.cv3.0.2, model.22.cv3.1.2, model.22.cv3.2.2\n" in out
    theirs = source.state_dict()
    for key, value in model.state_dict().items():
        if key in head:
            assert torch.equal(value, init[key]) and value.shape != theirs[key].shape, key
        else:
            assert torch.equal(value, theirs[key]), key
    assert any(not torch.equal(init[k], theirs[k]) for k in init if k not in head)  # the copy did something


@pytest.mark.skipif(not RELEASE_N.is_file(), reason="../shared/weights/yolov8n.pt not present")
def test_pretrained_release_weights_start_a_yaml_model_but_its_class_head() -> None:
    model = DetectionModel(nc=3, names=NAMES)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    done = pretrained.load_pretrained(model, str(RELEASE_N))
    copied, total = len(done.copied), len(done.copied) + len(done.left_out)
    assert (copied, total) == (319, 355)  # what Ultralytics prints for yolov8n.pt into a 3-class yolov8n.yaml
    reference = load_checkpoint(RELEASE_N)["model"]["state_dict"]
    ours = model.state_dict()
    unfit = {k for k, v in ours.items() if v.shape != reference[k].shape}
    # the class branches are narrower for 3 classes than for 80 (max(64, min(nc, 100)) channels): all of them differ
    assert unfit and all(k.startswith("model.22.cv3.") for k in unfit) and len(unfit) == total - copied
    for key, value in ours.items():
        assert torch.equal(value, init[key] if key in unfit else reference[key].to(value.dtype)), key


def test_pretrained_false_keeps_a_weights_files_architecture_only(start: Path, capsys) -> None:
    cfg = make_cfg({"model": str(start), "pretrained": False})
    loaded = Model(str(start)).net
    fresh = pretrained.start_weights(loaded, cfg)
    assert fresh is not loaded and fresh.nc == 3 and fresh.names == NAMES
    ours, theirs = fresh.state_dict(), _state(start)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert not torch.equal(ours["model.0.conv.weight"], theirs["model.0.conv.weight"])
    assert not pretrained.starts_from_weights(cfg)
    kept = make_cfg({"model": str(start)})  # pretrained=true: the file's weights, untouched
    assert pretrained.start_weights(loaded, kept) is loaded and pretrained.starts_from_weights(kept)


@pytest.mark.parametrize(
    ("source", "target", "theirs", "ours"),
    [
        ("n.yaml", "yolo11n.yaml", "yolov8", "yolo11"),
        ("yolo11n.yaml", "n.yaml", "yolo11", "yolov8"),
        ("yolo26", "yolo11n.yaml", "yolo26", "yolo11"),  # YOLO26 uses C3k2 too: its end-to-end head tells it apart
    ],
)
def test_pretrained_weights_of_another_family_are_an_error(
    tmp_path: Path, source: str, target: str, theirs: str, ours: str
) -> None:
    """YOLOv8 and YOLO11 share names such as model.0.conv.weight (and some shapes): a silent partial copy would
    start a model from weights that meant something else."""
    other = DetectionModel("yolo11n.yaml" if source == "yolo26" else source, nc=3, names=NAMES)
    if source == "yolo26":  # a file recording YOLO26's architecture (detrain reads it, cannot build it)
        other.yaml = {**other.yaml, "end2end": True, "reg_max": 1}
    path = _save_model(other, tmp_path / "other.pt")
    model = DetectionModel(target, nc=3, names=NAMES)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        pretrained.start_weights(model, make_cfg({"model": target, "pretrained": str(path)}))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"pretrained weights {path} hold a {theirs} model, but the model to train is {ours}: ")
    assert all(torch.equal(v, init[k]) for k, v in model.state_dict().items())  # nothing was copied


def test_pretrained_yolo11_weights_of_another_scale_name_what_they_leave_out(tmp_path: Path, capsys) -> None:
    path = _save_model(DetectionModel("yolo11s.yaml", nc=3, names=NAMES), tmp_path / "s.pt")
    model = DetectionModel("yolo11n.yaml", nc=3, names=NAMES)
    done = pretrained.load_pretrained(model, str(path))
    assert done.copied and done.left_out and "model.0.conv.weight" in done.left_out  # 16 channels here, 32 there
    assert "model.0.bn.num_batches_tracked" in done.copied  # a scalar: the same shape at every scale
    assert len(done.copied) + len(done.left_out) == len(model.state_dict())
    line = done.line(str(path))
    assert line.startswith(f"transferred {len(done.copied)}/{len(model.state_dict())} items from pretrained weights")
    assert "; left out (kept their init): model.0.conv, model.0.bn, model.1.conv," in line
    assert line.endswith(" more layers")


def test_training_starts_from_the_pretrained_file(data: Path, start: Path, tmp_path: Path, capsys) -> None:
    """model= a yaml, pretrained= a file, every layer but the head frozen: after training the frozen layers hold
    exactly the file's weights, so the run started from them."""
    run = Path(
        Model("n.yaml").train(data=str(data), **TINY, pretrained=str(start), freeze=22, project=str(tmp_path)).save_dir
    )
    n = len(DetectionModel(nc=3).state_dict())
    assert f"transferred {n}/{n} items from pretrained weights {start}" in capsys.readouterr().out
    _check_frozen(run, start, freeze_first=22)


def test_a_missing_or_folder_pretrained_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"pretrained weights file not found: .*nope\.pt"):
        pretrained.check_pretrained(str(tmp_path / "nope.pt"))
    (tmp_path / "dir.pt").mkdir()
    with pytest.raises(CheckpointError, match="is a folder"):
        pretrained.check_pretrained(str(tmp_path / "dir.pt"))
    pretrained.check_pretrained("yolov8n.pt")  # a release name: downloaded when training starts
    pretrained.check_pretrained(True)


def test_a_pretrained_file_that_is_no_checkpoint_is_refused_unread(tmp_path: Path) -> None:
    bad = tmp_path / "evil.pt"  # what an attacker would hand over: a pickle that runs code when loaded
    bad.write_bytes(b"\x80\x04cos\nsystem\n(S'touch " + str(tmp_path / "pwned").encode() + b"'\ntR.")
    with pytest.raises(CheckpointError):
        pretrained.load_pretrained(DetectionModel(nc=3), str(bad))
    assert not (tmp_path / "pwned").exists()
