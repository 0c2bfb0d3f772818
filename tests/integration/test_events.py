"""A run folder's trace: events.jsonl (start with the world's layout, restart, membership change, stragglers, end)
and manifest.json (versions, git commit, the dataset's fingerprint, the arguments).

The runs are tiny (8 images of 64 px, scale n, one process); one run of 2 epochs is shared, its checkpoint of
epoch 1 then resumed as the e2e resume test does. Old events.jsonl and manifest.json files are read back, so they
are hostile input here: symlinks, FIFOs, garbage, huge files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from _processes import one_thread  # noqa: F401 (a fixture)

from detrain import Model
from detrain.data.synthetic import generate_shapes
from detrain.distributed.world_layout import membership_change
from detrain.engine.telemetry import events as events_mod
from detrain.engine.telemetry.events import EventLog
from detrain.engine.telemetry.manifest import (
    build_manifest,
    code_identity,
    dataset_fingerprint,
    git_commit,
    read_manifest,
    same_kind,
    split_fingerprint,
    write_start,
)
from detrain.engine.telemetry.run_trace import RunTrace, ended
from detrain.engine.train.trainer import Trainer
from detrain.weights.hub import file_sha256

REPO = Path(__file__).resolve().parents[2]
TINY = dict(
    epochs=2,
    imgsz=64,
    batch=8,
    device="cpu",
    workers=0,
    close_mosaic=0,
    plots=False,
    verbose=False,
    exist_ok=True,
    name="run",
)


pytestmark = pytest.mark.usefixtures("one_thread")


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def _manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_shapes(tmp_path_factory.mktemp("ev") / "shapes", n_train=8, n_val=2, imgsz=64, seed=0) / "data.yaml"


@pytest.fixture(scope="module")
def first_run(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    project = tmp_path_factory.mktemp("first")
    return Path(Model("n.yaml").train(data=str(data), project=str(project), save_period=1, **TINY).save_dir)


# ------------------------------------------------------------------ a run from start to end


def test_a_run_records_its_start_layout_and_completed_end(first_run: Path) -> None:
    events = _events(first_run)
    assert [e["kind"] for e in events] == ["start", "end"]
    start, end = events
    assert (start["world_size"], start["epochs"], start["first_epoch"]) == (1, 2, 1)
    assert start["world"] == [
        {
            "rank": 0,
            "local_rank": 0,
            "host": socket.gethostname(),
            "device": "cpu",
            "pid": start["world"][0]["pid"],
            "launcher_pid": os.getppid(),
            "node": 0,
        }
    ]
    assert (end["status"], end["epoch"]) == ("completed", 2) and "error" not in end
    # what the run delivered, checkable against any copy, and its final numbers
    weights = first_run / "weights"
    assert end["weights"] == {name: file_sha256(weights / name) for name in ("best.pt", "last.pt")}
    assert set(end["metrics"]) >= {"map", "map50", "precision", "recall"}
    assert all(isinstance(v, float) for v in end["metrics"].values())
    assert all(isinstance(e["time"], str) and e["time"].endswith("+00:00") for e in events)
    assert (first_run / "events.jsonl").read_text().endswith("\n")  # whole lines only


def test_the_manifest_names_versions_commit_dataset_and_arguments(first_run: Path, data: Path) -> None:
    m = _manifest(first_run)
    assert m["detrain"] == __import__("detrain").__version__
    assert m["versions"]["torch"] == torch.__version__ and m["versions"]["python"]
    assert m["args"]["epochs"] == 2 and m["args"]["data"] == str(data) and m["args"]["save_period"] == 1
    assert (m["restarts"], m["resumed_from"]) == (0, None)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0 and Path(__import__("detrain").__file__).resolve().parent.parent == REPO:
        assert m["git"]["commit"] == head.stdout.strip()
    root = data.parent
    images = [str(p) for p in (root / "images").rglob("*") if p.is_file()]
    assert m["dataset"]["files"] == 2 * len(images)  # every image and its label file, train and val
    assert m["dataset"]["fingerprint"] == dataset_fingerprint(root, images)["fingerprint"]
    assert m["weights"] is None  # started from n.yaml: no weights file
    assert m["code"] == code_identity() and len(m["code"]["sha256"]) == 64  # with or without git


def test_the_code_identity_is_the_installed_files_and_nothing_else(tmp_path: Path) -> None:
    """Two installs of the same source (a checkout, a copy such as ``pip install .`` makes) give one hash; an
    edited file, an added one or a renamed one another; compiled caches do not count."""
    package = Path(__import__("detrain").__file__).parent
    a, b = tmp_path / "a" / "detrain", tmp_path / "b" / "detrain"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(package, a, ignore=ignore)
    shutil.copytree(package, b, ignore=ignore)
    one = code_identity.__wrapped__(str(a))
    assert one == code_identity.__wrapped__(str(b)) == code_identity.__wrapped__(str(package))
    (b / "__pycache__").mkdir(exist_ok=True)
    (b / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"cache")
    assert code_identity.__wrapped__(str(b)) == one
    with open(b / "log.py", "a") as f:
        f.write("# edited\n")
    assert code_identity.__wrapped__(str(b))["sha256"] != one["sha256"]
    (b / "log.py").rename(b / "log2.py")
    assert code_identity.__wrapped__(str(b))["sha256"] != one["sha256"]


def test_the_content_fingerprint_sees_an_edit_that_keeps_the_size(tmp_path: Path) -> None:
    root = tmp_path / "set"
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    images = [str(root / "images" / "a.jpg")]
    Path(images[0]).write_bytes(b"x" * 10)
    (root / "labels" / "a.txt").write_text("0 0.5 0.5 0.1 0.1\n")
    first = dataset_fingerprint(root, images, content=True)
    assert first["fingerprint"].startswith("content-sha256:") and (first["files"], first["bytes"]) == (2, 28)
    assert first["fingerprint"].split(":")[1] != dataset_fingerprint(root, images)["fingerprint"].split(":")[1]
    (root / "labels" / "a.txt").write_text("1 0.5 0.5 0.1 0.1\n")  # same size, other class: seen by reading
    edited = dataset_fingerprint(root, images, content=True)
    assert edited["fingerprint"] != first["fingerprint"]
    os.unlink(images[0])
    os.mkfifo(images[0])  # a FIFO where an image was: hashed as unreadable, never waited on
    assert dataset_fingerprint(root, images, content=True)["fingerprint"] != edited["fingerprint"]
    assert not same_kind(first["fingerprint"], dataset_fingerprint(root, images)["fingerprint"])


def test_the_manifest_records_the_starting_weights_with_their_sha256(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DETRAIN_WEIGHTS_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "yolov8n.pt").write_bytes(b"release bytes")  # a release name found in the cache
    (tmp_path / "mine.pt").write_bytes(b"my weights")
    weights = build_manifest({"model": "n.pt", "pretrained": "mine.pt"}, None)["weights"]
    assert weights["model"] == {
        "name": "n.pt",
        "path": str(tmp_path / "cache" / "yolov8n.pt"),
        "sha256": hashlib.sha256(b"release bytes").hexdigest(),
        "bytes": 13,
    }
    assert weights["pretrained"]["sha256"] == hashlib.sha256(b"my weights").hexdigest()
    assert build_manifest({"model": "gone.pt", "pretrained": True}, None)["weights"] == {
        "model": {"name": "gone.pt", "path": None, "sha256": None, "bytes": None}
    }
    assert build_manifest({"model": "s.yaml", "pretrained": False}, None)["weights"] is None


def test_the_fingerprint_follows_file_sizes_not_contents(tmp_path: Path) -> None:
    root = tmp_path / "set"
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    images = []
    for name in ("a", "b"):
        (root / "images" / f"{name}.jpg").write_bytes(b"x" * 10)
        (root / "labels" / f"{name}.txt").write_text("0 0.5 0.5 0.1 0.1\n")
        images.append(str(root / "images" / f"{name}.jpg"))
    first = dataset_fingerprint(root, images)
    assert (first["files"], first["bytes"]) == (4, 2 * 10 + 2 * 18)
    assert dataset_fingerprint(root, list(reversed(images))) == first  # order of listing does not matter
    (root / "labels" / "a.txt").write_text("1 0.5 0.5 0.1 0.1\n")  # same size, other class: not seen (no reading)
    assert dataset_fingerprint(root, images) == first
    (root / "labels" / "a.txt").write_text("1 0.5 0.5 0.1 0.15\n")  # one byte more
    grown = dataset_fingerprint(root, images)
    assert grown["fingerprint"] != first["fingerprint"]
    (root / "labels" / "a.txt").unlink()  # an image without labels is a background image: one file fewer
    assert dataset_fingerprint(root, images)["files"] == 3
    (root / "images" / "b.jpg").rename(root / "images" / "c.jpg")  # listed but gone: size -1, not a crash
    assert dataset_fingerprint(root, images)["fingerprint"] != grown["fingerprint"]


# ------------------------------------------------------------------ restart, membership, failure, early stop


def _died_after_epoch_1(first_run: Path, tmp_path: Path) -> Path:
    died = tmp_path / "b" / "run"
    (died / "weights").mkdir(parents=True)
    shutil.copy(first_run / "weights" / "epoch1.pt", died / "weights" / "last.pt")
    for name in ("args.yaml", "manifest.json"):
        shutil.copy(first_run / name, died / name)
    return died


def test_a_resume_records_the_restart_and_the_world_that_changed(first_run: Path, tmp_path: Path) -> None:
    died = _died_after_epoch_1(first_run, tmp_path)
    # the attempt before ran on two hosts, one worker each (written by that attempt's rank 0 on this disk)
    earlier = {
        "time": "2026-01-01T00:00:00.000+00:00",
        "kind": "start",
        "world_size": 2,
        "epochs": 2,
        "first_epoch": 1,
        "world": [{"rank": 0, "host": "node-a"}, {"rank": 1, "host": "node-b"}],
    }
    (died / "events.jsonl").write_text(json.dumps(earlier) + "\n")
    Model("n.yaml").train(resume=str(died / "weights" / "last.pt"), device="cpu")
    events = _events(died)
    assert [e["kind"] for e in events] == ["start", "start", "restart", "membership", "end"]
    restart, change, end = events[2], events[3], events[4]
    assert restart["resumed_from"] == str(died / "weights" / "last.pt")
    assert (restart["epoch"], restart["step"], restart["launcher_restart_count"]) == (2, 1, 0)  # 1 batch an epoch
    assert "dataset_changed" not in restart
    assert change == {
        "time": change["time"],
        "kind": "membership",
        "previous_world_size": 2,
        "world_size": 1,
        "left": {"node-a": 1, "node-b": 1},
        "joined": {socket.gethostname(): 1},
        "left_nodes": [
            {"host": "node-a", "launcher_pid": None, "workers": 1},
            {"host": "node-b", "launcher_pid": None, "workers": 1},
        ],
        "joined_nodes": [{"host": socket.gethostname(), "launcher_pid": None, "workers": 1}],
    }
    assert (end["status"], end["epoch"]) == ("completed", 2)
    m = _manifest(died)
    assert (m["restarts"], m["resumed_from"]) == (1, str(died / "weights" / "last.pt"))
    assert m["created"] == _manifest(first_run)["created"]  # the run's manifest, updated, not replaced


def test_a_resume_over_changed_data_says_so(first_run: Path, data: Path, tmp_path: Path) -> None:
    died = _died_after_epoch_1(first_run, tmp_path)
    m = _manifest(died)
    m["dataset"]["fingerprint"] = "sha256:" + "0" * 64  # the files the run started with were others
    (died / "manifest.json").write_text(json.dumps(m))
    Model("n.yaml").train(resume=str(died / "weights" / "last.pt"), device="cpu")
    (restart,) = [e for e in _events(died) if e["kind"] == "restart"]
    assert restart["dataset_changed"]["from"] == "sha256:" + "0" * 64
    assert restart["dataset_changed"]["to"] == _manifest(first_run)["dataset"]["fingerprint"]


def test_a_failure_ends_with_its_error_line(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self, epoch):
        raise RuntimeError("validation exploded\nsecond line of detail")

    monkeypatch.setattr(Trainer, "_validate", broken)
    with pytest.raises(RuntimeError, match="validation exploded"):
        Model("n.yaml").train(data=str(data), project=str(tmp_path), **TINY)
    kinds = _events(tmp_path / "run")
    assert [e["kind"] for e in kinds] == ["start", "end"]
    assert kinds[-1]["status"] == "failed" and kinds[-1]["epoch"] == 1  # epoch 1's training loop ran
    assert kinds[-1]["error"] == "RuntimeError: validation exploded"


def test_patience_ends_as_stopped_early(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Trainer, "_validate", lambda self, epoch: {"fitness": 0.5})  # never improves after epoch 1
    Model("n.yaml").train(data=str(data), project=str(tmp_path), patience=1, **{**TINY, "epochs": 3})
    end = _events(tmp_path / "run")[-1]
    assert (end["kind"], end["status"], end["epoch"]) == ("end", "stopped_early", 2)


def test_ctrl_c_ends_as_interrupted(tmp_path: Path) -> None:
    class Owner:
        trace = RunTrace(tmp_path, True, epochs=3, first_epoch=0, world=[])

    Owner.trace.epoch(0, [])
    with pytest.raises(KeyboardInterrupt), ended(Owner):
        raise KeyboardInterrupt
    (end,) = _events(tmp_path)
    assert (end["status"], end["epoch"]) == ("interrupted", 1)


def test_membership_is_compared_by_launcher_and_by_host_in_older_events() -> None:
    a, b = {"host": "a", "launcher_pid": 1}, {"host": "a", "launcher_pid": 2}  # two launchers on one machine
    assert membership_change([a, b], [b, a]) is None  # the same nodes: no change to report
    assert membership_change([a, a, b], [a, b, b]) == {
        "previous_world_size": 3,
        "world_size": 3,
        "left": {},
        "joined": {},
        "left_nodes": [{"host": "a", "launcher_pid": 1, "workers": 1}],
        "joined_nodes": [{"host": "a", "launcher_pid": 2, "workers": 1}],
    }
    # an events.jsonl from before launchers were recorded: by host
    assert membership_change([{"host": "a"}, {"host": "a"}, {"host": "b"}], [a, b, b, {"host": "c"}]) == {
        "previous_world_size": 3,
        "world_size": 4,
        "left": {"b": 1},
        "joined": {"a": 1, "c": 1},
        "left_nodes": [{"host": "b", "launcher_pid": None, "workers": 1}],
        "joined_nodes": [
            {"host": "a", "launcher_pid": None, "workers": 1},
            {"host": "c", "launcher_pid": None, "workers": 1},
        ],
    }


# ------------------------------------------------------------------ hostile files in the run folder


def test_garbage_in_an_old_events_file_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    good = {"kind": "start", "world": [{"host": "x"}]}
    path.write_bytes(
        json.dumps(good).encode()
        + b"\n\xff\xfe not json\n[1, 2]\n"
        + b"[" * 100_000
        + b"\n"
        + b'"start"\n{"kind": "start"\n'
    )  # an unterminated last line (a crash mid-write elsewhere)
    assert EventLog(path).last("start") == good
    EventLog(path).write("end", status="completed")
    assert json.loads(path.read_text(errors="replace").splitlines()[-1])["kind"] == "end"


def test_only_the_tail_of_a_huge_events_file_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events_mod, "TAIL_BYTES", 1000)
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps({"kind": "start", "n": 1}) + "\n" + "x" * 5000 + "\n")
    assert EventLog(path).last("start") is None  # beyond the window: as if absent
    with open(path, "a") as f:
        f.write(json.dumps({"kind": "start", "n": 2}) + "\n")
    assert EventLog(path).last("start")["n"] == 2


def test_a_symlink_in_place_of_events_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.txt"
    target.write_text("precious\n")
    (tmp_path / "events.jsonl").symlink_to(target)
    log = EventLog(tmp_path / "events.jsonl")
    assert log.last("start") is None
    log.write("start", world_size=1)
    log.write("end", status="completed")
    assert target.read_text() == "precious\n" and not log.enabled


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
def test_a_fifo_in_place_of_events_neither_blocks_nor_is_written(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "events.jsonl")
    log = EventLog(tmp_path / "events.jsonl")
    assert log.last("start") is None  # a blocking open would hang here
    log.write("start", world_size=1)
    assert not log.enabled


def test_values_json_cannot_hold_are_written_as_null(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl")
    log.write("straggler", ms_per_step=float("nan"), others=[float("inf"), 1.0])
    line = (tmp_path / "events.jsonl").read_text()
    assert json.loads(line)["ms_per_step"] is None and "NaN" not in line and json.loads(line)["others"] == [None, 1.0]


@pytest.mark.parametrize(
    "content",
    [b"not json", b"[1, 2]", b"{" * 100_000, b'{"restarts": "many"}'],
    ids=["text", "a list", "nested too deep", "a count that is not one"],
)
def test_an_unreadable_old_manifest_gives_way_to_a_fresh_one(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "manifest.json"
    path.write_bytes(content)
    m = write_start(path, {"epochs": 3}, None, restarted=True, launcher_restarts=2, resumed_from="last.pt")
    assert (m["restarts"], m["launcher_restart_count"], m["resumed_from"]) == (1, 2, "last.pt")
    assert json.loads(path.read_text()).get("args") in ({"epochs": 3}, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]  # no temporary left behind


def test_an_old_manifest_too_large_or_a_symlink_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "big.json").write_text(json.dumps({"pad": "x" * (2 << 20)}))
    assert read_manifest(tmp_path / "big.json") is None
    (tmp_path / "real.json").write_text(json.dumps({"restarts": 4}))
    assert read_manifest(tmp_path / "real.json") == {"restarts": 4}
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    assert read_manifest(tmp_path / "link.json") is None
    write_start(tmp_path / "link.json", {}, None, restarted=False, launcher_restarts=0, resumed_from=None)
    assert not (tmp_path / "link.json").is_symlink()  # replaced by a file; the link's target is left alone
    assert json.loads((tmp_path / "real.json").read_text()) == {"restarts": 4}


def test_git_commit_only_for_detrains_own_checkout(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    assert git_commit(tmp_path / "detrain") is None  # not a checkout at all
    outer = tmp_path / "project"
    (outer / "venv" / "site-packages" / "detrain").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    # a package installed deep inside another project's repository is not that project's commit
    assert git_commit(outer / "venv" / "site-packages" / "detrain") is None
    checkout = tmp_path / "checkout"
    (checkout / "detrain").mkdir(parents=True)
    (checkout / "detrain" / "x.py").write_text("")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert git_commit(checkout / "detrain") == {"commit": head, "dirty": False}
    (checkout / "detrain" / "x.py").write_text("changed")
    assert git_commit(checkout / "detrain") == {"commit": head, "dirty": True}


def test_split_fingerprint_covers_train_val_and_a_coco_json(tmp_path: Path) -> None:
    class Info:
        yaml_file, root = tmp_path / "d.yaml", tmp_path
        train: ClassVar[list[str]] = [str(tmp_path / "images" / "t.jpg")]
        val: ClassVar[list[str]] = [str(tmp_path / "images" / "v.jpg")]
        coco_json: ClassVar[dict[str, str]] = {"val": str(tmp_path / "instances_val.json")}

    class Split:
        def __init__(self, split: str) -> None:
            self.info, self.split = Info, split

    (tmp_path / "images").mkdir()
    for p in (*Info.train, *Info.val, Info.coco_json["val"]):
        Path(p).write_bytes(b"12345")
    fp = split_fingerprint([Split("train"), Split("val")])
    assert (fp["yaml"], fp["files"], fp["bytes"]) == (str(tmp_path / "d.yaml"), 3, 15)


def test_fingerprint_content_reaches_the_manifest_and_a_switch_of_kind_is_no_data_change(tmp_path: Path) -> None:
    from detrain.config.cfg import make_cfg

    class Info:
        yaml_file, root = tmp_path / "d.yaml", tmp_path
        train: ClassVar[list[str]] = [str(tmp_path / "images" / "t.jpg")]
        val: ClassVar[list[str]] = [str(tmp_path / "images" / "v.jpg")]
        coco_json = None

    class Split:
        def __init__(self, split: str) -> None:
            self.info, self.split = Info, split

    (tmp_path / "images").mkdir()
    for p in (*Info.train, *Info.val):
        Path(p).write_bytes(b"12345")
    splits = [Split("train"), Split("val")]
    run = tmp_path / "run"
    run.mkdir()
    RunTrace(run, True, epochs=3, first_epoch=0, world=[]).record_start(
        make_cfg({"fingerprint": "content"}, "train"), 0, None, splits
    )
    assert _manifest(run)["dataset"]["fingerprint"].startswith("content-sha256:")
    RunTrace(run, True, epochs=3, first_epoch=1, world=[]).record_start(
        make_cfg({}, "train"), 4, str(run / "last.pt"), splits
    )  # resumed with the default fingerprint: another kind, not another dataset
    restart = next(e for e in _events(run) if e["kind"] == "restart")
    assert "dataset_changed" not in restart
