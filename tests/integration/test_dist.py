"""dist: collectives are identities in one process, and correct and bounded across two gloo workers.

The multi-process tests launch tiny workers from ``_dist_workers.py`` through ``detrain.distributed.launch.launcher``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import _dist_workers as workers
import pytest
import torch

from detrain.distributed import dist
from detrain.distributed.launch import slurm
from detrain.distributed.launch.launcher import launch, parse_device
from detrain.distributed.world import World
from detrain.errors import DistributedError

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# ------------------------------------------------------------------------------ one process


def test_single_process_is_identity() -> None:
    with mock.patch.dict(os.environ, {}, clear=False):
        for k in LAUNCHER_VARS:
            os.environ.pop(k, None)
        info = dist.setup(World.from_env().on("cpu"))
        try:
            assert (info.rank, info.world_size, info.distributed, info.backend) == (0, 1, False, None)
            assert (dist.rank(), dist.local_rank(), dist.world_size()) == (0, 0, 1)
            assert dist.is_main() and not dist.is_distributed()
            t = torch.tensor([1.0, 2.0], requires_grad=True)
            s = dist.all_reduce_sum(t)
            assert torch.equal(s, t.detach()) and s is not t and not s.requires_grad
            assert torch.equal(dist.reduce_mean(torch.tensor([3.0])), torch.tensor([3.0]))
            assert dist.all_gather_object({"a": 1}) == [{"a": 1}]
            assert dist.broadcast_object("x") == "x"
            assert dist.agree(False) is False
            dist.barrier("nothing to wait for")
            assert info.restart_count == 0 and info.world.rank == 0  # the World's facts, read once
        finally:
            dist.cleanup()
    assert not dist.is_distributed()


def test_missing_master_is_a_clear_error() -> None:
    with pytest.raises(DistributedError, match="MASTER_ADDR is not"):
        dist.setup(World.from_env({"WORLD_SIZE": "2", "RANK": "1"}).on("cpu"))
    dist.cleanup()


def test_slurm_variables_map_to_torch_ones() -> None:
    task_env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_TASKS_PER_NODE": "2(x2)",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_JOB_ID": "1234",
    }
    with mock.patch.dict(os.environ, task_env):
        for k in LAUNCHER_VARS:
            os.environ.pop(k, None)
        assert slurm.slurm_tasks()
        slurm.map_slurm_env()
        got = {k: os.environ[k] for k in LAUNCHER_VARS}
    assert got == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(15000 + 1234 % 20000),
    }


def test_first_slurm_host() -> None:
    assert slurm.first_slurm_host("node01") == "node01"
    assert slurm.first_slurm_host("gpu[07-09,12],cpu01") == "gpu07"
    assert slurm.first_slurm_host("a-b[3,5]") == "a-b3"


# ------------------------------------------------------------------------------- two workers


def test_collectives_on_two_workers() -> None:
    r0 = launch(workers.collectives, {}, parse_device("cpu,cpu"))
    assert r0 is not None  # rank 0's return value comes back to the caller
    assert (r0["rank"], r0["world"], r0["backend"], r0["device"]) == (0, 2, "gloo", "cpu")
    assert r0["sum"] == 3.0  # 1 + 2
    assert r0["mean"] == 0.5  # (0 + 1) / 2
    assert r0["gathered"] == [{"rank": 0}, {"rank": 1}]
    assert r0["shared"] == "from-0"
    assert r0["agree"] is True and r0["main"] is True


def test_restart_after_a_killed_worker(tmp_path: Path) -> None:
    result = launch(workers.die_once, {"marker": str(tmp_path / "died")}, parse_device("cpu,cpu"), max_restarts=1)
    assert (tmp_path / "died").exists()
    assert result == {"rank": 0, "restarts": 1}


def test_dead_worker_ends_the_run() -> None:
    with pytest.raises(DistributedError) as err:
        launch(workers.die_always, {}, parse_device("cpu,cpu"))
    assert "worker rank 1 was killed by SIGKILL" in str(err.value)


def test_worker_exception_is_reported_in_one_line() -> None:
    with pytest.raises(DistributedError) as err:
        launch(workers.raise_error, {}, parse_device("cpu,cpu"))
    msg = str(err.value)
    assert "\n" not in msg
    assert "worker rank 1 failed (exit code 1): ValueError: boom from rank 1" in msg


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(logging.Formatter().format(record))  # with the traceback the record carries


@contextlib.contextmanager
def _torch_log() -> Iterator[list[str]]:
    """What reaches the "torch.distributed" logger, whose own handler prints elastic's records."""
    handler, log = _Lines(), logging.getLogger("torch.distributed")
    log.addHandler(handler)
    try:
        yield handler.lines
    finally:
        log.removeHandler(handler)


