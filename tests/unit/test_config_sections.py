"""The config in sections (detrain/config/keys.py) is the one source of every key's default, valid values and help:
cfg/default.yaml is generated from it, ``--help`` prints it, ``make_cfg`` enforces it, and each value is read and
checked once. tests/test_config.py and tests/test_bad_command_lines.py cover the messages of bad values one by one;
these tests hold the structure and the hostile shapes of input the sections bring."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

import detrain.config.cfg as config
import detrain.config.values as values
from detrain import cli
from detrain.config import default_yaml as config_yaml
from detrain.config.cfg import COMMAND_KEYS, Cfg, make_cfg, parse_cli_args, parse_value
from detrain.config.keys import COMMANDS, LAUNCH_KEYS, SECTION_OF, SECTIONS, SPECS, TYPES, comments, defaults
from detrain.distributed.world import World
from detrain.engine.run_plan import RunPlan
from detrain.errors import ConfigError


def _squeezed(text: str) -> str:
    """``text`` without whitespace: --help wraps its lines wherever it likes."""
    return re.sub(r"\s+", "", text)


# ------------------------------------------------------------------------------------------------- structure


def test_every_key_is_in_exactly_one_section_and_no_section_is_named_like_a_key() -> None:
    seen: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in seen, f"{f.name} is in {seen[f.name]} and {section}"
            seen[f.name] = section
    assert seen == SECTION_OF
    assert set(seen) == set(defaults()) == set(make_cfg().to_dict()) == set().union(*COMMAND_KEYS.values())
    # cfg.train.val can never be read as a key again; augment is Ultralytics' key (test-time augmentation,
    # cfg.predict.augment) beside training's augmentation section (cfg.augment)
    assert set(SECTIONS) & set(SECTION_OF) == {"augment"} and SECTION_OF["augment"] == "predict"
    assert not {"to_dict", "get", "replace"} & set(SECTION_OF)
    assert [f.name for f in dataclasses.fields(Cfg)] == list(SECTIONS)


def test_each_key_names_commands_that_exist_and_the_launch_keys_serve_every_launching_command() -> None:
    """A misspelt command in a key's ``commands`` would hide it from that command's --help and refuse it there."""
    commands = {c.name or c.callback.__name__ for c in cli.app.registered_commands if c.callback is not None}
    assert set(COMMANDS) <= commands
    for name, spec in SPECS.items():
        assert spec.commands and set(spec.commands) <= set(COMMANDS), name
    assert LAUNCH_KEYS and all({"train", "val"} <= set(SPECS[name].commands) for name in LAUNCH_KEYS)


def test_each_field_carries_its_spec_and_help_beside_it() -> None:
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            assert f.metadata["spec"] is SPECS[f.name]
            help_text = SPECS[f.name].help
            assert help_text.strip() and "\n" not in help_text and "#" not in help_text, f.name


def test_the_defaults_are_valid_and_already_in_the_form_make_cfg_gives() -> None:
    """make_cfg reads only what it is given: that is sound because every default reads back as itself."""
    for name, default in defaults().items():
        parsed = parse_value(name, default)
        assert parsed == default and type(parsed) is type(default), name
    assert make_cfg() == Cfg()


def test_sections_are_frozen_and_keys_stay_flat_outside() -> None:
    cfg = make_cfg({"epochs": "7", "mosaic": 0.5, "device": "cpu"})
    assert (cfg.train.epochs, cfg.augment.mosaic, cfg.distributed.device) == (7, 0.5, "cpu")
    assert cfg.get("epochs") == 7 and cfg.to_dict()["mosaic"] == 0.5
    with pytest.raises(KeyError):
        cfg.get("train")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.augment.mosaic = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train = cfg.train  # type: ignore[misc]


def test_a_config_survives_args_yaml_and_a_checkpoint_flat() -> None:
    """args.yaml and a checkpoint's train_args hold to_dict(); reading them back (resume) gives the same Cfg."""
    cfg = make_cfg(
        {
            "epochs": 3,
            "freeze": "0,2",
            "classes": [1],
            "cache": True,
            "time": 0.5,
            "nnodes": "1:2",
            "rdzv_backend": "c10d",
            "name": "exp-7",
        }
    )
    assert make_cfg(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg


# ------------------------------------------------------------------------------------------------- cfg/default.yaml


def test_the_shipped_default_yaml_is_the_generated_one() -> None:
    shipped = config_yaml.shipped_path().read_text(encoding="utf-8")
    assert shipped == config_yaml.default_yaml(), "cfg/default.yaml is stale: run python -m detrain.config"
    assert config_yaml.main(["--check"]) == 0


def test_default_yaml_reads_back_as_the_defaults_with_each_help_as_its_comment() -> None:
    text = config_yaml.default_yaml()
    loaded = yaml.safe_load(text)
    assert list(loaded) == list(defaults())
    for name, default in defaults().items():
        assert loaded[name] == default and type(loaded[name]) is type(default), name
    lines = {line.split(":", 1)[0]: line for line in text.splitlines() if line and not line.startswith("#")}
    for name, help_text in comments().items():
        assert lines[name].endswith(f"  # {help_text}"), name


def test_writing_default_yaml_replaces_the_file_whole(tmp_path, monkeypatch) -> None:
    target = tmp_path / "default.yaml"
    target.write_text("model: stale.yaml  # an old file\n")
    monkeypatch.setattr(config_yaml, "shipped_path", lambda: target)
    assert config_yaml.main(["--check"]) == 1
    assert config_yaml.main([]) == 0
    assert target.read_text() == config_yaml.default_yaml()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["default.yaml"]  # no temporary file left beside it
    assert config_yaml.main(["--check"]) == 0
    assert config_yaml.main(["--bogus"]) == 2


@pytest.mark.parametrize("value", ["1", "", " padded", "a # b", "yes", "null", "1e3", "x: y"])
def test_a_string_default_that_yaml_would_misread_is_quoted(value: str) -> None:
    assert yaml.safe_load(f"k: {config_yaml.scalar(value)}")["k"] == value


# ------------------------------------------------------------------------------------------------- --help


@pytest.mark.parametrize("command", sorted(COMMAND_KEYS))
def test_help_shows_each_key_of_the_command_with_its_default_and_help_from_the_source(command: str) -> None:
    out = _squeezed(CliRunner().invoke(cli.app, [command, "--help"]).output)
    for name in COMMAND_KEYS[command]:
        default = defaults()[name]
        assert _squeezed(f"{name}={'' if default is None else default} {SPECS[name].help}") in out, name


def test_help_follows_the_spec_it_is_given(monkeypatch) -> None:
    monkeypatch.setitem(SPECS, "epochs", dataclasses.replace(SPECS["epochs"], help="how many passes, from the spec"))
    assert "epochs=100  how many passes, from the spec" in cli._keys_help("train")


# ------------------------------------------------------------------------------------------------- bounds and choices


def _numbers(name: str) -> type:
    typ = TYPES[name]
    return int if typ is int or ("int" in str(typ) and "float" not in str(typ)) else float


def _outside(name: str) -> list[Any]:
    spec, step = SPECS[name], (1 if _numbers(name) is int else None)
    out = []
    if spec.low is not None:
        out.append(spec.low - (step or max(abs(spec.low) * 0.01, 1e-6)))
    if spec.high is not None:
        out.append(spec.high + (step or max(abs(spec.high) * 0.01, 1e-6)))
    return out


BOUNDED = [name for name, spec in SPECS.items() if spec.low is not None or spec.high is not None]


@pytest.mark.parametrize("name", BOUNDED)
def test_every_bound_in_the_metadata_is_enforced_and_its_ends_pass_it(name: str) -> None:
    spec = SPECS[name]
    for value in _outside(name):
        with pytest.raises(ConfigError, match=rf"invalid value for '{name}'.*expected a value (from|at least) "):
            parse_value(name, value)
    for end in (spec.low, spec.high):
        if end is None:
            continue
        try:
            parse_value(name, _numbers(name)(end))
            error = ""
        except ConfigError as e:  # an end may still fail a key's own check (copy_paste must be 0), never the bound
            error = str(e)
        assert "expected a value from" not in error and "at least" not in error, error


def test_the_bounds_come_from_the_metadata(monkeypatch) -> None:
    monkeypatch.setitem(SPECS, "epochs", dataclasses.replace(SPECS["epochs"], low=5, high=9))
    with pytest.raises(ConfigError, match="'epochs': 4; expected a value from 5 to 9"):
        make_cfg({"epochs": 4})
    assert make_cfg({"epochs": 9}).train.epochs == 9


@pytest.mark.parametrize("name", [name for name, spec in SPECS.items() if spec.choices])
def test_every_choice_passes_in_any_case_and_others_are_refused(name: str) -> None:
    for choice in SPECS[name].choices:
        given = choice.upper() if isinstance(choice, str) else choice
        assert parse_value(name, given) == choice
    with pytest.raises(ConfigError, match=rf"'{name}': 'nonesuch'; expected one of "):
        parse_value(name, "nonesuch")


# ------------------------------------------------------------------------------------------------- checked once


def test_make_cfg_reads_only_the_keys_it_is_given_and_replace_only_the_changed_ones(monkeypatch) -> None:
    read: list[str] = []
    real = config.parse_value

    def counting(name: str, value: Any) -> Any:
        read.append(name)
        return real(name, value)

    monkeypatch.setattr(config, "parse_value", counting)
    cfg = make_cfg({"epochs": "3", "imgsz": "320"})
    assert read == ["epochs", "imgsz"]
    read.clear()
    assert config.replace_cfg(cfg, {"batch": 8}).train.batch == 8 and read == ["batch"]
    with pytest.raises(ConfigError, match="'batch': 0"):
        config.replace_cfg(cfg, {"batch": 0})


def test_nnodes_is_parsed_once_and_its_range_kept(monkeypatch) -> None:
    calls: list[str] = []
    real = values.parse_nnodes
    monkeypatch.setattr(values, "parse_nnodes", lambda text: calls.append(text) or real(text))
    values.node_range.cache_clear()
    cfg = make_cfg({"nnodes": "2:5", "node_rank": 4, "rdzv_backend": "c10d"})
    assert cfg.distributed.node_range == (2, 5) and cfg.distributed.node_range == (2, 5)
    assert calls == ["2:5"]  # the value's check, the node_rank check and every reader after share one parse
    with pytest.raises(ConfigError, match="'node_rank': 5; expected a value from 0 to 4"):
        make_cfg({"nnodes": "2:5", "node_rank": 5})


def test_the_workers_take_the_checked_config_as_it_is(monkeypatch) -> None:
    from detrain.engine.evaluate import val_worker as evaluate
    from detrain.engine.train import trainer

    seen: list[Any] = []

    class Recorder:
        def __init__(self, cfg: Cfg, *args: Any) -> None:
            seen.append(cfg)

        def train(self) -> dict[str, Any]:
            return {}

    monkeypatch.setattr(trainer, "Trainer", Recorder)
    monkeypatch.setattr(evaluate, "run_val", lambda cfg, world, save_dir: seen.append(cfg) or {})
    cfg = make_cfg({"epochs": 2, "dist_timeout": 30})
    trainer.train_worker({"cfg": cfg, "plan": RunPlan()}, World())
    evaluate.val_worker({"cfg": cfg, "plan": RunPlan()}, World())
    assert seen[0] is cfg and seen[1] is cfg


# ------------------------------------------------------------------------------------------------- hostile input


@pytest.mark.parametrize(
    ("given", "message"),
    [
        # sections are how code reads keys; a user (or a yaml) that nests them is told keys are flat
        (
            {"train": {"epochs": 3}},
            "unknown argument 'train'; 'train' is a section of the config, not a key: give its "
            "keys flat (e.g. epochs=...)",
        ),
        ({"train.epochs": 3}, "unknown argument 'train.epochs'; keys are flat: write epochs=..."),
        # a yaml mapping's keys need not be strings
        (yaml.safe_load("1: 2"), "unknown argument '1'"),
        (yaml.safe_load("null: x"), "unknown argument 'None'"),
        # non-scalars where a scalar goes
        (yaml.safe_load("model: {a: 1}"), "invalid value for 'model': {'a': 1}; expected a string"),
        (yaml.safe_load("epochs: [1, 2]"), "invalid value for 'epochs': [1, 2]; expected an integer"),
        ({"data": b"coco8.yaml"}, "invalid value for 'data': b'coco8.yaml'; expected a string"),
        ({"lr0": {0.01}}, "invalid value for 'lr0': {0.01}; expected a number"),
        # numbers beyond any float or any sane count (exact, not rounded, in the message)
        ({"lr0": 10**400}, "expected a finite number"),
        ({"seed": 2**63 + 1}, "'seed': 9223372036854775809; expected a value of at most 2147483647"),
        (yaml.safe_load("epochs: 0x7fffffffffffffff"), "'epochs': 9223372036854775807; expected a value of at most"),
        (yaml.safe_load("imgsz: .inf"), "'imgsz': inf; expected an integer"),
        (yaml.safe_load("iou: .nan"), "'iou': nan; expected a finite number"),
    ],
)
def test_hostile_shapes_of_a_config_mapping_are_one_clear_error(given: dict[Any, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_cfg(given)


def test_a_dotted_key_on_the_command_line_is_told_keys_are_flat() -> None:
    with pytest.raises(ConfigError, match=re.escape("unknown argument 'augment.mosaic'; keys are flat: write mosaic=")):
        parse_cli_args(["augment.mosaic=0.5"], "train")


def test_a_path_object_is_read_as_its_text_and_checked_like_one(tmp_path) -> None:
    assert make_cfg({"project": tmp_path}).output.project == str(tmp_path)
    with pytest.raises(ConfigError, match="U\\+000A"):
        make_cfg({"project": tmp_path / "a\nb"})


def test_the_dist_timeout_is_the_key_not_an_environment_variable(monkeypatch) -> None:
    """DETRAIN_DIST_TIMEOUT_S duplicated dist_timeout= (and DETRAIN_CACHE_TIMEOUT prepare_timeout=): gone."""
    from detrain.distributed import dist

    monkeypatch.setenv("DETRAIN_DIST_TIMEOUT_S", "5")
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    dist.cleanup()
    try:
        assert dist.setup(World.from_env()).timeout_s == dist.DEFAULT_TIMEOUT_S
    finally:
        dist.cleanup()
