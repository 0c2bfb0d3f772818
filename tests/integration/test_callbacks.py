"""Model.add_callback: the events fire in order with their epochs, metrics and files, on rank 0 only (once per event
with 2 gloo workers), a callback the workers cannot import is refused before anything starts, and a raising
callback stops the run with its own exception after the epoch's last.pt is written.

Every run is tiny (64 px, 8 images, scale n, workers=0); the 2-worker runs go through a child process with a
generous time limit, as in tests/integration/test_train_distributed.py.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import _callback_hooks as hooks
import pytest
import torch
from _processes import one_thread  # noqa: F401 (a fixture)

from detrain import Model
from detrain.data.synthetic import generate_shapes
from detrain.engine.train.callbacks import EVENTS, TrainEvent, unsendable_reason
from detrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
LIMIT_S = 300  # a 2-worker run that has not ended by then hangs
TINY = dict(
    epochs=2,
    imgsz=64,
    batch=8,
    nbs=8,
    device="cpu",
    workers=0,
    warmup_epochs=0,
    close_mosaic=0,
    plots=False,
    verbose=False,
    exist_ok=True,
    name="run",
)
PER_EPOCH = ["on_train_epoch_start", "on_train_epoch_end", "on_model_save", "on_fit_epoch_end"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = generate_shapes(tmp_path_factory.mktemp("cb") / "shapes", n_train=8, n_val=2, imgsz=64, seed=0)
    return root / "data.yaml"


pytestmark = pytest.mark.usefixtures("one_thread")


class HookFailed(Exception):
    pass


# ------------------------------------------------------------------ one process


def test_events_fire_in_order_with_epochs_metrics_and_files(data: Path, tmp_path: Path) -> None:
    seen: list[tuple[TrainEvent, int, int | None]] = []

    def note(event: TrainEvent) -> None:  # a closure: fine when the run trains in this process
        # the epoch last.pt holds at the moment of the call: on_model_save comes after it is written
        held = torch.load(event.last, weights_only=True)["epoch"] if event.last else None
        seen.append((event, os.getpid(), held))

    model = Model("n.yaml")
    for name in EVENTS:
        model.add_callback(name, note)
    result = model.train(data=str(data), project=str(tmp_path / "runs"), **TINY)

    events = [e for e, _, _ in seen]
    assert [e.event for e in events] == [*EVENTS[:3], *PER_EPOCH * 2, "on_train_end"]
    assert [e.epoch for e in events] == [0, 0, 0] + [1] * 4 + [2] * 4 + [2]
    assert {pid for _, pid, _ in seen} == {os.getpid()}
    run = Path(result.save_dir)
    assert all(e.save_dir == run and e.epochs == 2 for e in events)
    assert all(e.last is None and not e.metrics for e in events[:3])  # a fresh run: nothing saved or measured yet

    rows = list(csv.DictReader((run / "results.csv").read_text().splitlines()))
    for epoch in (1, 2):
        start, end, saved, fit = events[3 + 4 * (epoch - 1) : 7 + 4 * (epoch - 1)]
        assert not start.metrics
        assert set(end.metrics) == {"train/box_loss", "train/cls_loss", "train/dfl_loss", "lr/pg0", "lr/pg1", "lr/pg2"}
        assert saved.last == run / "weights" / "last.pt" and saved.best == run / "weights" / "best.pt"
        assert seen[5 + 4 * (epoch - 1)][2] == epoch - 1  # last.pt held this epoch (0-based) at on_model_save
        assert dict(saved.metrics) == dict(fit.metrics) and saved.improved == fit.improved
        row = rows[epoch - 1]
        assert set(fit.metrics) == set(row) - {"epoch"} and "metrics/mAP50-95" in fit.metrics
        for key, value in fit.metrics.items():
            assert value == pytest.approx(float(row[key]), rel=1e-5, abs=1e-9), key
        for key in end.metrics:  # the train losses and lrs at epoch end are the row's
            assert end.metrics[key] == pytest.approx(fit.metrics[key], rel=1e-6)
    assert events[6].improved  # the first epoch is always the best so far

    final = events[-1]
    # the numbers train() returns (its details, less the folder and the per-class table)
    assert dict(final.metrics) == {k: v for k, v in result.details.items() if k not in ("save_dir", "per_class")}
    assert final.last == run / "weights" / "last.pt"
    with pytest.raises(TypeError):
        final.metrics["map"] = 1.0  # type: ignore[index]  # read-only: a callback cannot change the run's numbers
    with pytest.raises(dataclasses.FrozenInstanceError):
        final.epoch = 5  # type: ignore[misc]


def test_a_raising_callback_stops_the_run_with_its_error_and_the_epoch_saved(data: Path, tmp_path: Path) -> None:
    def boom(event: TrainEvent) -> None:
        if event.epoch == 1:
            raise HookFailed("upload failed")

    model = Model("n.yaml")
    model.add_callback("on_fit_epoch_end", boom)
    with pytest.raises(HookFailed, match="upload failed") as info:
        model.train(data=str(data), project=str(tmp_path / "runs"), **TINY)
    run = tmp_path / "runs" / "run"
    last = run / "weights" / "last.pt"
    note = " ".join(getattr(info.value, "__notes__", []))
    if sys.version_info >= (3, 11):
        assert "on_fit_epoch_end" in note and "boom" in note and f"resume={last}" in note, note
    # epoch 1 was complete and saved before the callback ran: resuming runs only epoch 2
    assert torch.load(last, weights_only=True)["epoch"] == 0
    assert [r["epoch"] for r in csv.DictReader((run / "results.csv").read_text().splitlines())] == ["1"]
    Model("n.yaml").train(resume=str(last), device="cpu")
    assert torch.load(last, weights_only=True)["epoch"] == 1
    assert [r["epoch"] for r in csv.DictReader((run / "results.csv").read_text().splitlines())] == ["1", "2"]


# ------------------------------------------------------------------ what add_callback and a spawning run accept


def test_add_callback_refuses_an_event_detrain_does_not_fire_and_a_non_callable() -> None:
    model = Model("n.yaml")
    with pytest.raises(ConfigError, match="'on_val_end' is not one detrain fires; use one of: on_pretrain"):
        model.add_callback("on_val_end", print)
    with pytest.raises(ConfigError, match="must be callable"):
        model.add_callback("on_train_end", "print")
    assert model.callbacks == {}


def test_a_lambda_is_refused_before_workers_start_or_a_folder_is_made(data: Path, tmp_path: Path) -> None:
    model = Model("n.yaml")
    model.add_callback("on_train_start", functools.partial(hooks.record, str(tmp_path / "log")))  # importable
    model.add_callback("on_fit_epoch_end", lambda event: None)
    with pytest.raises(ConfigError) as info:
        model.train(data=str(data), project=str(tmp_path / "runs"), **{**TINY, "device": "cpu,cpu"})
    message = str(info.value)
    assert "\n" not in message
    assert "<lambda> for on_fit_epoch_end cannot be sent to the 2 workers of device='cpu,cpu'" in message
    assert "a lambda has no name the workers can import" in message
    assert not (tmp_path / "runs").exists() and not (tmp_path / "log").exists()


def test_what_spawned_workers_can_and_cannot_receive(monkeypatch: pytest.MonkeyPatch) -> None:
    def closure(event: TrainEvent) -> None:
        pass

    assert unsendable_reason(hooks.fail) is None
    assert unsendable_reason(functools.partial(hooks.record, "/tmp/x")) is None  # pickled by reference + its path
    assert "lambda" in unsendable_reason(lambda e: None)
    assert "closure" in unsendable_reason(closure)
    assert "cannot be pickled" in unsendable_reason(functools.partial(closure))
    # a function of a notebook: __main__ has no file the workers could import again
    notebook = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    exec("def cell(event):\n    pass\n", notebook.__dict__)
    assert "notebook" in unsendable_reason(notebook.cell)


# ------------------------------------------------------------------ two gloo workers (device=cpu,cpu)

_TRAIN = """
import functools, json, os, sys
import _callback_hooks as hooks
from detrain import Model
from detrain.errors import DetrainError
args, log, events, failing = json.loads(sys.argv[1])
model = Model("n.yaml")
for name in events:
    model.add_callback(name, functools.partial(hooks.record, log))
