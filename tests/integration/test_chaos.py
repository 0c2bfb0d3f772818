"""scripts/chaos.py's fault matrix, each case at its smallest size (``chaos.SMALL``: 3 epochs of 16 images at 64 px,
scale n, dist_timeout=10): a worker killed on node 1, a node leaving and one joining an elastic group, a stopped
rank, a SIGTERMed node 0 launcher, a busy port, an unreachable master, a preempted node 0, and two nodes on their
own networks whose cable is cut for 20 s.

Two cases of the script are left to it, to keep CI's time: f (a kill right after mid.pt; the stronger bitwise
check of the same fault on two workers is tests/integration/test_resume_every_node.py's) and k (a cable cut for
good: node 0 goes on as in b, and the lost node's one line is tests/unit/test_job_watch.py's); their measured rows
are in docs/fault_matrix.md.

Every node is a real ``detrain train`` launcher with its own folder (on 127.0.0.1, or in its own network namespace
for j: skipped where namespaces cannot be made); faults are real signals and real link cuts. The only time bounds
checked are the behaviour under test (a stopped rank: every node ends within dist_timeout + 30 s; a SIGTERM: every
process gone within 10 s); the rest run under the case's hang guard (``Size.limit_s``). Five cases spend most of
their minute waiting (the unreachable master: 60 s for the master; a node leaving, and a node 0 that starts alone
before another joins: about 30 s each of torch's c10d rendezvous waiting for more nodes; a cut cable: 20 s; a
stopped rank: dist_timeout for the heartbeat), so they start at once in threads and run beside the others.
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest
from _scripts import load_script

pytestmark = pytest.mark.integration


chaos = load_script("chaos")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chaos")


BACKGROUND = {
    "b": "test_b_a_node_whose_machine_dies_leaves_and_the_rest_finish",
    "c": "test_c_a_node_joining_mid_run_grows_the_group_which_finishes",
    "d": "test_d_a_stopped_rank_ends_every_node_with_a_line_naming_it",
    "h": "test_h_an_unreachable_master_is_one_line_before_training",
    "j": "test_j_a_network_drop_shorter_than_dist_timeout_is_ridden_out_with_no_restart",
}


@pytest.fixture(scope="module", autouse=True)
def background(request: pytest.FixtureRequest, work: Path):
    """Start the cases that mostly wait at once, each in a thread, when their test is selected; the test collects
    the result (a case kills every process it started however it ends)."""
    results: dict[str, object] = {}
    selected = {item.name for item in request.session.items}
    threads = {
        letter: threading.Thread(
            target=lambda x=letter: results.update({x: chaos.run_case(x, work, chaos.SMALL)}), daemon=True
        )
        for letter, test in BACKGROUND.items()
        if test in selected
    }
    for thread in threads.values():
        thread.start()
    yield results, threads
    for thread in threads.values():
        thread.join()


def _collected(background, letter: str):
    results, threads = background
    threads[letter].join()
    return results[letter]


def _ok(result) -> None:
    assert result.ok, f"{result.case}: {result.observed}"


def test_a_a_killed_worker_on_node_1_resumes_on_both_nodes(work: Path) -> None:
    result = chaos.run_case("a", work, chaos.SMALL)
    _ok(result)
    assert result.epochs == "1-3" and result.checkpoint == "loads (epoch 3)"


def test_b_a_node_whose_machine_dies_leaves_and_the_rest_finish(background, work: Path) -> None:
    result = _collected(background, "b")
    _ok(result)
    assert result.epochs == "1-3" and result.checkpoint == "loads (epoch 3)"
    # what node 0 recorded: the node that left, the restart that resumed, and the update size it kept
    node0 = work / "node_leaves" / "node0"
    events = [json.loads(line) for line in (node0 / "runs" / "x" / "events.jsonl").read_text().splitlines()]
    change = next(e for e in events if e["kind"] == "membership")
    assert (change["previous_world_size"], change["world_size"]) == (2, 1)
    assert [(n["host"], n["workers"]) for n in change["left_nodes"]] == [(socket.gethostname(), 1)]
    assert change["joined_nodes"] == []
    restart = next(e for e in events if e["kind"] == "restart")
    assert restart["resumed_from"] == "runs/x/weights/last.pt" and restart["epoch"] >= 2
    assert [e["world_size"] for e in events if e["kind"] == "start"] == [2, 1]
    assert events[-1]["kind"] == "end" and events[-1]["status"] == "completed"
    out = (node0 / "out.txt").read_text()
    kept = "elastic: 1 of the 2 planned workers; each keeps its batch of 4 and 2 steps of 4 images make an update"
    assert kept in out, out[-3000:]


def test_c_a_node_joining_mid_run_grows_the_group_which_finishes(background) -> None:
    result = _collected(background, "c")
    _ok(result)
    assert result.epochs == "1-3" and "group restarted: resuming from" in result.observed


def test_d_a_stopped_rank_ends_every_node_with_a_line_naming_it(background) -> None:
    result = _collected(background, "d")
    _ok(result)
    assert "rank 1 stopped responding" in result.observed


def test_e_a_sigtermed_launcher_leaves_no_process_and_a_loadable_last_pt(work: Path) -> None:
    result = chaos.run_case("e", work, chaos.SMALL)
    _ok(result)
    assert result.checkpoint.startswith("loads")


def test_i_a_preempted_node_0_saves_on_every_rank_and_both_nodes_resume_there(work: Path) -> None:
    result = chaos.run_case("i", work, chaos.SMALL)
    _ok(result)
    assert result.epochs == "1-3" and "resumed there on both nodes" in result.observed


def test_g_a_busy_master_port_is_one_line_before_training(work: Path) -> None:
    _ok(chaos.run_case("g", work, chaos.SMALL))


def test_h_an_unreachable_master_is_one_line_before_training(background) -> None:
    _ok(_collected(background, "h"))


def _ran(result) -> None:
    if getattr(result, "skipped", False):
        pytest.skip(result.observed)
    _ok(result)


def test_j_a_network_drop_shorter_than_dist_timeout_is_ridden_out_with_no_restart(background) -> None:
    """Each node in its own network namespace, the veth between them down for 20 s (packets dropped silently):
    longer than a node used to wait for node 0's store, shorter than dist_timeout."""
    result = _collected(background, "j")
    _ran(result)
    assert result.epochs == "1-3" and "no restart" in result.observed


def test_cases_are_picked_by_letter_or_name_and_anything_else_is_refused() -> None:
    assert chaos.pick("a,f") == ["a", "f"] and chaos.pick("abcdefghijk") == list("abcdefghijk")
    assert chaos.pick("worker_kill, no_master") == ["a", "h"]
    with pytest.raises(SystemExit, match="'z' is not a case"):
        chaos.pick("a,z")


def test_the_epoch_column_shows_a_run_of_each_epoch_once_or_the_rows_as_they_are() -> None:
    assert chaos.epochs_text(["1", "2", "3"]) == "1-3"
    assert chaos.epochs_text(["1", "2", "2", "3"]) == "1,2,2,3" and chaos.epochs_text([]) == "-"
    row = chaos.Result("a x", "expected | piped", "seen", ok=True, seconds=3.2)
    assert chaos.table([row]).splitlines()[-1] == "| a x | expected \\| piped | seen | yes | 3 | - | - |"
