"""One run at a time in a run folder (detrain/engine/train/state/run_lock.py): while a ``detrain train`` writes its
folder, a second one into it (``exist_ok=True``, or ``resume=true`` of the same run) stops with exit code 2 and one
line naming the folder and the holder (pid, host); once the holder is killed outright (SIGKILL: no chance to let go),
the next run takes the lock over and says so in one line.

The first run is a tiny shapes run of many epochs at 32 pixels, started in a session of its own so that the test
can kill it with everything it started.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _faults import wait_for
from _processes import child_env

from detrain.data.synthetic import generate_shapes
from detrain.engine.train.state import run_lock
from detrain.errors import ConfigError

pytestmark = pytest.mark.integration

LIMIT_S = 240.0
ARGS = dict(
    model="n.yaml",
    imgsz=32,
    batch=4,
    workers=0,
    device="cpu",
    val=False,
    plots=False,
    warmup_epochs=0,
    close_mosaic=0,
    name="run",
    exist_ok=True,
)


def _cmd(**args: object) -> list[str]:
    return [sys.executable, "-m", "detrain.cli", "train", *(f"{k}={v}" for k, v in {**ARGS, **args}.items())]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(args, env=child_env(), cwd=cwd, capture_output=True, text=True, timeout=LIMIT_S)
    except subprocess.TimeoutExpired as e:  # a run that was not stopped trains on: the lock did not hold
        pytest.fail(f"{args[4:]} was not refused: it ran for {LIMIT_S:g} s\n{str(e.stdout)[-2000:]}")


def _holder(lock: Path) -> dict:
    text = lock.read_text() if lock.is_file() else ""
    return json.loads(text) if text else {}


def _refused(proc: subprocess.CompletedProcess, folder: Path, pid: int) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert f"run folder {folder} is in use by another run (pid {pid} on {socket.gethostname()}, since " in lines[0]
    assert "Traceback" not in proc.stderr


def test_a_live_run_folder_is_refused_and_a_dead_runs_lock_is_taken_over(tmp_path: Path) -> None:
    data = generate_shapes(tmp_path / "shapes", n_train=8, n_val=2, imgsz=32, seed=0) / "data.yaml"
    project = tmp_path / "runs"
    folder, lock = project / "run", project / "run" / run_lock.NAME
    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen(
        _cmd(data=data, project=project, epochs=100000),
        env=child_env(),
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        # the lock is taken before anything is written; last.pt is there once an epoch ended
        wait_for(lambda: (folder / "weights" / "last.pt").is_file() or first.poll() is not None, LIMIT_S, "no epoch")
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]

        # a new run into the same folder (exist_ok=True), and a second resume of this very run
        _refused(_run(_cmd(data=data, project=project, epochs=1), tmp_path), folder, first.pid)
        _refused(_run(_cmd(data=data, project=project, resume=True), tmp_path), folder, first.pid)
        assert first.poll() is None  # the first run goes on, untouched
        assert _holder(lock)["pid"] == first.pid
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)  # the run and anything it started: no chance to let go of the lock
        first.wait()
        log.close()
    assert _holder(lock)["pid"] == first.pid  # its record stays: nobody released the lock

    third = _run(_cmd(data=data, project=project, epochs=1), tmp_path)
    assert third.returncode == 0, third.stdout[-2000:] + third.stderr[-2000:]
    took = f"run folder {folder}: took over the lock of pid {first.pid} on {socket.gethostname()}, since "
    assert [line for line in third.stdout.splitlines() if line.startswith(took)], third.stdout[-2000:]
    assert third.stdout.count("took over the lock") == 1
    assert lock.read_text() == ""  # a run that ended let go: the next one has nothing to take over


def test_the_lock_in_one_process_forked_children_and_a_dead_holder(tmp_path: Path) -> None:
    held = run_lock.RunLock.take(tmp_path / "run")
    with pytest.raises(ConfigError, match=rf"in use by another run \(pid {os.getpid()} on "):
        run_lock.RunLock.take(tmp_path / "run")
    child = os.fork()  # a forked child (a data loader's worker) lets go of its copy at once
    if child == 0:
        os._exit(0 if not run_lock._HELD else 1)
    assert os.waitpid(child, 0)[1] == 0
    held.release()
    held.release()  # twice is once
    again = run_lock.RunLock.take(tmp_path / "run")
    assert again.note is None  # released: nothing to take over
    again.release()

    child = os.fork()  # a holder that dies without letting go
    if child == 0:
        run_lock.RunLock.take(tmp_path / "run")
        os._exit(0)
    assert os.waitpid(child, 0)[1] == 0
    taken = run_lock.RunLock.take(tmp_path / "run")
    assert taken.note is not None and f"took over the lock of pid {child} on " in taken.note
    taken.release()


def test_a_lock_file_that_is_a_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").write_text("")
    (tmp_path / "run" / run_lock.NAME).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="cannot lock the run folder"):
        run_lock.RunLock.take(tmp_path / "run")