if failing:
    model.add_callback(failing, hooks.fail)
print("LAUNCHER", os.getpid())
try:
    model.train(**args)
except DetrainError as e:
    print("ERROR", type(e).__name__, e)
    sys.exit(2)
"""


def _two_workers(
    data: Path, tmp_path: Path, events: list[str], failing: str = ""
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    log = tmp_path / "callbacks.jsonl"
    args = {**TINY, "epochs": 1, "data": str(data), "device": "cpu,cpu", "project": str(tmp_path / "runs")}
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TEST_FAULT")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _TRAIN, json.dumps([args, str(log), events, failing])],
            env=env,
            capture_output=True,
            text=True,
            timeout=LIMIT_S,
            cwd=tmp_path,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the 2-worker run did not end within {LIMIT_S} s:\n{e.stdout}\n{e.stderr}")
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.is_file() else []
    return proc, lines


def test_two_workers_run_each_callback_once_on_rank_0_in_a_worker(data: Path, tmp_path: Path) -> None:
    proc, lines = _two_workers(data, tmp_path, list(EVENTS))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [x["event"] for x in lines] == list(EVENTS)  # each event exactly once: 1 epoch
    assert [x["epoch"] for x in lines] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert {(x["rank"], x["env_rank"]) for x in lines} == {(0, "0")}
    launcher = int(proc.stdout.split("LAUNCHER ")[1].split()[0])
    pids = {x["pid"] for x in lines}
    assert len(pids) == 1 and launcher not in pids  # rank 0's spawned worker, not the launching process
    assert lines[6]["metrics"] == lines[5]["metrics"] and "metrics/mAP50" in lines[6]["metrics"]
    assert lines[5]["last"] == str(tmp_path / "runs" / "run" / "weights" / "last.pt")


def test_two_workers_a_raising_callback_ends_the_run_with_one_line_naming_rank_0(data: Path, tmp_path: Path) -> None:
    proc, lines = _two_workers(data, tmp_path, ["on_pretrain_routine_start", "on_train_start"], "on_train_start")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    error = proc.stdout.split("ERROR ", 1)[1].strip()
    assert error.startswith("DistributedError worker rank 0 failed")
    assert "RuntimeError: callback failed on purpose at on_train_start" in error and "\n" not in error
    # the callbacks before it ran once, on rank 0; rank 1 ran none and was stopped (no hang until a timeout)
    assert [(x["event"], x["rank"]) for x in lines] == [("on_pretrain_routine_start", 0), ("on_train_start", 0)]


# gloo's message on rank 1 when rank 0 left the step (DDP's all-reduce, which detrain.distributed.dist does not wrap)
_GLOO_PEER_GONE = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection "
    "closed by peer [127.0.0.1]:50379. This is typically caused by a remote worker crashing. Check the "
    "logs of the remote worker before reporting an error. GLHF!"
)


def _failure(message: str, timestamp: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        message={"message": message}, timestamp=timestamp, exitcode=1, error_file_data={"message": {"message": message}}
    )


def test_the_report_names_the_rank_whose_callback_raised_not_the_peer_that_lost_it() -> None:
    """Which rank wrote its error file first is a race (whole seconds): rank 1's gloo error may come first."""
    from detrain.distributed.launch.failures import describe_failure

    failures = {
        0: _failure("RuntimeError: callback failed on purpose at on_train_start", 101),
        1: _failure(_GLOO_PEER_GONE, 100),
    }
    line = describe_failure(types.SimpleNamespace(failures=failures), 0)
    assert line.startswith("worker rank 0 failed (exit code 1): RuntimeError: callback failed on purpose"), line
    assert line.endswith("(also failed: rank 1)")
    # a callback's own RuntimeError about a reset connection (an upload, say) is no gloo message: still a cause
    failures[1] = _failure("RuntimeError: upload: connection reset by peer", 100)
    line = describe_failure(types.SimpleNamespace(failures=failures), 0)
    assert line.startswith("worker rank 1 failed (exit code 1): RuntimeError: upload: connection reset"), line
