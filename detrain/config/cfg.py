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
import ipaddress
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from detrain.config.cfg_file import cfg_path, read_cfg_file
from detrain.config.keys import (
    COMMAND_KEYS,
    LAUNCH_KEYS,
    SECTION_OF,
    SECTIONS,
    SPECS,
    TYPES,
    ULTRALYTICS_ONLY,
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
from detrain.config.values import (
    EXPORTED_SUFFIXES,
    INT_LIMIT,
    WEIGHTS_SUFFIXES,
    ImageSize,
    coerce,
    fail,
    is_auto_batch,
    node_range,
    note,
)
from detrain.errors import ConfigError
from detrain.system.text import excerpt, listed, path_excerpt

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
    "command_values",
    "comments",
    "defaults",
    "make_cfg",
    "parse_cli_args",
    "parse_value",
    "replace_cfg",
]

CHOICES: dict[str, tuple[Any, ...]] = {name: spec.choices for name, spec in SPECS.items() if spec.choices}
SPECS_DEFAULTS: dict[str, Any] = defaults()
# What Ultralytics users type beside the keys: a yaml of keys (cfg=), the task and the mode. make_cfg reads and
# drops them; no Cfg holds them.
WORDS = ("cfg", "task", "mode")
# The one task detrain has (Ultralytics' name for it).
TASK = "detect"


def _shown(text: str) -> str:
    """``text`` as it can be printed on one line: escaped when it holds anything not printable, cut when long (a
    cfg= file's key may be any length)."""
    if len(text) > 100:
        return excerpt(text, 100, quote=False)
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


def check_keys(keys: Iterable[Any], command: str | None = None, words: bool = False) -> None:
    """Raise a ConfigError for the first unknown key (suggesting the closest valid one) or, with ``command``,
    for the first key that belongs to another command. With ``words``, Ultralytics' cfg, task and mode pass too
    (:func:`make_cfg` reads them)."""
    for key in keys:
        if words and key in WORDS:
            continue
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


def make_cfg(overrides: Mapping[str, Any] | None = None, command: str | None = None) -> Cfg:
    """The defaults with ``overrides`` (flat keys: ``{"epochs": "3"}``), each read and checked. Raises ConfigError
    on an unknown key or a bad value.

    ``overrides`` may also hold Ultralytics' words (:data:`WORDS`): ``cfg`` (a yaml of keys beneath the others:
    :func:`command_values`), ``task`` (``detect``) and ``mode`` (``command`` itself). With ``command`` (train,
    val, predict, export, info), a cfg file's keys of other commands are left out, and val and predict refuse an
    AutoBatch ``batch`` (it sizes training batches)."""
    file_name, from_file, given = _split(overrides or {}, command)
    check_keys(given)
    values = Cfg().to_dict()
    values.update(_parsed(from_file, f"cfg={file_name}: "))
    values.update(_parsed(given))
    _check_together(values)
    if command in ("val", "predict") and is_auto_batch(values["batch"]):
        raise fail("batch", values["batch"], f"a number of images for 'detrain {command}' (AutoBatch sizes training)")
    if command == "train" and isinstance(values["imgsz"], ImageSize):  # Ultralytics trains at the long side too
        note(f"note: imgsz={values['imgsz']}: training takes one size, the long side: imgsz={int(values['imgsz'])}")
        values["imgsz"] = int(values["imgsz"])
    return _build(values)


def command_values(overrides: Mapping[str, Any], command: str | None = None) -> dict[str, Any]:
    """``overrides`` with a cfg= file's keys beneath them and Ultralytics' words checked and dropped: the flat keys
    a command runs with, as given (``make_cfg`` reads them). For callers that hand the keys on (``detrain
    export`` passes them to ``Model.export``)."""
    _, from_file, given = _split(overrides, command)
    return {**from_file, **given}


