"""The run record that travels with a checkpoint to a rank 0 on another node (detrain/engine/train/state/run_record.py):
what a
holder's run folder may hold in its place (read as hostile), and what a received record may hold (written only
under the known names, atomically)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from detrain.engine.train.state import run_record


def _folder(root: Path) -> Path:
    (root / "weights").mkdir(parents=True)
    (root / "results.csv").write_text("epoch\n1\n")
    (root / "events.jsonl").write_text('{"kind":"start"}\n')
    (root / "manifest.json").write_text("{}\n")
    (root / "weights" / "best.pt").write_bytes(b"weights")
    return root


def test_the_record_is_results_events_manifest_and_best_pt_and_nothing_else(tmp_path: Path) -> None:
    src = _folder(tmp_path / "a")
    (src / "args.yaml").write_text("epochs: 3\n")  # rank 0 writes its own
    (src / "weights" / "last.pt").write_bytes(b"the checkpoint travels by itself")
    record = run_record.collect(src)
    assert sorted(record) == ["events.jsonl", "manifest.json", "results.csv", "weights/best.pt"]
    run_record.restore(tmp_path / "b", record)
    for name in record:
        assert (tmp_path / "b" / name).read_bytes() == (src / name).read_bytes()
    assert sorted(p.name for p in (tmp_path / "b").rglob("*")) == [
        "best.pt",
        "events.jsonl",
        "manifest.json",
        "results.csv",
        "weights",
    ]


def test_a_symlink_in_the_holders_folder_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("not the run's")
    src = tmp_path / "a"
    src.mkdir()
    (src / "results.csv").symlink_to(secret)
    assert run_record.collect(src) == {}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_in_the_holders_folder_does_not_block_the_read(tmp_path: Path) -> None:
    src = tmp_path / "a"
    src.mkdir()
    os.mkfifo(src / "events.jsonl")
    assert run_record.collect(src) == {}


def test_an_oversized_file_is_left_out_and_oversized_events_travel_as_their_last_whole_lines(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(run_record, "LIMITS", {"results.csv": 8, "events.jsonl": 10})
    src = tmp_path / "a"
    src.mkdir()
    (src / "results.csv").write_text("epoch\n1\n2\n")  # 11 bytes
    (src / "events.jsonl").write_text("first line\nsecond\nthird\n")
    assert run_record.collect(src) == {"events.jsonl": b"third\n"}


@pytest.mark.parametrize(
    "record",
    [
        None,
        ["results.csv"],
        {"../../escape.csv": b"x"},
        {"/tmp/x": b"x"},
        {"results.csv": "text, not bytes"},
        {"results.csv": b"x" * ((16 << 20) + 1)},
    ],
)
def test_a_forged_record_writes_nothing(tmp_path: Path, record: object) -> None:
    run_record.restore(tmp_path / "run", record)
    assert not (tmp_path / "run").exists() and not (tmp_path.parent / "escape.csv").exists()


def test_a_symlink_where_rank_0_writes_is_replaced_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.csv"
    outside.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.csv").symlink_to(outside)
    run_record.restore(run, {"results.csv": b"epoch\n1\n"})
    assert outside.read_text() == "keep me" and not (run / "results.csv").is_symlink()
    assert (run / "results.csv").read_bytes() == b"epoch\n1\n"
