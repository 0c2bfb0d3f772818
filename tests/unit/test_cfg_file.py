"""``cfg=FILE``: a yaml of keys beneath the command line's (or the Python API's keywords), as Ultralytics users
rerun a saved configuration. A run's own args.yaml is accepted back as it was written; keys of another command
are left out (a line names those not at their defaults); the file's ``mode`` is dropped and a ``resume`` it
recorded left out; an unknown key, a bad value and every hostile file are one line naming the file, exit 2.

Everything runs in this process: the command through ``detrain.cli.main`` with the work it would start replaced
by a recorder (or a tripwire, for the refusals)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import detrain.engine.export
import detrain.engine.predict.predictor
import detrain.run.task
from detrain import Model, cli
from detrain.config.cfg import make_cfg, parse_cli_args
from detrain.config.cfg_file import MAX_CFG_BYTES, MAX_VALUE_CHARS, read_cfg_file
from detrain.errors import ConfigError
from detrain.log import save_yaml

# a run's arguments as `detrain train` records them: many keys away from their defaults, of every type
RUN = {
    "model": "s.yaml",
    "data": "coco8.yaml",
    "epochs": 3,
    "imgsz": 320,
    "batch": 8,
    "amp": "bf16",
    "lr0": 0.02,
    "cos_lr": True,
    "freeze": [0, 1],
    "classes": [0, 2],
    "cache": "ram",
    "nbs": 32,
    "time": 0.5,
    "device": "cpu,cpu",
    "name": "ablation",
    "conf": 0.3,
}


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """The (task, cfg) of every run the commands start, which do not start."""
    runs: list[tuple[str, Any]] = []
    monkeypatch.setattr(detrain.run.task, "run_task", lambda task, cfg, *rest: runs.append((task, cfg)))
    return runs


def _args_yaml(path: Path, **changes: Any) -> Path:
    """A run's args.yaml, written as the trainer writes it (every key, flat)."""
    values = make_cfg({**RUN, **changes}).to_dict()
    save_yaml(path, values)
    return path


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------- accepted forms


@pytest.mark.parametrize("command", ["train", "val", "predict", "export", "info"])
def test_a_runs_args_yaml_is_accepted_back_by_every_command(here: Path, command: str, capsys) -> None:
    _args_yaml(here / "args.yaml")
    cfg = make_cfg({"cfg": "args.yaml"}, command)
    written = make_cfg(RUN).to_dict()
    from detrain.config.keys import COMMAND_KEYS

    assert {k: cfg.get(k) for k in COMMAND_KEYS[command]} == {k: written[k] for k in COMMAND_KEYS[command]}
    out = capsys.readouterr().out
    if command == "train":
        assert out == ""  # every key train takes; the others (predict's, export's) are at their defaults
    else:  # one line naming the changed keys it leaves out
        assert len(_lines(out)) == 1 and f"that 'detrain {command}' does not take" in out and "epochs" in out


def test_the_command_line_wins_over_the_file(here: Path, recorded: list, capsys) -> None:
    _args_yaml(here / "args.yaml")
    cli.main(["train", "cfg=args.yaml", "epochs=7", "device=cpu"])
    ((task, cfg),) = recorded
    assert task == "train" and cfg.train.epochs == 7 and cfg.distributed.device == "cpu"
    assert cfg.inputs.imgsz == 320 and cfg.train.amp == "bf16" and cfg.inputs.model == "s.yaml"  # the file's
    assert capsys.readouterr().out == ""


def test_the_python_api_takes_cfg_and_its_keywords_and_model_win(here: Path, recorded: list) -> None:
    _args_yaml(here / "args.yaml")
    Model("n.yaml").train(cfg="args.yaml", epochs=2)
    Model("n.yaml").val(cfg=Path("args.yaml"))
    (_, trained), (task, validated) = recorded
    assert trained.inputs.model == "n.yaml"  # the Model's own, as Ultralytics' Model.train
    assert (trained.train.epochs, trained.inputs.imgsz, trained.train.lr0) == (2, 320, 0.02)
    assert task == "val" and validated.inputs.data == "coco8.yaml" and validated.predict.conf == 0.3


