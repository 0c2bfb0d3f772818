"""The arguments as Ultralytics users type them: ``task=detect`` and ``mode=`` (and ``detrain detect train``,
``detrain mode=train``), an ``imgsz`` that is no multiple of 32 (rounded up, one warning line), ``amp`` by dtype
name, ``batch=-1`` or a fraction (AutoBatch). Every accepted form through the command line and the Python API,
and every refusal one line with exit 2. In this process: the work a command would start is recorded instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import detrain.distributed.launch.launcher
import detrain.run.task
from detrain import Model, cli
from detrain.config.cfg import make_cfg, parse_cli_args
from detrain.errors import ConfigError


@pytest.fixture
def recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """The (task, cfg) of every run the commands start, which do not start."""
    monkeypatch.chdir(tmp_path)
    runs: list[tuple[str, Any]] = []
    monkeypatch.setattr(detrain.run.task, "run_task", lambda task, cfg, *rest: runs.append((task, cfg)))
    return runs


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _refused(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2, (out, err)
    assert len(_lines(err)) == 1 and err.startswith("error: ") and fragment in err, err
    assert out == ""


# ------------------------------------------------------------------------------------------- task and mode


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["train", "task=detect"], "train"),
        (["train", "task=detect", "mode=train"], "train"),
        (["train", "--task", "detect", "--mode", "train"], "train"),
        (["val", "mode=val", "TASK=detect".lower()], "val"),
        (["detect", "train", "epochs=2"], "train"),  # yolo detect train ...
        (["task=detect", "mode=train", "epochs=2"], "train"),  # yolo task=detect mode=train ...
        (["mode=val", "data=coco8.yaml"], "val"),
    ],
)
def test_task_detect_and_the_commands_own_mode_are_accepted(recorded: list, argv: list[str], command: str) -> None:
    cli.main(argv)
    assert [task for task, _ in recorded] == [command]


def test_the_python_api_takes_task_and_mode(recorded: list) -> None:
    Model("n.yaml").train(task="detect", mode="train", epochs=2)
    Model("n.yaml").val(task="detect", mode="val")
    assert [(t, c.train.epochs) for t, c in recorded] == [("train", 2), ("val", 100)]
    with pytest.raises(ConfigError, match="mode=predict does not match the command 'detrain train'"):
        Model("n.yaml").train(mode="predict")
    with pytest.raises(ConfigError, match="task=segment is not supported: detrain trains and runs detection"):
        Model("n.yaml").val(task="segment")


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["train", "task=segment"], "task=segment is not supported: detrain trains and runs detection models only"),
        (["train", "task=pose", "mode=train"], "task=pose is not supported"),
        (["train", "mode=val"], "mode=val does not match the command 'detrain train': run 'detrain val ...'"),
        (["val", "mode=track"], "mode=track does not match the command 'detrain val'"),
        (["predict", "mode=export", "source=x.jpg"], "mode=export does not match"),
        (["mode=track", "epochs=3"], "No such command 'mode=track'"),  # no command of that name
    ],
)
def test_another_task_or_mode_is_one_line_and_exit_2(recorded: list, argv: list, fragment: str, capsys) -> None:
    _refused(argv, fragment, capsys)
    assert recorded == []


# ------------------------------------------------------------------------------------------- imgsz


@pytest.mark.parametrize(("given", "used"), [(100, 128), ("33", 64), (16, 32), (1, 32), (8190, 8192), ("1e2", 128)])
def test_an_imgsz_off_the_stride_is_rounded_up_with_one_warning(recorded: list, given: Any, used: int, capsys) -> None:
    cli.main(["train", f"imgsz={given}"])
    assert recorded[0][1].inputs.imgsz == used
    shown = int(float(given))
    assert _lines(capsys.readouterr().out) == [
        f"warning: imgsz={shown} is not a multiple of the largest stride 32; using imgsz={used}"
    ]


def test_the_python_api_rounds_imgsz_the_same_way(recorded: list, capsys) -> None:
    Model("n.yaml").train(imgsz=300)
    info = Model("n.yaml").info(imgsz=100, verbose=False)
    assert recorded[0][1].inputs.imgsz == 320 and info.imgsz == (128, 128)
    assert len(_lines(capsys.readouterr().out)) == 2  # one warning each


@pytest.mark.parametrize("given", [32, 640, 8192])
def test_a_multiple_of_the_stride_is_taken_silently(recorded: list, given: int, capsys) -> None:
    cli.main(["train", f"imgsz={given}"])
    assert recorded[0][1].inputs.imgsz == given and capsys.readouterr().out == ""


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("0", "'imgsz': 0; expected a value from 1 to 8192"),
        ("-32", "'imgsz': -32"),
        ("8193", "'imgsz': 8193; expected a value from 1 to 8192"),
        ("3.5", "'imgsz': '3.5'; expected an integer"),
        ("[640,481]", "'imgsz': '[640,481]'; expected one size, or [h, w] with h and w multiples of 32"),
        ("[640,480,3]", "'imgsz': '[640,480,3]'; expected one size, or [h, w]"),
    ],
)
def test_nonsense_sizes_are_still_refused(recorded: list, value: str, fragment: str, capsys) -> None:
    _refused(["train", f"imgsz={value}"], fragment, capsys)


# ------------------------------------------------------------------------------------------- amp


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("true", True),
        ("false", False),
        ("1", True),
        ("off", False),
        ("bf16", "bf16"),
        ("BF16", "bf16"),
        ("fp16", "fp16"),
        (" Fp16 ", "fp16"),
        ("fp32", False),
    ],
)
def test_amp_takes_true_false_and_dtype_names(recorded: list, value: str, expected: Any) -> None:
    cli.main(["train", f"amp={value}"])
    assert recorded[0][1].train.amp == expected


@pytest.mark.parametrize(("value", "expected"), [(True, True), (False, False), ("bf16", "bf16"), ("fp32", False)])
def test_the_python_api_takes_amp_alike(recorded: list, value: Any, expected: Any) -> None:
    Model("n.yaml").train(amp=value)
    assert recorded[0][1].train.amp == expected


@pytest.mark.parametrize("value", ["bf17", "half", "2", "int8"])
def test_other_amp_values_are_one_line(recorded: list, value: str, capsys) -> None:
    _refused(["train", f"amp={value}"], f"'amp': '{value}'; expected true, false, bf16, fp16 or fp32", capsys)


# ------------------------------------------------------------------------------------------- batch


@pytest.mark.parametrize(
    ("value", "expected"), [("16", 16), ("16.0", 16), ("1", 1), ("-1", -1), ("0.5", 0.5), ("0.95", 0.95)]
)
def test_batch_takes_a_count_or_autobatch(recorded: list, value: str, expected: Any) -> None:
    cli.main(["train", f"batch={value}"])
    got = recorded[0][1].train.batch
    assert got == expected and type(got) is type(expected)


def test_the_python_api_takes_autobatch_alike(recorded: list) -> None:
    Model("n.yaml").train(batch=-1)
    Model("n.yaml").train(batch=0.7)
    assert [c.train.batch for _, c in recorded] == [-1, 0.7]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["train", "batch=0"], "'batch': 0; expected a number of images of at least 1, or AutoBatch: -1"),
        (["train", "batch=-2"], "'batch': -2"),
        (["train", "batch=1.5"], "'batch': 1.5"),
        (["train", "batch=0.0"], "'batch': 0;"),
        (["train", "batch=nan"], "'batch': 'nan'"),
        (["train", "batch=true"], "'batch': 'true'"),
        (["val", "batch=-1"], "'batch': -1; expected a number of images for 'detrain val' (AutoBatch sizes training)"),
        (["predict", "batch=0.5", "source=x.jpg"], "'batch': 0.5; expected a number of images for 'detrain predict'"),
    ],
)
def test_other_batches_are_one_line(recorded: list, argv: list[str], fragment: str, capsys) -> None:
    _refused(argv, fragment, capsys)


def test_autobatch_passes_the_launchers_split_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """batch=-1 over three workers: nothing to split yet (the workers pick a batch that splits)."""
    monkeypatch.chdir(tmp_path)
    launched: list[Any] = []
    monkeypatch.setattr(
        detrain.distributed.launch.launcher, "launch", lambda entry, args, devices, **kw: launched.append(args)
    )
    detrain.run.task.run_task("train", make_cfg(parse_cli_args(["batch=-1", "device=cpu,cpu,cpu"], "train")))
    assert launched[0]["cfg"].train.batch == -1
    with pytest.raises(ConfigError, match="batch=16 does not split evenly over the 3 workers"):
        detrain.run.task.run_task("train", make_cfg({"batch": 16, "device": "cpu,cpu,cpu"}))
