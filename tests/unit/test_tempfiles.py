"""Atomically written files get the mode an ordinary open() gives (0666 & ~umask), not mkstemp's 0600."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from detrain.log import atomic_write_text
from detrain.system.tempfiles import temp_beside, umask
from detrain.weights.checkpoint import save_checkpoint


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_results_and_checkpoints_follow_the_umask(tmp_path: Path, mask: int) -> None:
    old = os.umask(mask)
    try:
        assert umask() == mask
        written = [
            atomic_write_text(tmp_path / "results.csv", "epoch\n1\n"),
            save_checkpoint({"epoch": 1}, tmp_path / "weights" / "last.pt"),
        ]
    finally:
        os.umask(old)
    for path in written:
        assert os.stat(path).st_mode & 0o777 == 0o666 & ~mask, path
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["last.pt", "results.csv"]  # no leftovers


def test_temporary_names_are_hidden_and_exclusive(tmp_path: Path) -> None:
    fd1, a = temp_beside(tmp_path / "last.pt")
    fd2, b = temp_beside(tmp_path / "last.pt")
    os.close(fd1), os.close(fd2)
    assert a != b and all(Path(n).name.startswith(".last.pt.") and n.endswith(".tmp") for n in (a, b))


def test_unfinished_writes_are_removed_and_nothing_else(tmp_path: Path) -> None:
    """What a save killed before its rename leaves (``.last.pt.<12 hex>.tmp``) goes at the next start; files that
    only look similar, folders, links (and what they point to) stay."""
    from detrain.system.tempfiles import remove_unfinished

    weights = tmp_path / "weights"
    weights.mkdir()
    left = weights / ".last.pt.0123456789ab.tmp"  # a write killed mid-way (SIGKILL: no cleanup)
    left.write_bytes(b"half a checkpoint")
    (weights / ".mid.pt.a1b2c3d4e5f6.tmp").write_bytes(b"x")
    keep = [".last.pt.0123456789AB.tmp", ".last.pt.0123.tmp", "last.pt", ".hidden", "x.0123456789ab.tmp"]
    for name in keep:
        (weights / name).write_bytes(b"mine")
    outside = tmp_path / "precious"
    outside.write_bytes(b"not detrain's")
    (weights / ".best.pt.ffffffffffff.tmp").symlink_to(outside)
    (weights / ".epoch1.pt.eeeeeeeeeeee.tmp").mkdir()
    assert remove_unfinished(weights) == [".last.pt.0123456789ab.tmp", ".mid.pt.a1b2c3d4e5f6.tmp"]
    assert outside.read_bytes() == b"not detrain's" and (weights / ".best.pt.ffffffffffff.tmp").is_symlink()
    assert all((weights / name).exists() for name in keep) and (weights / ".epoch1.pt.eeeeeeeeeeee.tmp").is_dir()
    assert remove_unfinished(tmp_path / "missing") == [] and remove_unfinished(weights) == []