def test_predict_and_export_read_the_file_too(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_yaml(here / "p.yaml", {"conf": 0.6, "imgsz": 96, "format": "torchscript", "max_det": 5})
    seen: dict[str, Any] = {}

    def predicted(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        seen["predict"] = cfg
        return iter(())

    monkeypatch.setattr(detrain.engine.predict.predictor, "stream_predict", predicted)
    monkeypatch.setattr(detrain.engine.export, "export_model", lambda net, out, **kw: seen.setdefault("export", kw))
    Model("n.yaml").predict(np.zeros((32, 32, 3), np.uint8), cfg="p.yaml")
    cli.main(["export", "cfg=p.yaml", "dynamic=false"])
    assert (seen["predict"].predict.conf, seen["predict"].inputs.imgsz, seen["predict"].predict.max_det) == (0.6, 96, 5)
    assert seen["export"]["format"] == "torchscript" and seen["export"]["imgsz"] == 96
    assert seen["export"]["dynamic_batch"] is False


def test_an_empty_file_gives_no_keys_and_task_and_mode_in_it_are_ultralytics(here: Path, capsys) -> None:
    Path("empty.yaml").write_text("# nothing yet\n")
    assert make_cfg({"cfg": "empty.yaml"}, "train") == make_cfg()
    Path("u.yaml").write_text("task: detect\nmode: train\ncfg: null\nepochs: 4\n")  # as Ultralytics writes them
    assert make_cfg({"cfg": "u.yaml"}, "val").inputs.imgsz == 640  # mode=train in the file: the command decides
    assert make_cfg({"cfg": "u.yaml"}, "train").train.epochs == 4
    assert "epochs" in capsys.readouterr().out  # val left it out, and said so


def test_a_recorded_resume_is_left_out_with_one_line_unless_given(here: Path, recorded: list, capsys) -> None:
    _args_yaml(here / "args.yaml")
    values = make_cfg(RUN).to_dict() | {"resume": "runs/train/ablation/weights/last.pt"}
    save_yaml(here / "resumed.yaml", values)
    cli.main(["train", "cfg=resumed.yaml"])
    out = capsys.readouterr().out
    assert recorded[-1][1].train.resume is False
    assert _lines(out) == [
        "note: cfg=resumed.yaml: resume: 'runs/train/ablation/weights/last.pt' is left out (a cfg file starts a "
        "new run; resume= on the command line continues one)"
    ]
    assert make_cfg({"cfg": "resumed.yaml", "resume": "true"}, "train").train.resume is True
    assert capsys.readouterr().out == ""


def test_a_key_of_another_command_on_the_command_line_is_still_an_error(here: Path) -> None:
    _args_yaml(here / "args.yaml")
    with pytest.raises(ConfigError, match="'epochs' is not used by 'detrain val'"):
        parse_cli_args(["cfg=args.yaml", "epochs=3"], "val")


def test_read_cfg_file_gives_the_name_and_the_mapping(here: Path) -> None:
    Path("a.yaml").write_text("epochs: 3\n")
    assert read_cfg_file(Path("a.yaml")) == ("a.yaml", {"epochs": 3})


# ------------------------------------------------------------------------------------------- refusals

BOMB = (
    "a0: &a0 ["
    + ", ".join(["x"] * 9)
    + "]\n"
    + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9))
)
# name -> (its content: text, bytes, or None for what the test makes itself; a fragment of the one line)
FILES: dict[str, tuple[str | bytes | None, str]] = {
    "bomb.yaml": (BOMB, "cfg=bomb.yaml: its aliases expand it past"),
    "huge.yaml": (
        "epochs: 3\n" + "#" * MAX_CFG_BYTES,
        f"cfg=huge.yaml: cannot read it (too large: {MAX_CFG_BYTES + 10} bytes",
    ),
    "deep.yaml": ("a: " + "[" * 200 + "]" * 200 + "\n", "cfg=deep.yaml: nested deeper than 64 levels"),
    "list.yaml": (
        "- epochs\n- 3\n",
        "cfg=list.yaml: expected a yaml of key: value lines (as runs/train/exp/args.yaml), found a list",
    ),
    "scalar.yaml": ("just words\n", "found a str"),
    "broken.yaml": ("epochs: [3\n", "cfg=broken.yaml: not valid YAML"),
    "latin1.yaml": (b"name: caf\xe9\n", "cfg=latin1.yaml: cannot read it (not UTF-8 text)"),
    "unknown.yaml": ("epochs: 3\nepoch: 4\n", "cfg=unknown.yaml: unknown argument 'epoch'; did you mean 'epochs'?"),
    "ultralytics.yaml": (  # show and mask_ratio are Ultralytics keys detrain lacks (a note); save_dir no key at all
        "epochs: 3\nshow: false\nsave_dir: runs/x\nmask_ratio: 4\nsave_dirs: x\n",
        "cfg=ultralytics.yaml: 2 unknown arguments: save_dir, save_dirs; run 'detrain train --help'",
    ),
    "intkey.yaml": ("1: 2\n", "cfg=intkey.yaml: unknown argument '1'"),
    "type.yaml": ("epochs: abc\n", "cfg=type.yaml: invalid value for 'epochs': 'abc'; expected an integer"),
    "listvalue.yaml": ("epochs: [1, 2]\n", "cfg=listvalue.yaml: invalid value for 'epochs': [1, 2]"),
    "dictvalue.yaml": ("model: {a: 1}\n", "cfg=dictvalue.yaml: invalid value for 'model': {'a': 1}; expected a string"),
    "range.yaml": ("imgsz: 0\n", "cfg=range.yaml: invalid value for 'imgsz': 0"),
    "control.yaml": ('name: "a\\nb"\n', "cfg=control.yaml: invalid value for 'name': 'a\\nb'"),
    "task.yaml": ("task: segment\n", "cfg=task.yaml: task=segment is not supported: detrain trains and runs detection"),
    "nested.yaml": ("cfg: other.yaml\n", "cfg=nested.yaml: a cfg file cannot name another"),
    "long.yaml": (f"model: {'x' * (MAX_VALUE_CHARS + 1)}\n", f"is {MAX_VALUE_CHARS + 1} characters long"),
    "longkey.yaml": (f"? {'k' * 100_000}\n: 1\n", "cfg=longkey.yaml: unknown argument 'kkkk"),  # explicit key
    "folder.yaml": (None, "cfg=folder.yaml: cannot read it (a folder, not a regular file)"),
    "fifo.yaml": (None, "cfg=fifo.yaml: cannot read it (a FIFO, not a regular file)"),
}
OTHERS = [
    (["train", "cfg=/dev/zero"], "cfg=/dev/zero: cannot read it (a character device, not a regular file)"),
    (["train", "cfg=missing.yaml"], "cfg=missing.yaml: file not found; give a yaml of keys, e.g."),
    (["train", "cfg="], "invalid value for 'cfg': ''; expected a yaml file of keys"),
    (["train", "cfg=a\x1b[31m.yaml"], "U+001B"),
]


