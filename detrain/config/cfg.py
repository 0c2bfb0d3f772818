"""One typed, validated, frozen set of arguments, from flat keys: ``make_cfg({"epochs": "3"})``.

The keys, their sections, defaults, valid values and help live in ``detrain.config.keys`` (the one source);
reading and checking one value is ``detrain.config.values``. ``make_cfg`` checks each given value once, where it
is read, then the values that are only wrong together; the defaults are valid by construction (a unit test
holds them to it). ``python -m detrain.config`` writes ``cfg/default.yaml`` from the source.

>>> cfg = make_cfg({"epochs": "3", "imgsz": 320})
>>> cfg.train.epochs, cfg.inputs.imgsz, cfg.train.batch
(3, 320, 16)
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from typing import Any

from detrain.config.keys import (
    COMMAND_KEYS,
    LAUNCH_KEYS,
    SECTION_OF,
    SECTIONS,
    SPECS,
    TYPES,
    Augment,
    Cfg,
    Distributed,
    Export,
    Inputs,
    Loss,
    Output,
    Predict,
    Train,
    comments,
    defaults,
)
from detrain.config.values import INT_LIMIT, WEIGHTS_SUFFIXES, coerce, fail, node_range
from detrain.errors import ConfigError

__all__ = [
    "CHOICES",
    "COMMAND_KEYS",
    "INT_LIMIT",
    "LAUNCH_KEYS",
    "Augment",
    "Cfg",
    "Distributed",
    "Export",
    "Inputs",
    "Loss",
    "Output",
    "Predict",
    "Train",
    "check_keys",
    "comments",
    "defaults",
    "make_cfg",
    "parse_cli_args",
    "parse_value",
    "replace_cfg",
]

CHOICES: dict[str, tuple[Any, ...]] = {name: spec.choices for name, spec in SPECS.items() if spec.choices}


def _shown(text: str) -> str:
    """``text`` as it can be printed on one line: escaped when it holds anything not printable."""
    return text if text.isprintable() else repr(text)[1:-1]


def parse_value(name: str, value: Any) -> Any:
    """One key's value, read into its type and checked against its Spec (choices, bounds, form, its own check);
    returns it normalised (``cache=true`` -> ram, ``sgd`` -> SGD). Raises ConfigError naming the key."""
    spec = SPECS[name]
    value = spec.parse(name, value) if spec.parse else coerce(name, value, TYPES[name])
    if spec.choices:
        match = next(
            (
                o
                for o in spec.choices
                if o == value or (isinstance(o, str) and isinstance(value, str) and o.lower() == value.lower())
            ),
            None,
        )
        if match is None:
            raise fail(
                name, value, "one of " + ", ".join(str(o).lower() if isinstance(o, bool) else o for o in spec.choices)
            )
        value = match
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    low, high = spec.low, spec.high
    if number and ((low is not None and value < low) or (high is not None and value > high)):
        raise fail(name, value, f"a value from {low} to {high}" if high is not None else f"a value at least {low}")
    if number and isinstance(value, int) and abs(value) > INT_LIMIT:
        raise fail(name, value, f"a value of at most {INT_LIMIT}")
    if spec.pattern and value and not re.fullmatch(spec.pattern[0], value):
        raise fail(name, value, spec.pattern[1])
    if spec.check:
        value = spec.check(name, value)
    if spec.non_empty and not value.strip():
        raise fail(name, value, spec.non_empty)
    return value


def _check_together(values: Mapping[str, Any]) -> None:
    """Values that are only wrong together."""
    pretrained, model = values["pretrained"], str(values["model"])
    if isinstance(pretrained, str) and model.strip().endswith(WEIGHTS_SUFFIXES):
        raise fail(
            "pretrained",
            pretrained,
            f"true or false with model={model} (weights of its own); to start an "
            f"architecture from {pretrained}, give its yaml: model=n.yaml pretrained={pretrained}",
        )
    if values["save_interval"] > 0 and not values["save"]:
        raise fail("save_interval", values["save_interval"], "0 with save=false (mid.pt is a checkpoint)")
    nodes = node_range(values["nnodes"])[1]
    if values["node_rank"] >= nodes:
        raise fail("node_rank", values["node_rank"], f"a value from 0 to {nodes - 1} (nnodes={values['nnodes']})")


def _unknown(key: str, hint_command: str) -> ConfigError:
    """The error for a name that is no key, with the closest key or the way to the list."""
    head, _, tail = key.partition(".")
    if head in SECTIONS and tail in SECTION_OF:  # train.epochs=3: sections are how code reads keys, not users
        hint = f"; keys are flat: write {tail}=..."
    elif key in SECTIONS:
        hint = (
            f"; '{key}' is a section of the config, not a key: give its keys flat (e.g. "
            f"{next(k for k, s in SECTION_OF.items() if s == key)}=...)"
        )
    else:
        lower = {k.lower(): k for k in SECTION_OF}
        close = difflib.get_close_matches(key.lower(), list(lower), n=1, cutoff=0.6)
        hint = (
            f"; did you mean '{lower[close[0]]}'?" if close else f"; run 'detrain {hint_command} --help' for the list"
        )
    return ConfigError(f"unknown argument '{_shown(key)}'{hint}")


def check_keys(keys: Iterable[Any], command: str | None = None) -> None:
    """Raise a ConfigError for the first unknown key (suggesting the closest valid one) or, with ``command``,
    for the first key that belongs to another command."""
    for key in keys:
        if not isinstance(key, str) or key not in SECTION_OF:  # a yaml's 1: or null: is no key either
            raise _unknown(str(key), command or "train")
        if command is not None and key not in COMMAND_KEYS[command]:
            owners = [c for c, keys_of in COMMAND_KEYS.items() if key in keys_of]
            raise ConfigError(
                f"argument '{key}' is not used by 'detrain {command}' (it is for "
                f"{' and '.join(owners)}); run 'detrain {command} --help' for its keys"
            )


def _build(values: Mapping[str, Any]) -> Cfg:
    """The Cfg of flat, checked values."""
    sections = {
        name: cls(**{key: values[key] for key, section in SECTION_OF.items() if section == name})
        for name, cls in SECTIONS.items()
    }
    return Cfg(**sections)


def replace_cfg(cfg: Cfg, changes: Mapping[str, Any]) -> Cfg:
    """``cfg`` with the flat keys of ``changes`` read and checked (each once), then checked together."""
    changes = dict(changes)
    check_keys(changes)
    values = cfg.to_dict()
    values.update({key: parse_value(key, value) for key, value in changes.items()})
    _check_together(values)
    return _build(values)


def make_cfg(overrides: Mapping[str, Any] | None = None) -> Cfg:
    """The defaults with ``overrides`` (flat keys: ``{"epochs": "3"}``), each read and checked. Raises ConfigError
    on an unknown key or a bad value."""
    return replace_cfg(Cfg(), overrides or {})


def parse_cli_args(args: list[str], command: str | None = None) -> dict[str, str]:
    """``['epochs=3', '--imgsz', '320', '--amp']`` -> ``{'epochs': '3', 'imgsz': '320', 'amp': 'true'}``.

    A key given twice is an error naming it (Ultralytics keeps the last one silently; a forgotten earlier value
    is more often a mistake than an intended override). With ``command``, keys of other commands are errors too.
    """
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            body = arg[2:].replace("-", "_")
            if "=" in body:
                key, value = body.split("=", 1)
            elif i + 1 < len(args) and "=" not in args[i + 1] and not args[i + 1].startswith("--"):
                key, value = body, args[i + 1]
                i += 1
            else:
                key, value = body, "true"
        elif "=" in arg:
            key, value = arg.split("=", 1)
        else:
            raise ConfigError(f"argument '{_shown(arg)}' is not key=value; write e.g. epochs=3 or --epochs 3")
        key = key.strip()
        if not key:
            raise ConfigError(f"argument '{_shown(arg)}' has no key; write e.g. epochs=3")
        if key in out:
            raise ConfigError(
                f"argument '{_shown(key)}' is given twice ({_shown(key)}={_shown(out[key])}, then "
                f"{_shown(key)}={_shown(value)}); give it once"
            )
        out[key] = value
        i += 1
    check_keys(out, command)
    return out
