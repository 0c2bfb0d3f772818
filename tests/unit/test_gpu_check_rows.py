"""scripts/gpu_check.py's rows: the markdown table, a check turned into a row, and the comparison that holds a resumed
run to the machine's own run-to-run difference (fed synthetic checkpoints)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from _scripts import load_script

gc = load_script("gpu_check")


def test_table_is_one_markdown_row_per_check_with_pipes_escaped() -> None:
    rows = [gc.Row("a", "ok", "x | y", {"ms": 1.23456, "n": 3, "ok": True}, 2.04), gc.Row("b", "skipped", "no CUDA")]
    assert gc.table(rows).splitlines() == [
        "| check | status | result | figures | s |",
        "|---|---|---|---|---|",
        "| a | ok | x \\| y | ms=1.235, n=3, ok=True | 2.0 |",
        "| b | skipped | no CUDA |  | 0.0 |",
    ]


def _ckpt(model: dict[str, torch.Tensor], ema: dict[str, torch.Tensor] | None = None) -> dict:
    return {"model": {"state_dict": model}, "ema": {"state_dict": ema if ema is not None else model}}


def test_a_resume_is_held_to_the_measured_run_to_run_difference() -> None:
    w = torch.zeros(3)
    straight, again = _ckpt({"w": w, "n": torch.tensor(2)}), _ckpt({"w": w + 2e-4, "n": torch.tensor(2)})
    noise = gc.max_weight_diff(straight, again)
    assert noise == pytest.approx(2e-4)
    close = _ckpt({"w": w + 1e-4, "n": torch.tensor(2)})
    far = _ckpt({"w": w.clone(), "n": torch.tensor(2)}, ema={"w": w + 5e-4, "n": torch.tensor(2)})  # the EMA moved
    assert gc.within_noise(gc.max_weight_diff(straight, close), noise)
    assert not gc.within_noise(gc.max_weight_diff(straight, far), noise)
    # a CPU: no noise; bitwise or within 1e-6
    assert gc.within_noise(gc.max_weight_diff(straight, _ckpt({"w": w + 5e-7, "n": torch.tensor(2)})), 0.0)
    assert not gc.within_noise(gc.max_weight_diff(straight, close), 0.0)
    # another run altogether: other names, another step count
    assert gc.max_weight_diff(straight, _ckpt({"v": w, "n": torch.tensor(2)})) == math.inf
    assert gc.max_weight_diff(straight, _ckpt({"w": w, "n": torch.tensor(3)})) == math.inf


def test_a_check_becomes_a_row_ok_skipped_or_failed(tmp_path: Path) -> None:
    ctx = gc.Context(work=tmp_path, cuda=False, gpus=0)

    def fails(_):
        raise AssertionError("resumed weights differ\nmore lines")

    def skips(_):
        raise gc.Skip("needs 2 GPUs")

    assert gc.run_check("a", lambda _: ("fine", {"x": 1}), ctx).status == "ok"
    assert (gc.run_check("b", skips, ctx).status, gc.run_check("b", skips, ctx).result) == ("skipped", "needs 2 GPUs")
    failed = gc.run_check("c", fails, ctx)
    assert (failed.status, failed.result) == ("failed", "AssertionError: resumed weights differ")


def test_checks_past_the_deadline_are_skipped_rows_and_each_row_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leased GPU's time is counted: a check that would start after --deadline-s is a row that says so, and the
    rows so far are handed on after every check (the JSON of a run cut off still holds them)."""
    ctx = gc.Context(work=tmp_path, cuda=False, gpus=0)
    ran: list[str] = []

    def slow(_):
        ran.append("slow")
        time.sleep(0.05)
        return "done", {}

    monkeypatch.setattr(gc, "CHECKS", [("slow", slow), ("late", lambda _: ran.append("late") or ("x", {}))])
    seen: list[list[str]] = []
    rows = gc.run_all(ctx, None, deadline_s=0.01, report=lambda rs: seen.append([r.status for r in rs]))
    assert ran == ["slow"] and [r.status for r in rows] == ["ok", "skipped"]
    assert rows[1].result.startswith("out of time") and seen == [["ok"], ["ok", "skipped"]]
    assert [r.status for r in gc.run_all(ctx, ["late"], deadline_s=None)] == ["ok"]
