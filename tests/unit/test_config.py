"""cfg/default.yaml and the validated Cfg."""

from __future__ import annotations

import dataclasses

import pytest

from detrain.config.cfg import Cfg, comments, defaults, make_cfg, parse_cli_args, replace_cfg
from detrain.errors import ConfigError


def test_every_field_has_a_default_and_a_comment():
    fields = {f.name for section in dataclasses.fields(Cfg) for f in dataclasses.fields(getattr(Cfg(), section.name))}
    assert fields == set(defaults())
    assert all(comments()[k] for k in fields), [k for k in fields if not comments().get(k)]


def test_defaults_validate_and_freeze():
    cfg = make_cfg()
    assert cfg.inputs.model == "n.yaml" and cfg.inputs.data == "shapes.yaml" and cfg.train.batch == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.epochs = 3  # type: ignore[misc]


def test_cli_strings_are_coerced():
    cfg = make_cfg(
        parse_cli_args(
            [
                "epochs=3",
                "--imgsz",
                "320",
                "device=0,1",
                "amp=false",
                "conf=null",
                "--cos-lr",
                "resume=runs/x/weights/last.pt",
                "cache=true",
            ]
        )
    )
    assert (
        cfg.train.epochs,
        cfg.inputs.imgsz,
        cfg.distributed.device,
        cfg.train.amp,
        cfg.predict.conf,
        cfg.train.cos_lr,
    ) == (3, 320, "0,1", False, None, True)
    assert cfg.train.resume == "runs/x/weights/last.pt" and cfg.inputs.cache == "ram"
    assert make_cfg({"device": [0, 1]}).distributed.device == [0, 1]
    assert make_cfg({"device": "0"}).distributed.device == 0
    assert make_cfg({"resume": "true"}).train.resume is True
    assert make_cfg({"optimizer": "sgd"}).train.optimizer == "SGD"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"epoch": 3}, "unknown argument 'epoch'; did you mean 'epochs'?"),
        ({"imgsz": "abc"}, "invalid value for 'imgsz': 'abc'; expected an integer"),
        ({"imgsz": 0}, "'imgsz': 0; expected a value from 1 to 8192"),
        ({"optimizer": "sgdd"}, "expected one of auto, SGD, AdamW, Adam, Adamax, NAdam, RAdam, RMSProp, MuSGD"),
        ({"lrf": 2}, "from 0.0 to 1.0"),
        ({"amp": "maybe"}, "expected true, false, bf16, fp16 or fp32"),
        ({"cache": "gpu"}, "expected one of false, ram, disk"),
        ({"epochs": 0}, "at least 1"),
        ({"conf": "nan"}, "invalid value for 'conf'"),
    ],
)
def test_bad_values_name_the_key_and_what_is_valid(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("?", r"\?").replace("(", r"\(")):
        make_cfg(overrides)


def test_parse_cli_args_rejects_positional_words():
    with pytest.raises(ConfigError, match="not key=value"):
        parse_cli_args(["epochs"])
    assert parse_cli_args(["--amp"]) == {"amp": "true"}


def test_replace_validates():
    cfg = make_cfg()
    assert replace_cfg(cfg, {"epochs": 5}).train.epochs == 5
    with pytest.raises(ConfigError):
        replace_cfg(cfg, {"batch": 0})
