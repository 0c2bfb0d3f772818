"""Fuzzed model yamls (issue 25, item 7): seeded mutations of the packaged YOLOv8, YOLO11 and YOLO26 yamls go
through the one yaml loader and the model-yaml checks into the builder; each ends as a built model (whose parameter
and module counts the plan predicted exactly) or as one ConfigError line, within a few seconds, never another
exception.

A case changes 1-4 places of the architecture (a top-level key, a scale's multiple, a row's from, repeats, module or
argument; a row dropped, duplicated or swapped) to a value from a hostile pool (widths and repeats in the millions,
NaN, wrong types, other module names), and writes it as yaml text with, in some cases, an alias graph, a deeply
nested value or a huge scalar spliced in at a changed place. Models are built on the meta device: the checks under
test run the same, and a valid but big model costs nothing.
"""

from __future__ import annotations

import copy
import random
import resource
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import yaml

from detrain.errors import ConfigError
from detrain.nn.model import DetectionModel, load_model_yaml
from detrain.nn.yaml_plan import plan_layers

CASES = 240
SEED = 2025
MARK = "__SPLICE__"  # a placeholder value replaced in the yaml text by an alias, a deep nest or a huge scalar

_VALUES: list[Any] = [
    0, 1, -1, 2, 3, 16, 64, 65, 1024, 8192, 8193, 10**6, 10**9, 2**63, 10**30,
    0.5, 1.5, 1e-9, 1e6, 1e300, float("nan"), float("inf"), float("-inf"),
    True, False, None, "", "nc", "None", "Conv", "C2f", "C3k2", "C2PSA", "SPPF", "Detect", "Concat", "nearest",
    "SCDown", "x" * 300, [], [1, 2], [-1, 0], [[-1]], [64, 3, 2], {}, {"a": 1}, MARK,
]  # fmt: skip
_TOP_KEYS = ["nc", "scale", "scales", "reg_max", "end2end", "head_cls_channels", "depth_multiple", "width_multiple"]
_TOP_KEYS += ["activation", "backbone", "head"]


def _splice(rng: random.Random) -> tuple[str, str]:
    """(text defining anchors before the document's keys, the text standing in for the placeholder)."""
    kind = rng.choice(["alias-bomb", "alias-small", "deep-list", "deep-map", "huge-int", "huge-text", "huge-float"])
    if kind.startswith("alias"):
        width, depth = (9, rng.randint(3, 9)) if kind == "alias-bomb" else (rng.randint(1, 3), rng.randint(1, 3))
        lines = [f"z0: &z0 [{', '.join(['64'] * width)}]"]
        lines += [f"z{i}: &z{i} [{', '.join([f'*z{i - 1}'] * width)}]" for i in range(1, depth)]
        return "\n".join(lines) + "\n", f"*z{depth - 1}"
    if kind == "deep-list":
        n = rng.choice([10, 63, 70, 5000])
        return "", "[" * n + "1" + "]" * n
    if kind == "deep-map":
        n = rng.choice([10, 70, 3000])
        return "", "{a: " * n + "1" + "}" * n
    if kind == "huge-int":
        return "", "9" * rng.choice([20, 400, 5000])
    if kind == "huge-float":
        return "", rng.choice(["1e400", "-1e400", ".nan", ".inf"])
    return "", "x" * rng.choice([1000, 200_000])


