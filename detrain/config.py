"""One typed, validated, frozen set of arguments.

Defaults and one-line comments live in ``cfg/default.yaml`` (shipped as ``detrain.cfg``); the field types and
the valid ranges live here. ``make_cfg`` merges overrides over the defaults and validates every value.

>>> cfg = make_cfg({"epochs": "3", "imgsz": 320})
>>> cfg.epochs, cfg.imgsz, cfg.batch
(3, 320, 16)
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

from detrain.assets import asset_dir
from detrain.errors import ConfigError

Device = Union[str, int, list]


@dataclass(frozen=True)
class Cfg:
    """Every argument of every command; see ``cfg/default.yaml`` for the comments."""

    model: str
    data: str
    imgsz: int
    epochs: int
    batch: int
    patience: int
    fraction: float
    device: Device
    workers: int
    nnodes: str
    node_rank: int
    master_addr: str
    master_port: int
    rdzv_backend: str
    run_id: str
    socket_ifname: str
    max_restarts: int
    dist_timeout: float
    prepare_timeout: float
    sync_bn: bool
    project: str
    name: str
    exist_ok: bool
    save: bool
    save_period: int
    plots: bool
    tensorboard: bool
    verbose: bool
    optimizer: str
    lr0: float
    lrf: float
    momentum: float
    weight_decay: float
    warmup_epochs: float
    warmup_momentum: float
    warmup_bias_lr: float
    cos_lr: bool
    nbs: Union[int, str]
    clip_grad: float
    amp: bool
    seed: int
    deterministic: bool
    resume: Union[bool, str]
    close_mosaic: int
    multi_scale: bool
    rect: bool
    cache: Union[bool, str]
    box: float
    cls: float
    dfl: float
    hsv_h: float
    hsv_s: float
    hsv_v: float
    degrees: float
    translate: float
    scale: float
    shear: float
    perspective: float
    flipud: float
    fliplr: float
    mosaic: float
    mixup: float
    val: bool
    split: str
    conf: Union[float, None]
    iou: float
    max_det: int
    save_json: bool
    predictions: str
    source: str
    save_txt: bool
    save_conf: bool
    line_width: int
    format: str
    opset: int
    dynamic: bool

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (for args.yaml, checkpoints and worker processes)."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> Cfg:
        """A validated copy with some values changed: ``cfg.replace(epochs=5)``."""
        return make_cfg({**self.to_dict(), **changes})


CHOICES: dict[str, tuple[Any, ...]] = {
    "optimizer": ("auto", "SGD", "AdamW", "Adam"),
    "rdzv_backend": ("static", "c10d"),
    "split": ("val", "test", "train"),
    "cache": (False, "ram", "disk"),
    "format": ("onnx",),
}
# (low, high) inclusive bounds; None = unbounded on that side.
RANGES: dict[str, tuple[float | None, float | None]] = {
    "imgsz": (32, 8192), "epochs": (1, None), "batch": (1, None), "patience": (0, None),
    "fraction": (0.0, 1.0), "workers": (0, 64), "node_rank": (0, None), "master_port": (0, 65535),
    "max_restarts": (0, None), "dist_timeout": (1, None), "prepare_timeout": (1, None), "lr0": (0.0, None),
    "lrf": (0.0, 1.0), "momentum": (0.0, 1.0), "weight_decay": (0.0, None), "warmup_epochs": (0.0, None),
    "warmup_momentum": (0.0, 1.0), "warmup_bias_lr": (0.0, None), "nbs": (1, None), "clip_grad": (0.0, None),
    "close_mosaic": (0, None), "box": (0.0, None), "cls": (0.0, None), "dfl": (0.0, None),
    "hsv_h": (0.0, 1.0), "hsv_s": (0.0, 1.0), "hsv_v": (0.0, 1.0), "degrees": (0.0, 180.0),
    "translate": (0.0, 1.0), "scale": (0.0, 1.0), "shear": (0.0, 180.0), "perspective": (0.0, 0.001),
    "flipud": (0.0, 1.0), "fliplr": (0.0, 1.0), "mosaic": (0.0, 1.0), "mixup": (0.0, 1.0), "conf": (0.0, 1.0),
    "iou": (0.0, 1.0), "max_det": (1, None), "line_width": (0, None), "opset": (11, 23), "save_period": (-1, None),
}
# run_id: a name safe in store keys and messages; socket_ifname: interface names (Linux allows at most 15 chars)
PATTERNS: dict[str, tuple[str, str]] = {
    "run_id": (r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", "'' or up to 64 letters, digits, '.', '_' or '-'"),
    "socket_ifname": (r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,14}(,[A-Za-z0-9][A-Za-z0-9._@:-]{0,14})*",
                      "'' or interface names like eth0 (comma-separated)"),
}
_TRUE = {"true", "yes", "1", "on"}
_FALSE = {"false", "no", "0", "off", ""}
_NONE = {"null", "none", "~"}


def _default_yaml_text() -> str:
    return (asset_dir("cfg") / "default.yaml").read_text()


@functools.lru_cache(maxsize=1)
def defaults() -> dict[str, Any]:
    """The defaults from ``cfg/default.yaml``."""
    return yaml.safe_load(_default_yaml_text())


@functools.lru_cache(maxsize=1)
def comments() -> dict[str, str]:
    """key -> its one-line comment in ``cfg/default.yaml`` (for ``--help``)."""
    out: dict[str, str] = {}
    for line in _default_yaml_text().splitlines():
        if line and not line.startswith((" ", "#")) and ":" in line:
            key = line.split(":", 1)[0].strip()
            out[key] = line.split("#", 1)[1].strip() if "#" in line else ""
    return out


def _fail(key: str, value: Any, valid: str) -> ConfigError:
    return ConfigError(f"invalid value for '{key}': {value!r}; expected {valid}")


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Turn a CLI string or Python value into ``typ`` (bool, int, float, str or a Union of them)."""
    if get_origin(typ) is Union:
        options = get_args(typ)
        if isinstance(value, str) and value.strip().lower() in _NONE and type(None) in options:
            return None
        if value is None and type(None) in options:
            return None
        errors = []
        # try the narrow types first so that 'true' is a bool, not the string 'true'
        for option in sorted(options, key=lambda t: {bool: 0, int: 1, float: 2, list: 3, str: 4}.get(t, 5)):
            if option is type(None):
                continue
            try:
                return _coerce(key, value, option)
            except ConfigError as e:
                errors.append(e)
        names = " or ".join(getattr(o, "__name__", str(o)) for o in options).replace("NoneType", "null")
        raise _fail(key, value, names)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise _fail(key, value, "true or false")
    if typ is int:
        if isinstance(value, bool):
            raise _fail(key, value, "an integer")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise _fail(key, value, "an integer") from None
        if not number.is_integer():
            raise _fail(key, value, "an integer")
        return int(number)
    if typ is float:
        if isinstance(value, bool):
            raise _fail(key, value, "a number")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise _fail(key, value, "a number") from None
        if number != number:  # NaN
            raise _fail(key, value, "a finite number")
        return number
    if typ is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        raise _fail(key, value, "a list")
    if typ is str:
        if isinstance(value, (list, tuple, dict)):
            raise _fail(key, value, "a string")
        return "" if value is None else str(value)
    raise _fail(key, value, str(typ))


