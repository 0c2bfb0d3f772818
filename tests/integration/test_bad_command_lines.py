"""Bad command lines: every malformed key or value ends with exit code 2 and one line on stderr, before any
process starts, any run folder is made or any data is generated.

The rows were found by probing ``detrain`` as an attacker would: wrong types, values out of range, empty
values, malformed device lists, repeated keys, words without '=', unknown keys and commands, keys of another
command, paths that do not exist or are folders, nan and inf, huge integers, and control or invisible
characters in names. They run in this process through ``detrain.cli.main`` (which turns an error into the
line and the exit code exactly as the console script does); a few run as real ``detrain`` processes.

A tripwire guards the rows run in this process: should a bad value get past the checks, launching a worker,
building a model, exporting or converting raises at once, so a regression fails here instead of starting a
100-epoch run.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

from detrain import __version__, cli
from detrain.config.cfg import make_cfg, parse_cli_args

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# Files the rows refer to, made in the test's own folder (the working directory): an image, a text file, a
# folder named like weights and a plain file where a project folder would go.
IMAGE, TEXT, FOLDER_PT, PLAIN_FILE = "img.jpg", "notes.txt", "folder.pt", "afile"
# ~500 bytes of nested aliases (9 lists of 9 references to the one before): 6 GB once expanded (issue 25)
BOMB = "bomb.yaml"
BOMB_TEXT = "a0: &a0 [" + ", ".join(["lol"] * 9) + "]\n"
BOMB_TEXT += "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9))
BOMB_TEXT += "scales: *a8\nbackbone: []\nhead: []\n"
# model yamls and checkpoints that ask too much or hold what no model can use (issue 25): written by the fixture
WIDE, DEEP, NAN_PT, SHAPE_PT, NAMES_PT = "wide.yaml", "deep.yaml", "nan.pt", "shape.pt", "names.pt"

BAD_LINES: list[tuple[list[str], str]] = [
    # values of the wrong type
    (["train", "epochs=abc"], "'epochs': 'abc'; expected an integer"),
    (["train", "imgsz=3.5"], "'imgsz': '3.5'; expected an integer"),
    (["train", "batch=true"], "'batch': 'true'; expected a number of images of at least 1, or AutoBatch"),
    (["train", "amp=maybe"], "'amp': 'maybe'; expected true, false, bf16, fp16 or fp32"),
    (["train", "lr0=fast"], "'lr0': 'fast'; expected a number"),
    (["train", "epochs=3=4"], "'epochs': '3=4'"),
    (["train", "--epochs"], "'epochs': 'true'"),  # a flag without its value
    # out of range
    (["train", "imgsz=0"], "'imgsz': 0"),
    (["train", "imgsz=-32"], "'imgsz': -32"),
    (["train", "imgsz=[640, 481]"], "'imgsz': '[640, 481]'; expected one size, or [h, w]"),  # sides of 32s
    (["train", "imgsz=8224"], "'imgsz': 8224"),
    (["train", "epochs=-1"], "'epochs': -1"),
    (["train", "batch=0"], "'batch': 0"),
    (["train", "lr0=-1"], "'lr0': -1.0"),
    (["train", "fraction=1.5"], "'fraction': 1.5"),
    (["train", "iou=2"], "'iou': 2.0"),
    (["train", "conf=-0.1"], "'conf': -0.1"),
    (["train", "workers=-1"], "'workers': -1"),
    (["train", "master_port=70000"], "'master_port': 70000"),
    (["train", "mosaic=2"], "'mosaic': 2.0"),
    (["train", "cutmix=1.5"], "'cutmix': 1.5; expected a value from 0.0 to 1.0"),
    (["train", "cutmix=-0.1"], "'cutmix': -0.1"),
    (["train", "cutmix=nan"], "'cutmix': 'nan'; expected a finite number"),
    (["train", "copy_paste=0.5"], "'copy_paste': 0.5; expected 0: copy-paste needs instance polygons"),
    (["train", "copy_paste=2"], "'copy_paste': 2.0; expected a value from 0.0 to 1.0"),
    (["train", "single_cls=maybe"], "'single_cls': 'maybe'; expected true or false"),
    (["val", "single_cls=2", "data=coco8.yaml"], "'single_cls': '2'; expected true or false"),
    (["train", "agnostic_nms=yes please"], "'agnostic_nms': 'yes please'"),
    (["train", "classes=person"], "'classes': 'person'; expected class ids"),
    (["train", "classes=0,-1"], "'classes': '0,-1'; expected class ids of at least 0"),
    (["val", "classes=1.5", "data=coco8.yaml"], "'classes': '1.5'; expected class ids"),
    (["train", "patience=-1"], "'patience': -1"),
    (["train", "seed=-1"], "'seed': -1"),  # numpy refuses negative seeds: it failed in the workers
    (["train", "save_period=-2"], "'save_period': -2"),
    (["train", "dist_timeout=1e12"], "'dist_timeout'"),  # overflowed the collective's timer
    (["train", "optimizer=lion"], "'optimizer': 'lion'"),
    (["train", "nnodes=3:2"], "'nnodes': '3:2'"),
    (["train", "nnodes=0"], "'nnodes': '0'"),
    (["train", "nnodes=abc"], "'nnodes': 'abc'"),
    (["train", "nnodes=2", "node_rank=5"], "'node_rank': 5; expected a value from 0 to 1"),
    (["train", "nnodes=2"], "master_port"),  # several nodes need a known port
    (["train", "nnodes=1:2", "master_port=29500"], "rdzv_backend=c10d"),
    (["train", "batch=3", "device=cpu,cpu"], "batch=3"),
    (["predict", f"source={IMAGE}", "line_width=40000"], "'line_width': 40000"),  # OpenCV's limit is 32767
    (["export", "opset=5"], "'opset': 5"),
    # nan, inf and huge numbers
    (["train", "lr0=nan"], "'lr0': 'nan'; expected a finite number"),
    (["train", "dist_timeout=inf"], "'dist_timeout': 'inf'"),
    (["train", "warmup_epochs=-inf"], "'warmup_epochs': '-inf'"),
    (["train", "imgsz=1e400"], "'imgsz': '1e400'"),
    (["train", "epochs=99999999999999999999999999"], "'epochs': 99999999999999999999999999"),
    (["train", "seed=4294967296"], "'seed': 4294967296"),
    (["train", "batch=9007199254740993"], "'batch': 9007199254740993"),  # exact: not rounded through a float
    # empty where a value is needed
    (["train", "data="], "'data': ''"),
    (["train", "model="], "'model': ''"),
    (["val", "model=", "data=coco8.yaml"], "'model': ''"),
    (["train", "master_addr="], "'master_addr': ''"),
    (["train", "imgsz="], "'imgsz': ''"),
    (["predict", "model=n.yaml", "source="], "source="),
    # malformed device lists
    (["train", "device=cpu,,"], "device=cpu,, has an empty entry"),  # started a 100-epoch run on one CPU
    (["train", "device=,0"], "device=,0 has an empty entry"),
    (["train", "device=cpu, ,cpu"], "has an empty entry"),
    (["train", "device=0,0"], "device=0,0 lists cuda:0 twice"),
    (["train", "device=0,cpu"], "device=0,cpu mixes cpu and cuda"),
    (["train", "device=cpu,mps"], "device=cpu,mps mixes"),
    (["train", "device=-2"], "device=-2"),  # -1 is Ultralytics' idlest GPU (the CPU without one)
    (["train", "device=999"], "device=999"),  # no such GPU (or no CUDA at all)
    (["train", "device=cuda:x"], "'cuda:x' is not a device"),
    (["train", "device=cpu:0"], "'cpu:0' is not a device"),
    (["train", "device=[0,1"], "device=[0,1 has an unbalanced bracket"),
    (["val", "device=cpu,,"], "device=cpu,,"),
    (["predict", f"source={IMAGE}", "device=cpu,,"], "device=cpu,,"),  # predict had a parser of its own
    # a key given twice: an error naming it (Ultralytics keeps the last one without a word)
    (["train", "epochs=1", "epochs=2"], "'epochs' is given twice (epochs=1, then epochs=2)"),
    (["train", "--epochs", "1", "epochs=2"], "'epochs' is given twice"),
    (["train", "device=cpu", "device=0"], "'device' is given twice"),
    (["train", "--cos-lr", "cos_lr=false"], "'cos_lr' is given twice"),
    # not key=value
    (["train", "epochs"], "'epochs' is not key=value"),
    (["train", "=3"], "'=3' has no key"),
    (["train", "-e", "3"], "'-e' is not key=value"),
    # unknown keys, with the closest one suggested
    (["train", "epoch=3"], "unknown argument 'epoch'; did you mean 'epochs'?"),
    (["train", "EPOCHS=3"], "unknown argument 'EPOCHS'; did you mean 'epochs'?"),
    (["train", "ep\noch=3"], "unknown argument 'ep\\noch'"),
    (["export", "foo=1"], "unknown argument 'foo'; run 'detrain export --help'"),
    # unknown commands, missing or extra words
    (["trian"], "No such command 'trian'"),
    (["--version"], "--version"),
    (["version", "extra"], "(extra)"),
    (["convert"], "Missing argument"),
    (["convert", "a.pt", "b.pt", "c.pt"], "(c.pt)"),
    # keys of another command
    (["train", "format=onnx"], "'format' is not used by 'detrain train' (it is for export)"),
    (["train", f"source={IMAGE}"], "'source' is not used by 'detrain train'"),
    (["val", "epochs=3"], "'epochs' is not used by 'detrain val' (it is for train)"),
    (["val", f"source={IMAGE}"], "'source' is not used by 'detrain val'"),
    (["predict", f"source={IMAGE}", "epochs=3"], "'epochs' is not used by 'detrain predict'"),
    (["export", "epochs=3"], "'epochs' is not used by 'detrain export'"),  # exported a model with exit 0
    (["val", "cutmix=0.5"], "'cutmix' is not used by 'detrain val' (it is for train)"),
    (
        ["predict", f"source={IMAGE}", "single_cls=true"],
        "'single_cls' is not used by 'detrain predict' (it is for val and train)",
    ),
    (["export", "classes=0"], "'classes' is not used by 'detrain export' (it is for val and predict and train)"),
    # paths that do not exist, or are folders or the wrong kind of file
    (["train", "data=missing.yaml"], "dataset yaml 'missing.yaml' not found"),
    (["train", "data=/"], "dataset yaml '/' is a folder"),
    (["train", "model=/etc"], "model '/etc' not found"),
    (["train", f"model={TEXT}"], f"model '{TEXT}' not found"),
    (["train", "model=missing.pt"], "weights file not found: missing.pt"),
    (["train", f"model={FOLDER_PT}"], f"weights '{FOLDER_PT}' is a folder"),
    (["train", "resume=missing.pt"], "checkpoint not found: missing.pt"),
    (["train", "resume=/"], "checkpoint not found: /"),
    (["train", "resume=true"], "resume=True but no"),
    (["val", "model=missing.pt", "data=coco8.yaml"], "weights file not found: missing.pt"),
    (["val", f"model={FOLDER_PT}", "data=coco8.yaml"], f"weights '{FOLDER_PT}' is a folder"),
    (["val", "predictions=missing.json", "data=coco8.yaml"], "predictions file not found: missing.json"),
    (["predict", "source=missing.jpg"], "source 'missing.jpg' does not exist"),
    (["predict", f"source={IMAGE}", "model=/etc"], "model '/etc' not found"),
    (["predict", f"source={IMAGE}", "model=missing.pt"], "weights file not found: missing.pt"),
    (["export", "model=missing.pt"], "weights file not found: missing.pt"),
    (["convert", "missing.pt", "out.pt"], "weights file not found: missing.pt"),
    (["train", f"project={PLAIN_FILE}"], f"'{PLAIN_FILE}' is a file, not a folder"),
    (["train", f"project={PLAIN_FILE}/sub"], f"'{PLAIN_FILE}' is a file, not a folder"),
    (["predict", f"source={IMAGE}", f"project={PLAIN_FILE}"], f"'{PLAIN_FILE}' is a file"),
    # freeze, time, pretrained
    (["train", "freeze=23"], "'freeze': 23; the model has 23 layers (0 to 22)"),  # n.yaml: nothing would train
    (["train", "freeze=0,30"], "the model has layers 0 to 22, not 30"),
    (["train", "model=yolov8s.yaml", "freeze=[99]"], "not 99"),
    (["train", "freeze=-1"], "'freeze': '-1'; expected a number of first layers"),
    (["train", "freeze=true"], "'freeze': 'true'"),
    (["train", "freeze=1.5"], "'freeze': '1.5'"),
    (["train", "freeze=0,,1"], "'freeze': '0,,1'"),
    (["train", "freeze=99999999999"], "'freeze': '99999999999'; expected layer numbers of at most"),
    (["train", "time=-1"], "'time': -1.0"),
    (["train", "time=abc"], "'time': 'abc'"),
    (["train", "time=nan"], "'time': 'nan'"),
    (["train", "time=1e6"], "'time': 1000000.0; expected a value from 0.0 to 8760"),  # seconds given as hours
    (["train", "pretrained=missing.pt"], "pretrained weights file not found: missing.pt"),
    (["train", f"pretrained={FOLDER_PT}"], f"pretrained weights '{FOLDER_PT}' is a folder"),
    (["train", "pretrained=n.yaml"], "'pretrained': 'n.yaml'; expected true, false or a weights file"),
    (["train", "model=yolov8n.pt", "pretrained=yolov8s.pt"], "expected true or false with model=yolov8n.pt"),
    (["val", "freeze=3", "data=coco8.yaml"], "'freeze' is not used by 'detrain val'"),
    (["predict", f"source={IMAGE}", "time=1"], "'time' is not used by 'detrain predict'"),
    # run names: one folder inside project, printable, within the filesystem's limit
    (["train", "name=../../etc"], "'name': '../../etc'; expected one folder name"),
    (["train", "name=a/b"], "'name': 'a/b'"),
    (["train", "name=.."], "'name': '..'"),
    (["train", "name=a\\b"], "'name'"),
    (["train", "name=" + "x" * 256], "at most 255 bytes"),
    (["train", "name=a\nb"], "'name': 'a\\nb'"),  # a second, forged log line
    (["train", "name=run\u202egnp.exe"], "U+202E"),  # a right-to-left override hides the real name
    (["train", "project=runs\x1b[31m"], "U+001B"),  # a terminal escape sequence
    (["train", "data=a\x00b.yaml"], "U+0000"),  # NUL broke the path functions with a traceback
    (["train", "name=\udcff"], "U+DCFF"),  # bytes that are not UTF-8 could not even be printed
    # hostile files and their caps (issue 25)
    (["train", "max_pixels=0"], "'max_pixels': 0"),
    (["train", f"model={BOMB}"], f"model yaml {BOMB}: its aliases expand it past"),
    (["predict", f"source={IMAGE}", f"model={BOMB}"], f"model yaml {BOMB}: its aliases expand it past"),
    (["train", "project=/proc/detrain/runs"], "cannot make a folder in '/proc' (No such file or directory)"),
    (["train", f"model={WIDE}"], f"model yaml {WIDE}: model scale n: depth and width multiples of [0.33, 1000000.0]"),
    (["predict", f"source={IMAGE}", f"model={WIDE}"], f"model yaml {WIDE}: model scale n: depth and width"),
    (["train", f"model={DEEP}"], f"model yaml {DEEP}, layer 2 (C2f [128, True]) cannot be built: 330000 repeats"),
    (["convert", NAN_PT, "out.pt"], f"{NAN_PT}: weight model.0.conv.weight of its 'model' holds NaN or infinite"),
    (["info", f"model={NAN_PT}"], f"{NAN_PT}: weight model.0.conv.weight of its 'model' holds NaN or infinite"),
    (["convert", SHAPE_PT, "out.pt"], "model.0.conv.weight has shape (8, 3, 3, 3), expected (16, 3, 3, 3)"),
    (["convert", NAMES_PT, "out.pt"], f"{NAMES_PT}: its class names must map the indices 0 to 1 to names; key 'a'"),
    (["val", "data=coco8.yaml", "project=/proc/x"], "cannot make a folder in '/proc'"),
    (["predict", f"source={IMAGE}", "project=/proc/x"], "cannot make a folder in '/proc'"),
]


def _id(row: tuple[list[str], str]) -> str:
    return " ".join(row[0]).encode("unicode_escape").decode()[:60]


@functools.cache
def _hostile_files() -> dict[str, bytes]:
    """The model yamls and checkpoints of the issue-25 rows, made once: a yaml with width multiple 1e6, one with a
    million repeats, and a 2-class YOLOv8n checkpoint with a NaN weight, with a weight of another shape, and with
    class names keyed by text."""
    import copy
    import tempfile

    import torch
    import yaml

    from detrain.nn.model import DetectionModel, load_model_yaml
    from detrain.weights.checkpoint import FORMAT, model_meta, save_checkpoint

    d, _ = load_model_yaml("yolov8.yaml")
    wide = {**copy.deepcopy(d), "scale": "n"}
    wide["scales"]["n"] = [0.33, 1e6, 1024]
    deep = {**copy.deepcopy(d), "scale": "n"}
    deep["backbone"][2][1] = 10**6
    files = {WIDE: yaml.safe_dump(wide).encode(), DEEP: yaml.safe_dump(deep).encode()}
    net = DetectionModel(nc=2)
    for name, key, value in [
        (NAN_PT, "model.0.conv.weight", None),
        (SHAPE_PT, "model.0.conv.weight", torch.zeros(8, 3, 3, 3)),
        (NAMES_PT, "names", {"a": "cat", "b": "dog"}),
    ]:
        meta = {**copy.deepcopy(model_meta(net, 64)), "state_dict": copy.deepcopy(net.state_dict())}
        if name == NAN_PT:
            meta["state_dict"][key][0, 0, 0, 0] = float("nan")
        elif name == SHAPE_PT:
            meta["state_dict"][key] = value
        else:
            meta[key] = value
        with tempfile.TemporaryDirectory() as tmp:  # save_checkpoint writes a file (atomically)
            if name == NAN_PT:  # save_checkpoint refuses non-finite weights: the file a damaged disk would leave
                torch.save({"format": FORMAT, "version": __version__, "model": meta, "ema": None}, Path(tmp) / name)
                files[name] = (Path(tmp) / name).read_bytes()
            else:
                files[name] = save_checkpoint({"model": meta, "ema": None}, Path(tmp) / name).read_bytes()
    return files


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory with the few files the rows name, outside any launcher, with the tripwire."""
    monkeypatch.chdir(tmp_path)
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    for var in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC"))]:
        monkeypatch.delenv(var)
    cv2.imwrite(IMAGE, np.zeros((32, 32, 3), np.uint8))
    Path(TEXT).write_text("not a model\n")
    Path(FOLDER_PT).mkdir()
    Path(PLAIN_FILE).write_text("a file where a folder would go\n")
    Path(BOMB).write_text(BOMB_TEXT)
    for name, data in _hostile_files().items():
        Path(name).write_bytes(data)

    def tripwire(*args: object, **kwargs: object) -> None:
        raise AssertionError("a bad command line got past the checks and started work")

    import torch.distributed.launcher.api as elastic

    import detrain.engine.evaluate.val_worker
    import detrain.engine.export
    import detrain.engine.predict.predictor
    import detrain.engine.train.trainer
    import detrain.weights.checkpoint

    monkeypatch.setattr(elastic, "elastic_launch", tripwire)
    monkeypatch.setattr(detrain.engine.train.trainer, "train_worker", tripwire)
    monkeypatch.setattr(detrain.engine.evaluate.val_worker, "val_worker", tripwire)
    monkeypatch.setattr(detrain.engine.predict.predictor, "build_model", tripwire)
    monkeypatch.setattr(detrain.engine.export, "export_onnx", tripwire)
    monkeypatch.setattr(detrain.weights.checkpoint, "save_checkpoint", tripwire)
    return tmp_path