def _mutate(rng: random.Random, d: dict[str, Any]) -> str:
    """One change to ``d`` in place; returns its name (for the tally)."""
    parts = [p for p in ("backbone", "head") if isinstance(d.get(p), list) and d[p]]
    roll = rng.random()
    if roll < 0.2 or not parts:
        d[rng.choice(_TOP_KEYS)] = copy.deepcopy(rng.choice(_VALUES))
        return "top-level"
    scales = d.get("scales")
    if roll < 0.3 and isinstance(scales, dict) and scales:
        name = rng.choice(list(scales))
        if isinstance(scales[name], list) and scales[name]:
            scales[name][rng.randrange(len(scales[name]))] = copy.deepcopy(rng.choice(_VALUES))
        else:
            scales[name] = copy.deepcopy(rng.choice(_VALUES))
        return "scale"
    part = rng.choice(parts)
    at = rng.randrange(len(d[part]))
    row = d[part][at]
    if roll < 0.4:
        op = rng.choice(["drop", "duplicate", "swap"])
        if op == "drop":
            del d[part][at]
        elif op == "duplicate":
            d[part].insert(at, copy.deepcopy(row))
        else:
            other = rng.randrange(len(d[part]))
            d[part][at], d[part][other] = d[part][other], row
        return "row-" + op
    if roll < 0.75 and isinstance(row, list) and len(row) == 4 and isinstance(row[3], list) and row[3]:
        row[3][rng.randrange(len(row[3]))] = copy.deepcopy(rng.choice(_VALUES))
        return "argument"
    if isinstance(row, list) and row:
        row[rng.randrange(len(row))] = copy.deepcopy(rng.choice(_VALUES))
        return "row-field"
    d[part][at] = copy.deepcopy(rng.choice(_VALUES))
    return "row"


def _case(rng: random.Random, bases: list[tuple[dict[str, Any], str]]) -> tuple[str, list[str], str | None]:
    """(yaml text, the changes made, the scale to ask for or None)."""
    base, scale = rng.choice(bases)
    d = copy.deepcopy(base)
    d["scale"] = scale
    changes = [_mutate(rng, d) for _ in range(rng.randint(1, 4))]
    text = yaml.safe_dump(d, sort_keys=False, width=10**6)
    if MARK in text:
        anchors, value = _splice(rng)
        text = anchors + text.replace(MARK, value, 1).replace(MARK, "1")
        changes.append("splice")
    return text, changes, rng.choice([None, None, "n", "s", "m", "l", "x", "q"])


def _reason(message: str) -> str:
    """A refusal's kind, for the tally: the words after the file's name, or the checked thing of a layer."""
    if "cannot be built: " in message:
        return "layer: " + message.split("cannot be built: ", 1)[1][:25]
    return message.rsplit(".yaml", 1)[-1][:40]


def _cpu_s() -> float:
    """This process's CPU time (user + system): what a case costs, whatever else the machine runs."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def test_fuzzed_model_yamls_build_or_are_one_line(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    bases = [(load_model_yaml(f"{family}.yaml")[0], rng.choice("nsmlx")) for family in ("yolov8", "yolo11", "yolo26")]
    outcomes: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    path = tmp_path / "fuzzed.yaml"
    started = _cpu_s()
    for index in range(CASES):
        text, changes, scale = _case(rng, bases)
        path.write_text(text)
        start = _cpu_s()
        try:
            with torch.device("meta"):
                model = DetectionModel(str(path), scale=scale)
        except ConfigError as e:
            message = str(e)
            assert "\n" not in message and len(message) < 600, (index, changes, message)
            outcomes["refused"] += 1
            reasons[_reason(message)] += 1
        except Exception as e:  # the finding this test exists for
            raise AssertionError(f"case {index} ({changes}) raised {type(e).__name__}: {e}\n{text[:2000]}") from e
        else:
            plan = plan_layers(copy.deepcopy(model.yaml), model.scale, model.nc)
            assert plan.params == sum(p.numel() for p in model.parameters()), (index, changes)
            assert plan.modules == len(list(model.modules())), (index, changes)
            outcomes["built"] += 1
        assert _cpu_s() - start < 5.0, (index, changes)  # a hang guard in CPU seconds: load does not move it
    assert outcomes["built"] >= 10 and outcomes["refused"] >= CASES / 2, outcomes
    assert len(reasons) >= 5, reasons  # refused for many different reasons, not one early check
    assert _cpu_s() - started < 60  # CPU seconds; about 10 on this machine