def _make(name: str, content: str | bytes | None) -> None:
    if isinstance(content, bytes):
        Path(name).write_bytes(content)
    elif content is not None:
        Path(name).write_text(content)
    elif name.startswith("folder"):
        Path(name).mkdir()
    else:
        os.mkfifo(name)


@pytest.fixture
def tripwire(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("a bad cfg file got past the checks and started work")

    monkeypatch.setattr(detrain.run.task, "run_task", started)


@pytest.mark.parametrize(("name", "fragment"), [(n, f) for n, (_, f) in FILES.items()], ids=list(FILES))
def test_a_bad_or_hostile_cfg_file_is_one_line_and_exit_2(here: Path, tripwire: None, name: str, fragment: str, capsys):
    _make(name, FILES[name][0])
    _one_line_exit_2(["train", f"cfg={name}"], fragment, capsys)


@pytest.mark.parametrize(("argv", "fragment"), OTHERS, ids=[a[1].encode("unicode_escape").decode() for a, _ in OTHERS])
def test_a_cfg_that_is_no_file_is_one_line_and_exit_2(here: Path, tripwire: None, argv: list, fragment: str, capsys):
    _one_line_exit_2(argv, fragment, capsys)


def test_the_python_api_refuses_a_bad_cfg_with_the_same_line(here: Path, tripwire: None) -> None:
    _make("bomb.yaml", BOMB)
    with pytest.raises(ConfigError, match=r"cfg=bomb\.yaml: its aliases expand it past"):
        Model("n.yaml").train(cfg="bomb.yaml")
    with pytest.raises(ConfigError, match="invalid value for 'cfg': 3; expected a yaml file"):
        Model("n.yaml").val(cfg=3)


def _one_line_exit_2(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2, (out, err)
    lines = _lines(err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0], lines[0]
    assert len(lines[0]) < 400  # a short excerpt of what the file holds, never the whole of it
    assert out == ""


def test_ultralytics_default_yaml_keys_of_other_tasks_are_a_note_not_a_refusal(tmp_path, capsys):
    """What `yolo copy-cfg` writes: keys of other tasks and of features detrain lacks are left out with one note,
    a key with no value gives nothing (their yaml leaves model: and data: empty), multi_scale: 0.0 is off."""
    from detrain.config.keys import ULTRALYTICS_ONLY

    lines = [f"{k}: false" for k in sorted(ULTRALYTICS_ONLY)] + ["model:", "data:", "multi_scale: 0.0", "epochs: 7"]
    (tmp_path / "default.yaml").write_text("\n".join(lines) + "\n")
    cfg = make_cfg({"cfg": str(tmp_path / "default.yaml")}, "train")
    assert (cfg.train.epochs, cfg.inputs.model, cfg.train.multi_scale) == (7, "n.yaml", False)
    out = capsys.readouterr().out
    assert f"{len(ULTRALYTICS_ONLY)} Ultralytics keys detrain does not have are left out" in out
    assert out.count("Ultralytics keys") == 1
    with pytest.raises(ConfigError, match="unknown argument 'visualize'"):  # typed: still unknown
        make_cfg({"visualize": "true"}, "train")


def test_the_real_ultralytics_default_yaml_runs_every_command():
    default = pytest.importorskip("ultralytics").__file__
    path = Path(default).parent / "cfg" / "default.yaml"
    for command in ("train", "val", "predict", "export"):
        assert make_cfg({"cfg": str(path)}, command).train.multi_scale is False