def test_there_are_many_rows_and_no_duplicates():
    assert len(BAD_LINES) >= 40
    lines = [tuple(argv) for argv, _ in BAD_LINES]
    assert len(set(lines)) == len(lines)


@pytest.mark.parametrize(("argv", "fragment"), BAD_LINES, ids=[_id(r) for r in BAD_LINES])
def test_a_bad_command_line_is_one_line_and_exit_2(argv, fragment, workspace, capsys):
    before = sorted(os.listdir(workspace))
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2, (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0], lines[0]
    assert out == ""
    assert sorted(os.listdir(workspace)) == before  # no run folder, no download, no output file


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "device=cpu,,"],
        ["train", "epochs=1", "epochs=2"],
        ["trian", "epochs=3"],
        ["val", "data=missing.yaml"],
        ["train", "name=a\nb"],
        ["train", b"name=\xff"],  # not UTF-8: Python reads it as U+DCFF
    ],
    ids=[
        "empty-device-entry",
        "repeated-key",
        "unknown-command",
        "missing-data",
        "newline-in-name",
        "undecodable-name",
    ],
)
def test_the_detrain_command_itself_prints_one_line_and_exits_2(argv, tmp_path):
    """End to end: the console script (or ``python -m detrain.cli`` where it is not installed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    script = shutil.which("detrain")
    command = [script] if script else [sys.executable, "-m", "detrain.cli"]
    try:
        proc = subprocess.run([*command, *argv], capture_output=True, env=env, cwd=tmp_path, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{argv} did not end within 120 s: it started work")
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert "Traceback" not in err and proc.stdout == b""
    assert list(tmp_path.iterdir()) == []


def test_bare_detrain_prints_the_help_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([])
    out, err = capsys.readouterr()
    assert exit_.value.code == 0 and "Usage: detrain" in out and "train" in out and err == ""


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["device=[0, 1]"], {"device": "[0, 1]"}),
        (["device=0 1"], {"device": "0 1"}),
        (["device="], {"device": ""}),  # the default: the first GPU, else the CPU
        (["epochs=1e2", "batch=16.0"], {"epochs": 100, "batch": 16}),  # whole numbers, as Ultralytics reads them
        (["imgsz= 320"], {"imgsz": 320}),
        (["name=實驗-1", "project=runs/ablations/ü"], {"name": "實驗-1", "project": "runs/ablations/ü"}),
        (["name=", "project="], {"name": "", "project": ""}),
        (["nnodes=2", "node_rank=1", "master_port=29500"], {"node_rank": 1}),
        (["seed=2147483647"], {"seed": 2147483647}),
        (["--cos-lr", "--epochs", "3"], {"cos_lr": True, "epochs": 3}),
        (
            ["single_cls=true", "classes=[0, 2]", "agnostic_nms=1"],
            {"single_cls": True, "classes": [0, 2], "agnostic_nms": True},
        ),
        (["cutmix=0.3", "copy_paste=0.0", "classes="], {"cutmix": 0.3, "copy_paste": 0.0, "classes": None}),
        (
            ["freeze=0,1,2", "time=0.5", "pretrained=yolov8n.pt"],
            {"freeze": [0, 1, 2], "time": 0.5, "pretrained": "yolov8n.pt"},
        ),
        (["freeze=10", "time=null", "pretrained=false"], {"freeze": 10, "time": None, "pretrained": False}),
        (["freeze=[0, 1]", "--time", "2"], {"freeze": [0, 1], "time": 2.0}),
    ],
    ids=lambda v: str(v)[:40],
)
def test_the_valid_forms_beside_the_bad_ones_still_parse(argv, expected):
    cfg = make_cfg(parse_cli_args(argv, "train"))
    assert {key: cfg.get(key) for key in expected} == expected


def test_each_command_help_lists_exactly_its_keys():
    from typer.testing import CliRunner

    runner = CliRunner()
    val_help = runner.invoke(cli.app, ["val", "--help"]).output
    assert "nnodes=" in val_help and "split=" in val_help and "epochs=" not in val_help
    train_help = runner.invoke(cli.app, ["train", "--help"]).output
    assert "epochs=" in train_help and "source=" not in train_help and "opset=" not in train_help
