"""The checkpoint writer (detrain/engine/train/state/writer.py): a save's snapshot is a real copy, one write at a
time in order (the next save waits for the one before), a write's error is raised in the loop's thread at the next
save or at the drain (the same exception a synchronous save raised), and a write that fails or a process killed
mid-write leaves the previous generation of last.pt whole and loadable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from detrain.engine.train.state.writer import Writer, snapshot
from detrain.errors import CheckpointError
from detrain.weights.checkpoint import PREVIOUS, save_checkpoint

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _state(value: float, n: int = 16) -> dict:
    return {"model": {"state_dict": {"w": torch.full((n,), value)}}, "epoch": int(value)}


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_a_snapshot_is_a_copy_that_later_steps_do_not_change() -> None:
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.ones(1, 3)).sum().backward()
    opt.step()
    live = {"model": dict(net.state_dict()), "optimizer": opt.state_dict(), "lrs": [0.1], "t": (1, net.bias)}
    copy, ready = snapshot(live)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    momentum = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    assert ready is None  # nothing came from a GPU
    for _ in range(3):  # the next steps change the weights and the momentum in place
        net(torch.ones(1, 3)).sum().backward()
        opt.step()
    live["lrs"].append(0.2)
    assert all(torch.equal(copy["model"][k], before[k]) for k in before)
    assert not torch.equal(net.weight.detach(), before["weight"])
    assert torch.equal(copy["optimizer"]["state"][0]["momentum_buffer"], momentum)
    assert copy["lrs"] == [0.1] and torch.equal(copy["t"][1], before["bias"])


def test_the_next_save_waits_for_the_one_before_and_writes_keep_their_order() -> None:
    writer, log = Writer(), []
    started, release = threading.Event(), threading.Event()

    def first() -> None:
        started.set()
        release.wait(10)
        log.append("first")

    writer.submit(first)
    assert started.wait(10) and writer.busy()  # the loop got its thread back while the first write runs
    second = threading.Thread(target=writer.submit, args=(lambda: log.append("second"),))
    second.start()
    time.sleep(0.3)
    assert second.is_alive() and log == []  # the second save waits: it has not started
    release.set()
    second.join(10)
    writer.wait()
    assert log == ["first", "second"] and not writer.busy()


def test_a_write_error_is_raised_in_the_loop_at_the_next_save_and_the_next_write_never_runs() -> None:
    writer, ran = Writer(), []
    error = CheckpointError("cannot write w/last.pt: No space left on device; the previous last.pt is intact")

    def failing() -> None:
        raise error

    writer.submit(failing)  # returns at once: the error comes later
    with pytest.raises(CheckpointError) as raised:
        writer.submit(lambda: ran.append(1))
    assert raised.value is error and ran == []  # the very exception a synchronous save raised
    writer.wait()  # raised once


def test_check_raises_a_finished_writes_error_at_once_and_never_waits_for_one_in_flight() -> None:
    writer, release = Writer(), threading.Event()
    writer.submit(lambda: release.wait(10))
    start = time.perf_counter()
    writer.check()  # in flight: nothing to say, and no wait
    assert time.perf_counter() - start < 1 and writer.busy()
    release.set()
    writer.wait()
    writer.submit(lambda: (_ for _ in ()).throw(CheckpointError("cannot write last.pt: disk full")))
    while writer.busy():
        time.sleep(0.01)
    with pytest.raises(CheckpointError, match="disk full"):
        writer.check()  # the step after the write failed
    writer.check()  # raised once


def test_a_write_error_is_raised_at_the_drain_and_finish_only_says_it(capsys: pytest.CaptureFixture) -> None:
    writer = Writer()
    writer.submit(lambda: (_ for _ in ()).throw(CheckpointError("cannot write last.pt: disk full")))
    with pytest.raises(CheckpointError, match="disk full"):
        writer.wait()
    writer.submit(lambda: (_ for _ in ()).throw(CheckpointError("cannot write mid.pt: disk full")))
    writer.finish()  # the run ends on an error of its own: this one is a line
    assert "the last checkpoint write failed too: cannot write mid.pt: disk full" in capsys.readouterr().out


def test_a_write_that_fails_half_way_leaves_the_previous_generation(tmp_path: Path, monkeypatch) -> None:
    last = tmp_path / "last.pt"
    save_checkpoint(_state(1.0), last)
    real_save = torch.save

    def half(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, os.strerror(28))

    writer = Writer()
    copy, _ = snapshot(_state(2.0))
    monkeypatch.setattr(torch, "save", half)
    writer.submit(lambda: save_checkpoint(copy, last, keep_previous=PREVIOUS))
    with pytest.raises(CheckpointError, match=r"cannot write .*last\.pt: No space left on device; the previous"):
        writer.wait()
    monkeypatch.setattr(torch, "save", real_save)
    assert _load(last)["epoch"] == 1  # the previous generation, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.prev.pt", "last.pt"]  # no temporary file left


def test_a_process_killed_while_its_writer_writes_leaves_the_previous_last_pt(tmp_path: Path) -> None:
    """SIGKILL in the middle of the writer's torch.save (half the bytes in the temporary file): last.pt is the
    previous generation, loadable; the temporary file is what the next start removes."""
    script = textwrap.dedent(
        f"""
        import os, signal, threading, torch
        from detrain.engine.train.state.writer import Writer, snapshot
        from detrain.weights.checkpoint import PREVIOUS, save_checkpoint
        last = {str(tmp_path / "last.pt")!r}
        save_checkpoint({{"model": {{"state_dict": {{"w": torch.ones(4)}}}}, "epoch": 1}}, last)
        real = torch.save
        def killed_half_way(obj, f, *a, **k):
            f.write(b"PK\\x03\\x04 half")
            f.flush()
            assert threading.current_thread() is not threading.main_thread()  # the writer's own thread
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save = killed_half_way
        copy, ready = snapshot({{"model": {{"state_dict": {{"w": torch.zeros(4)}}}}, "epoch": 2}})
        w = Writer()
        w.submit(lambda: save_checkpoint(copy, last, keep_previous=PREVIOUS), ready)
        w.wait()
        """
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    ckpt = _load(tmp_path / "last.pt")
    assert ckpt["epoch"] == 1 and torch.equal(ckpt["model"]["state_dict"]["w"], torch.ones(4))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0].startswith(".last.pt.") and names[0].endswith(".tmp") and names[1:] == ["last.prev.pt", "last.pt"]


def test_without_background_each_write_runs_at_once() -> None:
    writer, log = Writer(background=False), []
    writer.submit(lambda: log.append(threading.current_thread() is threading.main_thread()))
    assert log == [True] and not writer.busy()
    with pytest.raises(ValueError, match="at once"):
        writer.submit(lambda: (_ for _ in ()).throw(ValueError("raised at once")))


def test_the_next_snapshot_reuses_the_host_copy_only_once_its_write_has_finished() -> None:
    """Writer.snapshot copies into the tensors of the snapshot before (no allocation per save), so it first waits
    for that snapshot's write: the write reads the values it was given, never the next save's."""
    writer, weights, seen = Writer(), torch.zeros(1000), []
    first, _ = writer.snapshot({"w": weights})

    def slow_write() -> None:
        time.sleep(0.5)
        seen.append(first["w"].clone())

    writer.submit(slow_write)
    weights += 1  # the next step
    second, _ = writer.snapshot({"w": weights})  # waits for slow_write
    assert torch.equal(seen[0], torch.zeros(1000)) and torch.equal(second["w"], torch.ones(1000))
    assert second["w"].data_ptr() == first["w"].data_ptr()  # the same host memory, reused
