"""Restarts that cannot help (detrain.distributed.launch.restart_policy), nodes that differ
(detrain.distributed.launch.node_consistency) and a SLURM job preempted again and again at one checkpoint
(detrain.distributed.launch.slurm.requeue_unless_stuck), without processes: the verdicts from their records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from detrain.config.cfg import make_cfg
from detrain.distributed.launch import node_consistency, restart_policy, slurm
from detrain.distributed.world import World
from detrain.engine.train.shared_settings import shared_settings
from detrain.errors import ConfigError, DistributedError

CRASH = ["CheckpointError: could not save weights/last.pt: [Errno 5] injected failure"]


def _attempt(point: list[int] | None, failure: list[str] | None = None) -> dict:
    return {"point": point, "failure": failure or []}


# ------------------------------------------------------------------ the same failure, no progress


def test_a_restart_that_resumed_where_the_failure_before_it_left_and_failed_alike_stops_the_run() -> None:
    history = [_attempt(None, CRASH), _attempt([1, 0], CRASH), _attempt([1, 0])]
    assert restart_policy.repeated_without_progress(history, 2) == (
        f"the same failure repeated 2 times with no progress since epoch 2 batch 0: {CRASH[0]}"
    )


@pytest.mark.parametrize(
    "history",
    [
        [_attempt(None, CRASH), _attempt([1, 0], CRASH), _attempt([2, 0])],  # the restart saved an epoch: progress
        [_attempt(None, CRASH), _attempt([1, 0], ["RuntimeError: other"]), _attempt([1, 0])],  # another failure
        [_attempt(None, []), _attempt(None, []), _attempt(None)],  # killed, no line: never the same failure
        [_attempt(None, CRASH), _attempt([1, 0])],  # one failure is no repeat
        [_attempt([1, 3], CRASH), _attempt([1, 3], CRASH), _attempt([1, 4])],  # a mid.pt further on
    ],
)
def test_progress_another_failure_or_an_unknown_one_restart_as_before(history: list[dict]) -> None:
    assert restart_policy.repeated_without_progress(history, 2) is None


def test_three_alike_are_needed_when_the_key_says_three_and_zero_never_stops() -> None:
    two = [_attempt([1, 0], CRASH), _attempt([1, 0], CRASH), _attempt([1, 0])]
    assert restart_policy.repeated_without_progress(two, 3) is None
    three = [_attempt(None, CRASH), *two]
    assert restart_policy.repeated_without_progress(three, 3) is not None
    assert restart_policy.repeated_without_progress(three, 0) is None
    with pytest.raises(ConfigError, match="restart_same_failures"):
        make_cfg({"restart_same_failures": 1})


def test_the_history_is_kept_by_rank_0_from_the_notes_each_failing_rank_left(tmp_path: Path, monkeypatch) -> None:
    """Each attempt's start is recorded with the failure of the one before it, read from the ranks' notes (a rank
    that only saw a peer go is left out), and the third start stops."""
    monkeypatch.setenv(restart_policy.ATTEMPTS_ENV, str(tmp_path))
    verdicts = []
    for attempt, point in enumerate([None, (1, 0), (1, 0)]):
        world = World(rank=0, world_size=1, launcher="detrain", restart_count=attempt)
        try:
            restart_policy.check_progress(world, point, 2)
            verdicts.append(None)
        except restart_policy.AgreedStop as e:
            verdicts.append(str(e))
        for rank, (error, consequence) in enumerate([(OSError(5, "injected"), False), (RuntimeError("lost"), True)]):
            restart_policy.note_failure(World(rank=rank, restart_count=attempt, launcher="detrain"), error, consequence)
    assert verdicts[:2] == [None, None]
    assert (
        verdicts[2]
        == "the same failure repeated 2 times with no progress since epoch 2 batch 0: OSError: [Errno 5] injected"
    )
    history = json.loads((tmp_path / "history.json").read_text())
    assert [a["point"] for a in history] == [None, [1, 0], [1, 0]]
    assert history[0]["failure"] == ["OSError: [Errno 5] injected"]


def test_an_agreed_stop_is_returned_under_detrains_launcher_and_raised_elsewhere() -> None:
    stop = restart_policy.AgreedStop("nodes differ")
    result = restart_policy.stopped(stop, World(launcher="detrain"))
    assert result == restart_policy.Stopped("nodes differ")
    with pytest.raises(DistributedError, match=r"^nodes differ$"):
        restart_policy.raise_if_stopped([{"metrics": 1}, result])
    with pytest.raises(restart_policy.AgreedStop):
        restart_policy.stopped(stop, World(launcher="torchrun"))
    assert restart_policy.finished({"done": True}) == {"done": True}


# ------------------------------------------------------------------ the pause before a restart


def test_the_pause_doubles_from_the_base_up_to_the_cap_and_stays_below_half_the_dist_timeout(monkeypatch) -> None:
    assert [restart_policy.backoff_s(k, 0.5, 3.0) for k in range(6)] == [0.0, 0.5, 1.0, 2.0, 3.0, 3.0]
    assert restart_policy.backoff_s(3, 0.0, 60.0) == 0.0
    slept: list[float] = []
    monkeypatch.setattr(restart_policy.time, "sleep", slept.append)
    for k in range(4):
        restart_policy.pause_before_restart(World(restart_count=k), 10.0, 60.0, dist_timeout_s=30.0)
    assert slept == [10.0, 15.0, 15.0]


# ------------------------------------------------------------------ nodes that differ

NODE = {
    "detrain": "0.1.0",
    "torch": "2.4.0",
    "code": "c0de",
    "devices per node": 2,
    "train images": 16,
    "val images": 2,
    "dataset files": "sha256:aa",
}


@pytest.mark.parametrize(
    ("key", "theirs", "shown"),
    [
        ("detrain", "0.2.0", "detrain '0.2.0' there, '0.1.0' on node 0"),
        ("torch", "2.5.0", "torch '2.5.0' there, '2.4.0' on node 0"),
        ("code", "beef", "code 'beef' there, 'c0de' on node 0"),
        ("train images", 15, "train images 15 there, 16 on node 0"),
        ("dataset files", "sha256:bb", "dataset files 'sha256:bb' there, 'sha256:aa' on node 0"),
    ],
)
def test_the_first_node_that_differs_is_named_with_its_key_and_both_values(
    key: str, theirs: object, shown: str
) -> None:
    records = [(0, "a", NODE), (1, "b", NODE), (2, "c", {**NODE, key: theirs})]
    assert node_consistency.first_difference(records, elastic=False) == (
        f"node_rank=2 (host c) differs from node 0 (host a): {shown}"
    )


def test_devices_per_node_may_differ_unless_the_nodes_are_elastic() -> None:
    records = [(0, "a", NODE), (1, "b", {**NODE, "devices per node": 1})]
    assert node_consistency.first_difference(records, elastic=False) is None
    assert node_consistency.first_difference(records, elastic=True) == (
        "node_rank=1 (host b) differs from node 0 (host a): devices per node 1 there, 2 on node 0"
    )


def test_the_code_hash_changes_with_any_source_file(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    before = node_consistency.code_hash(str(tmp_path / "pkg"))
    node_consistency.code_hash.cache_clear()
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert node_consistency.code_hash(str(tmp_path / "pkg")) != before
    node_consistency.code_hash.cache_clear()


# ------------------------------------------------------------------ SLURM requeues


def test_a_job_preempted_again_at_the_same_checkpoint_is_requeued_at_most_the_limit(
    tmp_path: Path, monkeypatch
) -> None:
    requeued: list[str] = []
    monkeypatch.setattr(slurm, "requeue", lambda job: requeued.append(job) or f"requeued SLURM job {job}")
    said = [slurm.requeue_unless_stuck("42", tmp_path, "epoch 2, 1/4 batches done", 2) for _ in range(3)]
    assert said[:2] == ["requeued SLURM job 42"] * 2 and requeued == ["42", "42"]
    assert said[2].startswith(
        "not requeued: SLURM job 42 was requeued 2 times in a row with no progress since epoch 2, 1/4 batches done"
    )
    # a preemption further on starts the count again, as does 0 (no limit)
    assert slurm.requeue_unless_stuck("42", tmp_path, "epoch 3", 2) == "requeued SLURM job 42"
    assert json.loads((tmp_path / slurm.REQUEUES_FILE).read_text()) == {"job": "42", "point": "epoch 3", "count": 1}
    assert all(slurm.requeue_unless_stuck("42", tmp_path, "epoch 3", 0).startswith("requeued") for _ in range(4))


def test_a_node_started_with_other_arguments_is_named_with_the_first_that_differs() -> None:
    ours = shared_settings(make_cfg({"data": "coco8.yaml", "device": "0,1", "project": "a"}))
    # its own paths, devices and run folder may differ; parallel= may not (other collectives), nor epochs
    alike = shared_settings(make_cfg({"data": "/mnt/coco8.yaml", "device": "0", "project": "b", "workers": 2}))
    theirs = shared_settings(make_cfg({"parallel": "fsdp", "epochs": 3}))
    records = [(0, "a", {**NODE, "settings": ours}), (1, "b", {**NODE, "settings": alike})]
    assert node_consistency.first_difference(records, elastic=False) is None
    records.append((2, "c", {**NODE, "settings": theirs}))
    assert node_consistency.first_difference(records, elastic=False) == (
        "node_rank=2 (host c) differs from node 0 (host a): epochs=3 there, epochs=100 on node 0"
    )
