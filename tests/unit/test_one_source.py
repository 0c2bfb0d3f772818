"""Facts the package keeps in one place (issue 39 item 3): which keys the nodes of one job may give differently (the
``per_node`` marks of ``config/keys.py``), the loss gains' defaults (``config/keys.py``'s loss section) and the
time ranks wait while data is prepared (``PREPARE_TIMEOUT_S``, prepare_timeout's default). Each test fails when
the users of a fact stop reading it from its place, or when a second copy of it is written into a module."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path

import pytest

from detrain.config.cfg import make_cfg
from detrain.config.keys import COMMAND_KEYS, PER_NODE_KEYS, PREPARE_TIMEOUT_S, SPECS, Cfg, Distributed, Loss
from detrain.data.dataset import DetectionDataset
from detrain.data.memory.ram_cache import RamCache
from detrain.distributed.launch import run_identity
from detrain.engine.train.shared_settings import BY_WHAT_THEY_NAME, shared_settings
from detrain.nn.loss import DetectionLoss, LossGains
from detrain.nn.loss_e2e import EndToEndLoss, RegMax1BranchLoss

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "detrain"
KEYS = PACKAGE / "config" / "keys.py"  # where each of these facts lives


def modules_but_keys() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p != KEYS]


def literal_collections(tree: ast.AST) -> list[tuple[int, set[str]]]:
    """(line, the strings in it) of every set, list, tuple and dict (its keys) written out in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Set, ast.List, ast.Tuple)):
            items: list[ast.expr | None] = list(node.elts)
        elif isinstance(node, ast.Dict):
            items = list(node.keys)
        else:
            continue
        strings = {e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        found.append((node.lineno, strings))
    return found


def constant_defaults(tree: ast.AST) -> list[tuple[int, str, object]]:
    """(line, name, value) of every number a module writes as a default or assigns to a name: function parameters'
    defaults, class fields and module constants."""
    found: list[tuple[int, str, object]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            found += [(d.lineno, a.arg, d.value) for a, d in pairs if isinstance(d, ast.Constant)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(node.value, ast.Constant):
                found.append((node.lineno, node.target.id, node.value.value))
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            found += [(node.lineno, t.id, node.value.value) for t in node.targets if isinstance(t, ast.Name)]
    return found


def copies(match: Callable[[str, object], bool]) -> list[str]:
    """Every (name, value) of :func:`constant_defaults` in a module but config/keys.py that ``match`` picks."""
    return [
        f"{p.relative_to(PACKAGE.parent)}:{line}: {name} = {value!r}"
        for p in modules_but_keys()
        for line, name, value in constant_defaults(ast.parse(p.read_text()))
        if match(name, value)
    ]


# ------------------------------------------------------------------------------------------- per-node keys


def test_the_per_node_keys_are_the_ones_the_key_table_marks() -> None:
    assert {name for name, spec in SPECS.items() if spec.per_node} == PER_NODE_KEYS
    assert set(Cfg().node_shared()) == set(SPECS) - PER_NODE_KEYS
    # a node's own devices, loader processes, interface and run id, and what only rank 0 acts on
    assert {"device", "workers", "node_rank", "socket_ifname", "run_id", "project", "plots"} <= PER_NODE_KEYS


def test_a_derived_run_id_hashes_every_key_but_the_per_node_ones() -> None:
    hashed = run_identity.shared_args("train", make_cfg({}).node_shared())
    assert set(hashed) == {"task"} | (set(SPECS) - PER_NODE_KEYS)


def test_the_start_check_compares_every_training_key_but_the_per_node_ones_and_a_few_named_apart() -> None:
    train = set(COMMAND_KEYS["train"])
    assert train >= BY_WHAT_THEY_NAME and not BY_WHAT_THEY_NAME & PER_NODE_KEYS
    assert set(shared_settings(make_cfg({}))) == train - PER_NODE_KEYS - BY_WHAT_THEY_NAME


def test_cache_is_given_alike_by_every_node() -> None:
    # cache=ram decodes each image whole, no cache may decode a JPEG at 1/2 to 1/8 of its size: other pixels
    assert "cache" not in PER_NODE_KEYS
    assert shared_settings(make_cfg({"cache": "ram"})) != shared_settings(make_cfg({}))
    alike = make_cfg({}).node_shared()
    assert run_identity.derive("train", alike) != run_identity.derive("train", {**alike, "cache": "ram"})


def test_no_module_but_the_key_table_lists_per_node_keys() -> None:
    found = [
        f"{p.relative_to(PACKAGE.parent)}:{line}: {sorted(names & PER_NODE_KEYS)}"
        for p in modules_but_keys()
        for line, names in literal_collections(ast.parse(p.read_text()))
        if len(names & PER_NODE_KEYS) >= 3
    ]
    assert not found, "per-node keys listed outside config/keys.py (mark them per_node= there):\n" + "\n".join(found)


# ------------------------------------------------------------------------------------------------ loss gains


def test_the_loss_takes_its_gains_from_the_caller_and_has_no_defaults_of_its_own() -> None:
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(LossGains))
    assert {f.name for f in dataclasses.fields(LossGains)} == {f.name for f in dataclasses.fields(Loss)}
    for criterion in (DetectionLoss, EndToEndLoss, RegMax1BranchLoss):
        gains = inspect.signature(criterion).parameters["gains"]
        assert gains.default is inspect.Parameter.empty, criterion


def test_no_module_but_the_key_table_writes_a_loss_gain_default() -> None:
    gains = dataclasses.asdict(Loss())
    gains["l1"] = gains["dfl"]  # a reg_max 1 head's name for the third gain
    found = copies(lambda name, value: name in gains and value == gains[name])
    assert not found, "loss gains written outside config/keys.py (take them from the config):\n" + "\n".join(found)


# ------------------------------------------------------------------------------------------- prepare timeout


def test_what_prepares_data_without_a_config_waits_prepare_timeout_s_default() -> None:
    assert Distributed().prepare_timeout == PREPARE_TIMEOUT_S
    assert inspect.signature(RamCache.build).parameters["timeout_s"].default == PREPARE_TIMEOUT_S
    assert inspect.signature(DetectionDataset).parameters["cache_timeout_s"].default is None  # then the same


def test_no_module_but_the_key_table_writes_the_prepare_timeout() -> None:
    found = copies(lambda name, value: "timeout" in name.lower() and value == PREPARE_TIMEOUT_S)
    assert not found, "the prepare timeout written outside config/keys.py (import PREPARE_TIMEOUT_S):\n" + "\n".join(
        found
    )


# ------------------------------------------------------------------------------- the checks catch a copy


def test_the_scans_find_the_copies_this_issue_removed() -> None:
    listed = ast.parse('PER_NODE = frozenset({"device", "workers", "node_rank", "socket_ifname"})')
    assert any(len(names & PER_NODE_KEYS) >= 3 for _, names in literal_collections(listed))
    written = ast.parse("class G:\n    box: float = 7.5\n\ndef f(l1: float = 1.5, timeout_s=3600.0): ...\n")
    assert {(name, value) for _, name, value in constant_defaults(written)} == {
        ("box", 7.5),
        ("l1", 1.5),
        ("timeout_s", 3600.0),
    }