def _split(overrides: Mapping[str, Any], command: str | None) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(the cfg file's name, the keys it gives, the keys given beside it), Ultralytics' words checked and
    dropped."""
    given = dict(overrides)
    file_name, from_file = _cfg_file(given.pop("cfg", None), command, given)
    _check_task(given.pop("task", None))
    _check_mode(given.pop("mode", None), command)
    return file_name, from_file, given


def _parsed(values: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """Each value read and checked (:func:`parse_value`); an error line starts with ``where`` (the cfg file)."""
    out = {}
    for key, value in values.items():
        try:
            out[key] = parse_value(key, value)
        except ConfigError as e:
            raise ConfigError(f"{where}{e}") from None
    return out


def _check_task(task: Any, where: str = "") -> None:
    """``task``: detect, or nothing; any other task is one line (detrain trains detectors only)."""
    if task is None or (isinstance(task, str) and task.strip().lower() in ("", TASK)):
        return
    raise ConfigError(
        f"{where}task={_shown(str(task))} is not supported: detrain trains and runs detection models only "
        f"(task={TASK}, or leave task out)"
    )


def _check_mode(mode: Any, command: str | None) -> None:
    """``mode``: the command itself (``detrain train mode=train``), or nothing; another mode is one line."""
    if mode is None or command is None or (isinstance(mode, str) and mode.strip().lower() in ("", command)):
        return
    raise ConfigError(
        f"mode={_shown(str(mode))} does not match the command 'detrain {command}': run 'detrain "
        f"{_shown(str(mode))} ...', or leave mode out"
    )


def _cfg_file(path: Any, command: str | None, given: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the file's name as messages show it, the keys a ``cfg=`` file gives this command, less those ``given``
    overrides). Its ``mode`` is the run's that wrote it and is dropped (the command decides); its ``task`` must be
    detect; a ``resume`` it recorded is left out (a file starts a new run; resume= on the command line continues
    one); keys of other commands are left out (an args.yaml holds every key), with a line naming those that are
    not at their defaults. An unknown key is an error naming the file."""
    if path is None:
        return "", {}
    name, document = read_cfg_file(path)
    where = f"cfg={name}: "
    theirs = [str(key) for key in document if key in ULTRALYTICS_ONLY and key not in SECTION_OF]
    unknown = [str(key) for key in document if key not in SECTION_OF and key not in WORDS and key not in theirs]
    if len(unknown) == 1:
        raise ConfigError(where + str(_unknown(unknown[0], command or "train")))
    if unknown:  # an Ultralytics args.yaml has dozens: name them all at once
        raise ConfigError(
            f"{where}{len(unknown)} unknown arguments: {listed([_shown(k) for k in unknown], 80)}; run 'detrain "
            f"{command or 'train'} --help' for the keys"
        )
    if theirs:  # Ultralytics' own default.yaml (yolo copy-cfg): its keys of other tasks and features, left out
        note(f"note: {where}{len(theirs)} Ultralytics keys detrain does not have are left out: {listed(theirs, 80)}")
    # `key:` with no value gives nothing, as in Ultralytics' default.yaml (model:, data:)
    document = {k: v for k, v in document.items() if v is not None and k not in theirs}
    nested = document.pop("cfg", None)
    if nested not in (None, ""):
        raise ConfigError(f"{where}a cfg file cannot name another (cfg: {excerpt(nested, 40)}); merge them into one")
    _check_task(document.pop("task", None), where)
    _refuse_guards({k: v for k, v in document.items() if k not in given}, where, given, cfg_path(path))
    document.pop("mode", None)
    resume = document.pop("resume", None)
    if resume not in (None, False, "", "false", "False") and "resume" not in given:
        note(
            f"note: {where}resume: {excerpt(resume, 40)} is left out (a cfg file starts a new run; resume= on the "
            "command line continues one)"
        )
    return name, _for_command(document, command, given, where)


def _refuse_guards(document: Mapping[str, Any], where: str, given: Mapping[str, Any], cfg_file: str) -> None:
    """A cfg file must not lift a guard: a key marked ``guard`` at any value but its default (``download_anywhere:
    true``, ``trust_export: true``), a ``model:`` that is an exported file (a program, served only when named on
    the command line or in the API), a ``master_addr:`` other than loopback on one machine
    (:func:`_refuse_public_master`) or a ``project:`` outside the working folder (:func:`_refuse_far_project`) is
    one line naming the key. Called with the keys not given beside the file (a key given there is the one taken);
    ``given`` (what the command line or the API gives) decides the node count and run name the file is read with,
    ``cfg_file`` is the file's path."""
    for key, value in document.items():
        spec = SPECS.get(str(key))
        if spec is None or not spec.guard:
            continue
        try:
            lifted = parse_value(str(key), value) != SPECS_DEFAULTS[key]
        except ConfigError:
            continue  # a bad value: read with the others, its line names the file
        if lifted:
            shown_value = str(value).lower() if isinstance(value, bool) else excerpt(value, 20, quote=False)
            raise ConfigError(
                f"{where}{key}: {shown_value} lifts a safety guard and is taken from the command line or the API "
                f"only (detrain ... {key}={shown_value})"
            )
    model = document.get("model")
    if isinstance(model, str) and model.strip().endswith(EXPORTED_SUFFIXES):
        raise ConfigError(
            f"{where}model: {excerpt(model, 60)} is an exported file, which runs as a program: name it on the command "
            "line or in the API (model=...), not in a cfg file"
        )
    _refuse_public_master(document, where, given)
    _refuse_far_project(document, where, given, cfg_file)


def _file_value(key: str, document: Mapping[str, Any], given: Mapping[str, Any]) -> Any:
    """``key``'s value as the run will read it (given beside the file, else the file's, else the default), parsed;
    None when it is bad (its own line comes when the values are read)."""
    try:
        return parse_value(key, given[key] if key in given else document.get(key, SPECS_DEFAULTS[key]))
    except ConfigError:
        return None


def _is_loopback_name(host: str) -> bool:
    """Whether ``host`` names this machine's loopback as written, without asking a resolver: ``localhost`` (or a
    name under ``.localhost``), 127.0.0.0/8 or ::1. A host name that resolves to loopback does not count: what it
    resolves to is the machine's, not the file's word.

    >>> [_is_loopback_name(h) for h in ("127.0.0.1", "127.0.1.1", "::1", "localhost", "0.0.0.0", "10.0.0.1", "gpu7")]
    [True, True, True, True, False, False, False]
    """
    name = host.strip().lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def _refuse_public_master(document: Mapping[str, Any], where: str, given: Mapping[str, Any]) -> None:
    """On one machine (``nnodes`` 1, as given or as the file says) a cfg file's ``master_addr`` must be loopback:
    the rendezvous store listens on it, and an address such as 0.0.0.0 or a public one opens the group to the
    network where nothing but this machine's ranks need to reach it. Several nodes need a reachable address, so
    there the file's is taken (the nodes' own command lines must agree with it anyway)."""
    value = _file_value("master_addr", document, given) if "master_addr" in document else None
    nnodes = _file_value("nnodes", document, given)
    if not isinstance(value, str) or not isinstance(nnodes, str) or node_range(nnodes)[1] != 1:
        return
    if not _is_loopback_name(value):
        shown_value = excerpt(value, 60, quote=False)
        raise ConfigError(
            f"{where}master_addr: {shown_value} lifts a safety guard: on one machine (nnodes=1) the group listens on "
            "master_addr, and a cfg file may only give loopback there (127.0.0.1, ::1, localhost); another address "
            f"is taken from the command line or the API only (detrain ... master_addr={shown_value})"
        )


def _refuse_far_project(document: Mapping[str, Any], where: str, given: Mapping[str, Any], cfg_file: str) -> None:
    """A cfg file's ``project`` stays inside the current working folder, links resolved (a relative path whose
    ``..`` do not climb out of it, or an absolute one inside it), or is the project the file's own run folder lies
    in (a run's ``<project>/<name>/args.yaml`` read back, the run's ``name`` that folder's, or left to the
    increment): a run writes its folder, weights and logs there, and a yaml handed over must not pick where
    (``project: /home/me``, ``name: .ssh``, ``exist_ok: true``)."""
    value = _file_value("project", document, given) if "project" in document else None
    if not isinstance(value, str) or not value:
        return
    real, cwd = os.path.realpath(value), os.path.realpath(os.getcwd())
    if os.path.commonpath([real, cwd]) == cwd:
        return
    run_folder = os.path.dirname(os.path.realpath(cfg_file))
    name = _file_value("name", document, given)
    if real == os.path.dirname(run_folder) and name in ("", os.path.basename(run_folder)):
        return
    shown_value = path_excerpt(value, 80)
    raise ConfigError(
        f"{where}project: {shown_value} is outside the current folder {path_excerpt(cwd, 80)}: a cfg file's "
        "project must stay inside it (a relative path, no '..' climbing out) or be the project its own run folder "
        f"lies in; another folder is taken from the command line or the API only (detrain ... project={shown_value})"
    )


def _for_command(document: dict[str, Any], command: str | None, given: Mapping[str, Any], where: str) -> dict:
    """The file's keys ``command`` takes, less those ``given`` overrides; one line for the others whose values
    differ from the defaults (they change nothing here, which the user may not expect)."""
    takes = COMMAND_KEYS[command] if command is not None else tuple(SECTION_OF)
    left_out = [k for k in document if k not in takes]
    changed = [k for k in left_out if not _is_default(k, document[k])]
    if changed:
        note(
            f"note: {where}{len(changed)} key{'s' * (len(changed) > 1)} that 'detrain {command}' does not take "
            f"{'are' if len(changed) > 1 else 'is'} left out: {listed(changed, 60)}"
        )
    return {k: v for k, v in document.items() if k in takes and k not in given}


def _is_default(key: str, value: Any) -> bool:
    """Whether a file's ``value`` for ``key`` equals its default (compared as given: an args.yaml's are)."""
    default = SPECS_DEFAULTS[key]
    return type(value) is type(default) and value == default


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
    check_keys(out, command, words=True)
    return out
