"""scripts/bench_scaling.py: which runs it trains, and its table (ratios and epochs to reach the smallest batch)."""

from __future__ import annotations

import argparse

from _scripts import load_script

bs = load_script("bench_scaling")


def test_detrain_runs_once_per_recipe_and_ultralytics_once_per_batch():
    args = bs.parse_args(["--recipes", "auto,none", "--batches", "256,16"])
    assert args.batch_list == [16, 256]
    runs = bs.runs_to_train(args, ["detrain", "ultralytics"])
    assert runs == [
        ("detrain", "auto", 16),
        ("detrain", "auto", 256),
        ("detrain", "none", 16),
        ("detrain", "none", 256),
        ("ultralytics", "-", 16),
        ("ultralytics", "-", 256),
    ]
    ns = bs.run_args(args, "detrain", "none", 256)
    assert ns.batch == 256 and ns.detrain_args == ["lr_scale=none"]
    assert bs.run_args(args, "ultralytics", "-", 256).detrain_args == []


def _row(tool: str, recipe: str, batch: int, per_epoch: dict[int, float]) -> dict:
    best = max(per_epoch.values())
    return {"tool": tool, "recipe": recipe, "batch": batch, "updates": 4096 // batch, "best": best, "final": best,
            "s_epoch": 10.0, "per_epoch": per_epoch}  # fmt: skip


def test_the_table_compares_each_batch_with_its_own_tools_smallest():
    rows = [
        _row("detrain", "auto", 16, {1: 0.3, 2: 0.6}),
        _row("detrain", "auto", 256, {1: 0.1, 2: 0.6}),
        _row("detrain", "none", 16, {1: 0.2, 2: 0.5}),
        _row("detrain", "none", 256, {1: 0.0, 2: 0.05}),
    ]
    lines = bs.table(rows, epochs=2).splitlines()
    assert lines[2].split("|")[7].strip() == "1.00x" and lines[2].split("|")[9].strip() == "2"
    assert lines[3].split("|")[7].strip() == "1.00x" and lines[3].split("|")[9].strip() == "2"
    assert lines[5].split("|")[7].strip() == "0.10x" and lines[5].split("|")[9].strip() == ">2"  # never reached


def test_bad_recipes_are_refused():
    import pytest

    with pytest.raises(SystemExit):
        bs.parse_args(["--recipes", "cubic"])
    assert isinstance(bs.parse_args([]), argparse.Namespace)
