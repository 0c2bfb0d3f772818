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
import math
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

from detrain.assets import asset_dir
from detrain.errors import ConfigError, DistributedError
from detrain.distributed.launch_checks import parse_nnodes
from detrain.net import is_sha256

Device = Union[str, int, list]


@dataclass(frozen=True)
class Cfg:
    """Every argument of every command; see ``cfg/default.yaml`` for the comments."""

    model: str
    weights_sha256: str
    pretrained: Union[bool, str]
    data: str
    download_max_gb: float
    download_max_unpacked_gb: float
    download_max_files: int
    imgsz: int
    epochs: int
    time: Union[float, None]
    batch: int
    patience: int
    fraction: float
    single_cls: bool
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
    save_interval: float
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
    freeze: Union[int, list, None]
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
    cutmix: float
    copy_paste: float
    val: bool
    split: str
    conf: Union[float, None]
    iou: float
    max_det: int
    save_json: bool
    predictions: str
    source: str
    classes: Union[list, None]
    agnostic_nms: bool
    half: bool
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
    "format": ("onnx", "torchscript"),
}
WEEK_S = 7 * 24 * 3600  # the longest timeout: a typo beyond it would overflow the timers instead of waiting
YEAR_H = 365 * 24  # the longest time= budget in hours: beyond it a value is a typo (time is hours, not seconds)
# (low, high) inclusive bounds; None = unbounded on that side (integers stop at INT_LIMIT).
RANGES: dict[str, tuple[float | None, float | None]] = {
    "imgsz": (32, 8192), "epochs": (1, None), "batch": (1, None), "patience": (0, None),
    "fraction": (0.0, 1.0), "workers": (0, 64), "node_rank": (0, None), "master_port": (0, 65535),
    "max_restarts": (0, None), "dist_timeout": (1, WEEK_S), "prepare_timeout": (1, WEEK_S), "lr0": (0.0, None),
    "lrf": (0.0, 1.0), "momentum": (0.0, 1.0), "weight_decay": (0.0, None), "warmup_epochs": (0.0, None),
    "warmup_momentum": (0.0, 1.0), "warmup_bias_lr": (0.0, None), "nbs": (1, None), "clip_grad": (0.0, None),
    "close_mosaic": (0, None), "box": (0.0, None), "cls": (0.0, None), "dfl": (0.0, None),
    "hsv_h": (0.0, 1.0), "hsv_s": (0.0, 1.0), "hsv_v": (0.0, 1.0), "degrees": (0.0, 180.0),
    "translate": (0.0, 1.0), "scale": (0.0, 1.0), "shear": (0.0, 180.0), "perspective": (0.0, 0.001),
    "flipud": (0.0, 1.0), "fliplr": (0.0, 1.0), "mosaic": (0.0, 1.0), "mixup": (0.0, 1.0), "cutmix": (0.0, 1.0),
    "copy_paste": (0.0, 1.0), "conf": (0.0, 1.0),
    "iou": (0.0, 1.0), "max_det": (1, None), "line_width": (0, 32767), "opset": (11, 23), "save_period": (-1, None),
    "save_interval": (0.0, WEEK_S / 60),
    "seed": (0, None), "download_max_gb": (0.0, None), "download_max_unpacked_gb": (0.0, None),
    "download_max_files": (1, None), "time": (0.0, YEAR_H),
}
# Integers above this (or below its negative) are typos: they overflow numpy's seeds, timers and tensor sizes.
INT_LIMIT = 2**31 - 1
# Keys whose value may not be empty (an empty string would only fail later, far from the command line).
NON_EMPTY: dict[str, str] = {
    "model": "an architecture yaml (n.yaml ... x.yaml, a path) or weights (.pt)",
    "data": "a dataset yaml (a path, or a bundled name such as coco8.yaml)",
    "master_addr": "the host name or address of the node with node_rank 0",
}
# What names weights rather than an architecture yaml (as detrain.engine.build.is_weights reads model=).
WEIGHTS_SUFFIXES = (".pt", ".pth")
# Bytes in one folder name on common filesystems (NAME_MAX).
NAME_MAX = 255

# The keys each command reads; the others belong to another command, and naming one is an error.
_LAUNCH_KEYS = ("device", "workers", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_backend",
                "max_restarts", "dist_timeout", "prepare_timeout", "run_id", "socket_ifname")