def _check(key: str, value: Any) -> Any:
    if key == "cache" and value is True:  # cache=true means the RAM cache, as users know it
        value = "ram"
    if key == "nbs" and isinstance(value, str):
        if value.strip().lower() != "auto":
            raise _fail(key, value, "auto or an integer of at least 1")
        return "auto"
    if key in CHOICES:
        options = CHOICES[key]
        match = next((o for o in options if o == value or (isinstance(o, str) and isinstance(value, str)
                                                         and o.lower() == value.lower())), None)
        if match is None:
            raise _fail(key, value, "one of " + ", ".join(str(o).lower() if isinstance(o, bool) else o
                                                            for o in options))
        value = match
    if key in RANGES and value is not None:
        low, high = RANGES[key]
        if (low is not None and value < low) or (high is not None and value > high):
            span = f"from {low} to {high}" if high is not None else f"at least {low}"
            raise _fail(key, value, f"a value {span}")
    if key in PATTERNS and value and not re.fullmatch(PATTERNS[key][0], value):
        raise _fail(key, value, PATTERNS[key][1])
    if key == "imgsz" and value % 32:
        raise _fail(key, value, "a multiple of 32 (the largest stride)")
    return value


def check_keys(keys: Iterable[str]) -> None:
    """Raise a ConfigError for the first unknown key, suggesting the closest valid one."""
    valid = [f.name for f in dataclasses.fields(Cfg)]
    for key in keys:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else "; run 'detrain train --help' for the list"
            raise ConfigError(f"unknown argument '{key}'{hint}")


def make_cfg(overrides: Mapping[str, Any] | None = None) -> Cfg:
    """Defaults from cfg/default.yaml, overridden and validated. Raises ConfigError on a bad key or value."""
    overrides = dict(overrides or {})
    check_keys(overrides)
    merged = {**defaults(), **overrides}
    hints = get_type_hints(Cfg)
    values = {}
    for field in dataclasses.fields(Cfg):
        if field.name not in merged:
            raise ConfigError(f"cfg/default.yaml has no default for '{field.name}'")
        value = _coerce(field.name, merged[field.name], hints[field.name])
        values[field.name] = _check(field.name, value)
    return Cfg(**values)


def parse_cli_args(args: list[str]) -> dict[str, str]:
    """``['epochs=3', '--imgsz', '320', '--amp']`` -> ``{'epochs': '3', 'imgsz': '320', 'amp': 'true'}``."""
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
            raise ConfigError(f"argument '{arg}' is not key=value; write e.g. epochs=3 or --epochs 3")
        key = key.strip()
        if not key:
            raise ConfigError(f"argument '{arg}' has no key; write e.g. epochs=3")
        out[key] = value
        i += 1
    check_keys(out)
    return out
