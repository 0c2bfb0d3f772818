"""A checkpoint write that fails (a full disk, an I/O error) is one line naming the file and why, and the previous
checkpoint is left as it was: on a real full filesystem (a 256 KiB tmpfs, where this machine lets the test mount
one) and with the error injected into torch's writer."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
import torch

from detrain.errors import CheckpointError
from detrain.weights.checkpoint import save_checkpoint


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _state(n: int) -> dict:
    return {"model": {"state_dict": {"w": torch.arange(n, dtype=torch.float32)}}, "epoch": 0}


@pytest.fixture
def full_disk(tmp_path: Path):
    """A folder on a 256 KiB tmpfs (root, and a kernel that allows it); skipped elsewhere."""
    where = tmp_path / "tiny"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (not root, or not allowed)")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True)


def test_a_full_disk_is_one_line_and_the_previous_checkpoint_stays(full_disk: Path) -> None:
    last = full_disk / "last.pt"
    save_checkpoint(_state(10), last)
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(_state(1_000_000), last)  # 4 MB into 256 KiB
    assert str(e.value) == f"cannot write {last}: No space left on device; the previous last.pt is intact"
    assert torch.equal(_load(last)["model"]["state_dict"]["w"], torch.arange(10, dtype=torch.float32))
    assert sorted(p.name for p in full_disk.iterdir()) == ["last.pt"]  # no temporary file left behind


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_failed_write_is_one_line_naming_the_file(tmp_path: Path, monkeypatch, code: int) -> None:
    save_checkpoint(_state(10), tmp_path / "last.pt")

    def failing(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half")
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(torch, "save", failing)
    with pytest.raises(CheckpointError, match=rf"cannot write .*last\.pt: {os.strerror(code)}; the previous"):
        save_checkpoint(_state(20), tmp_path / "last.pt")
    with pytest.raises(CheckpointError, match=r"; no best\.pt was written$"):
        save_checkpoint(_state(20), tmp_path / "best.pt")
    monkeypatch.undo()
    assert _load(tmp_path / "last.pt")["model"]["state_dict"]["w"].numel() == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_an_error_that_is_not_the_disk_still_surfaces(tmp_path: Path, monkeypatch) -> None:
    def broken(obj, f, *args, **kwargs):
        raise RuntimeError("a bug, not a disk")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(RuntimeError, match="a bug, not a disk"):
        save_checkpoint(_state(2), tmp_path / "last.pt")