_OUTPUT_KEYS = ("project", "name", "exist_ok")
_ONLY: dict[str, tuple[str, ...]] = {
    "val": ("split", "predictions"),
    "predict": ("source", "save_txt", "save_conf", "line_width", "half"),
    "export": ("format", "opset", "dynamic"),
}
COMMAND_KEYS: dict[str, tuple[str, ...]] = {
    "val": ("model", "weights_sha256", "data", "imgsz", "batch", *_LAUNCH_KEYS, "split", "conf", "iou", "max_det",
            "single_cls", "classes", "agnostic_nms", "save_json", "predictions", "plots", *_OUTPUT_KEYS, "verbose",
            "download_max_gb", "download_max_unpacked_gb", "download_max_files"),
    "predict": ("model", "weights_sha256", "source", "imgsz", "batch", "device", "half", "conf", "iou", "max_det",
                "classes", "agnostic_nms", "save", "save_txt", "save_conf", "line_width", *_OUTPUT_KEYS, "verbose"),
    "export": ("model", "weights_sha256", "format", "imgsz", "opset", "dynamic", *_OUTPUT_KEYS),
    "info": ("model", "weights_sha256", "imgsz", "verbose"),
}
COMMAND_KEYS["train"] = tuple(f.name for f in dataclasses.fields(Cfg)
                              if not any(f.name in keys for keys in _ONLY.values()))
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


def _shown(text: str) -> str:
    """``text`` as it can be printed on one line: escaped when it holds anything not printable."""
    return text if text.isprintable() else repr(text)[1:-1]


def _fail(key: str, value: Any, valid: str) -> ConfigError:
    return ConfigError(f"invalid value for '{key}': {value!r}; expected {valid}")


def _check_text(key: str, value: str) -> None:
    """No control characters (newline, NUL, escape), invisible formatting (bidi overrides, zero width) or
    undecodable bytes: they forge log lines, hide a folder's real name or break the path functions."""
    bad = next((c for c in value if unicodedata.category(c) in ("Cc", "Cf", "Cs")), None)
    if bad is not None:
        raise _fail(key, value, f"text without control or invisible characters (found U+{ord(bad):04X})")


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Turn a CLI string or Python value into ``typ`` (bool, int, float, str or a Union of them)."""
    if isinstance(value, str):
        _check_text(key, value)
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
        if isinstance(value, str):
            try:  # exact, however long: float() would round 9007199254740993 to ...992
                return int(value.strip())
            except ValueError:
                pass  # 1e3 and 16.0 are whole numbers too, as Ultralytics reads them
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise _fail(key, value, "an integer") from None
        if not math.isfinite(number) or not number.is_integer():
            raise _fail(key, value, "an integer")
        return int(number)
    if typ is float:
        if isinstance(value, bool):
            raise _fail(key, value, "a number")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise _fail(key, value, "a number") from None
        if not math.isfinite(number):  # nan, inf, 1e400
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


def _class_ids(key: str, value: Any) -> list[int] | None:
    """``classes``: null / '' (every class), an id, or ids as a list or a string (``0,2``, ``[0, 2]``) -> sorted
    unique ids."""
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE | {"", "[]"}):
        return None
    if isinstance(value, str):
        parts = [p.strip() for p in value.strip().strip("[]()").split(",")]
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        parts = [value]
    ids = []
    for part in parts:
        try:
            ids.append(_coerce(key, part, int))
        except ConfigError:
            raise _fail(key, value, "class ids, e.g. classes=0 or classes=0,2") from None
    if any(i < 0 for i in ids):
        raise _fail(key, value, "class ids of at least 0")
    return sorted(set(ids)) or None


def _freeze(value: Any) -> int | list[int] | None:
    """``freeze``: null / '' (nothing frozen), a count N (the first N layers: ``freeze=10``), or layer indices as a
    list or a string (``freeze=0,1,2``, ``freeze=[0, 1]``) -> N, or the sorted unique indices.

    >>> _freeze("10"), _freeze("0,2,1"), _freeze("[5]"), _freeze([3, 3]), _freeze("")
    (10, [0, 1, 2], [5], [3], None)
    """
    valid = "a number of first layers (freeze=10) or layer indices (freeze=0,1,2 or [0, 1]), each at least 0"
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE | {"", "[]"}):
        return None
    if isinstance(value, str):
        _check_text("freeze", value)
        text = value.strip()
        listed = "," in text or text.startswith(("[", "("))
        parts: list[Any] = [p.strip() for p in text.strip("[]()").split(",")] if listed else [text]
    elif isinstance(value, (list, tuple)):
        listed, parts = True, list(value)
    else:
        listed, parts = False, [value]
    ids = []
    for part in parts:
        try:
            ids.append(_coerce("freeze", part, int))
        except ConfigError:
            raise _fail("freeze", value, valid) from None
    if any(i < 0 for i in ids):
        raise _fail("freeze", value, valid)
    if any(i > INT_LIMIT for i in ids):
        raise _fail("freeze", value, f"layer numbers of at most {INT_LIMIT}")
    if not listed:
        return ids[0]
    return sorted(set(ids)) or None


def _check(key: str, value: Any) -> Any:
    """One value against its choices, range and form; returns it normalised (cache=true -> ram, sgd -> SGD)."""
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
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_LIMIT:
        raise _fail(key, value, f"a value of at most {INT_LIMIT}")
    if key in PATTERNS and value and not re.fullmatch(PATTERNS[key][0], value):
        raise _fail(key, value, PATTERNS[key][1])
    if key == "copy_paste" and value:  # Ultralytics' copy-paste cuts objects out along their polygons
        raise _fail(key, value, "0: copy-paste needs instance polygons (segment labels) and detrain's labels are "
                                "boxes; use cutmix= or mixup= instead")
    if key == "imgsz" and value % 32:
        raise _fail(key, value, "a multiple of 32 (the largest stride)")
    if key == "weights_sha256":
        value = value.strip().lower()
        if value and not is_sha256(value):
            raise _fail(key, value, "'' or a sha256: the 64 hex digits sha256sum prints")
    if key == "pretrained" and isinstance(value, str) and not value.strip().endswith(WEIGHTS_SUFFIXES):
        raise _fail(key, value, "true, false or a weights file (.pt) whose matching layers start the model")
    if key in NON_EMPTY and not value.strip():
        raise _fail(key, value, NON_EMPTY[key])
    if key == "nnodes":
        try:
            parse_nnodes(value)
        except DistributedError:
            raise _fail(key, value, "a node count like 2 or a range MIN:MAX like 1:4") from None
    if key in ("project", "name") and value:
        _check_folder(key, value)
    return value


def _check_folder(key: str, value: str) -> None:
    """``name`` is one folder inside ``project`` (no separators, no '.' or '..': the run stays where resume=true
    and the increment look for it); every folder of either fits a filesystem's name limit."""
    parts = value.replace("\\", "/").split("/")
    if key == "name" and (len(parts) > 1 or value.strip() in (".", "..")):
        raise _fail(key, value, "one folder name without '/', '\\', '.' or '..'; put parent folders in project=")
    if any(len(part.encode()) > NAME_MAX for part in parts):
        raise _fail(key, value, f"folder names of at most {NAME_MAX} bytes")