def test_elastic_traceback_shows_for_a_crash_and_not_for_detrain_errors() -> None:
    with _torch_log() as lines, pytest.raises(DistributedError, match="ValueError: boom from rank 1"):
        launch(workers.raise_error, {}, parse_device("cpu,cpu"))
    assert any("ValueError: boom from rank 1" in line and "Traceback" in line for line in lines)
    # a message written for the user is the whole story: one line, no traceback above it
    with _torch_log() as lines, pytest.raises(DistributedError, match="DatasetError: no data here"):
        launch(workers.raise_error, {"detrain": True}, parse_device("cpu,cpu"))
    assert not any("no data here" in line for line in lines)


@pytest.mark.parametrize("late", [0, 1])
def test_every_rank_waits_at_a_barrier_only_as_long_as_the_timeout(late: int) -> None:
    """Also rank 0: gloo's monitored barrier would let the other ranks wait for it without end."""
    other = 1 - late
    with pytest.raises(
        DistributedError,
        match=rf"barrier 'end of epoch' failed on rank {other} of 2: "
        rf"rank\(s\) {late} did not arrive within 1s",
    ):
        launch(workers.late_to_barrier, {"late": late}, parse_device("cpu,cpu"))


def test_hang_times_out_and_nothing_is_left(tmp_path: Path) -> None:
    pidfile = str(tmp_path / "pid")
    with pytest.raises(DistributedError) as err:
        launch(workers.hang, {"timeout_s": 3.0, "pidfile": pidfile}, parse_device("cpu,cpu"))
    msg = str(err.value)
    assert "worker rank 0 failed" in msg and "all_reduce_sum failed on rank 0 of 2: timed out after 3s" in msg
    pids = [int(Path(f"{pidfile}.{r}").read_text()) for r in (0, 1)]
    assert not any(_alive(pid) for pid in pids)  # the sleeping rank was stopped too


def test_a_rank_ended_by_nccls_watchdog_names_the_rank_that_stopped(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """NCCL's watchdog ends a rank whose collective waited too long with one line on stderr and SIGABRT (no Python
    error): the launcher, relaying the workers' stderr as it does for GPU workers, reads that line, and the
    heartbeats in its store name the rank that froze, as on gloo, instead of "killed by SIGABRT"."""
    from detrain.distributed.launch import launcher

    monkeypatch.setattr(launcher, "_nccl_workers", lambda plan: True)  # as for GPU workers (NCCL)
    with pytest.raises(DistributedError) as err:
        launch(workers.nccl_watchdog_abort, {"wait_s": 8.0}, parse_device("cpu,cpu"))
    msg = str(err.value)
    assert msg.startswith("rank 1 stopped responding (its heartbeat stopped "), msg
    assert msg.endswith("NCCL's watchdog: ALLREDUCE #7 waited 6s for the other ranks, seen by worker rank 0)"), msg
    assert "\n" not in msg
    assert workers.NCCL_WATCHDOG_LINE in capfd.readouterr().err  # the relay passed the worker's line on


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        ("[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 20000 ms", "rank(s) 1, 3 did not arrive within 20s"),
        (
            "Rank 1 successfully reached monitoredBarrier, but received errors while waiting for send/recv from "
            "rank 0.",
            "no answer from rank 0 within 20s",
        ),
        (
            "[/gloo/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation to complete",
            "timed out after 20s waiting for the other ranks",
        ),
        ("[/gloo/pair.cc:598] Connection closed by peer [127.0.0.1]:1234", "lost the connection to another rank"),
    ],
)
def test_collective_failures_read_as_one_line(error: str, expected: str) -> None:
    cause = dist._cause(RuntimeError(error), 20.0)
    assert cause.startswith(expected) and dist.PEER_LOST_MARK in cause and "\n" not in cause
    assert dist._cause(ValueError("bad\nvalue")) == "ValueError: bad"