def _check_together(values: Mapping[str, Any]) -> None:
    """Values that are only wrong together."""
    pretrained, model = values["pretrained"], str(values["model"])
    if isinstance(pretrained, str) and model.strip().endswith(WEIGHTS_SUFFIXES):
        raise _fail("pretrained", pretrained, f"true or false with model={model} (weights of its own); to start an "
                    f"architecture from {pretrained}, give its yaml: model=n.yaml pretrained={pretrained}")
    if values["save_interval"] > 0 and not values["save"]:
        raise _fail("save_interval", values["save_interval"], "0 with save=false (mid.pt is a checkpoint)")
    nodes = parse_nnodes(values["nnodes"])[1]
    if values["node_rank"] >= nodes:
        raise _fail("node_rank", values["node_rank"], f"a value from 0 to {nodes - 1} (nnodes={values['nnodes']})")


def check_keys(keys: Iterable[str], command: str | None = None) -> None:
    """Raise a ConfigError for the first unknown key (suggesting the closest valid one) or, with ``command``,
    for the first key that belongs to another command."""
    valid = [f.name for f in dataclasses.fields(Cfg)]
    hint_command = command or "train"
    for key in keys:
        if key not in valid:
            lower = {k.lower(): k for k in valid}
            close = difflib.get_close_matches(key.lower(), list(lower), n=1, cutoff=0.6)
            hint = f"; did you mean '{lower[close[0]]}'?" if close else \
                f"; run 'detrain {hint_command} --help' for the list"
            raise ConfigError(f"unknown argument '{_shown(key)}'{hint}")
        if command is not None and key not in COMMAND_KEYS[command]:
            owners = [c for c, keys_of in COMMAND_KEYS.items() if key in keys_of]
            raise ConfigError(f"argument '{key}' is not used by 'detrain {command}' (it is for "
                              f"{' and '.join(owners)}); run 'detrain {command} --help' for its keys")


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
        if field.name == "classes":
            value = _class_ids(field.name, merged[field.name])
        elif field.name == "freeze":
            value = _freeze(merged[field.name])
        else:
            value = _coerce(field.name, merged[field.name], hints[field.name])
        values[field.name] = _check(field.name, value)
    _check_together(values)
    return Cfg(**values)


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
            raise ConfigError(f"argument '{_shown(key)}' is given twice ({_shown(key)}={_shown(out[key])}, then "
                              f"{_shown(key)}={_shown(value)}); give it once")
        out[key] = value
        i += 1
    check_keys(out, command)
    return out
