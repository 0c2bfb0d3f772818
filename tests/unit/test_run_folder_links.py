"""Run folders never write through a planted symbolic link (issue 25, item 3).

In a reused run folder (``exist_ok=True``) ten plot files followed links planted at their names and overwrote
files outside the folder, and a ``weights/`` folder that was a link received the checkpoints. Now every file goes
through a temporary file renamed over its name (a link there is replaced, never followed), its folder is entered
with ``O_NOFOLLOW``, and a run folder or ``weights/`` that is a link, or another user's, is refused in one line.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from detrain.config.keys import Output
from detrain.engine.build import agree_run_dir, check_output_folder, run_dir_problem
from detrain.errors import ConfigError
from detrain.log import atomic_write_bytes, atomic_write_text
from detrain.metrics import ConfusionMatrix, coco_summary
from detrain.plots import val as plots_val
from detrain.system.tempfiles import UnsafePath, folder_problem
from detrain.weights.checkpoint import save_checkpoint

PLOTS = [
    "PR_curve.png",
    "F1_curve.png",
    "P_curve.png",
    "R_curve.png",
    "confusion_matrix.png",
    "confusion_matrix_normalized.png",
    "results.png",
    "train_batch0.jpg",
    "val_batch0_labels.jpg",
    "val_batch0_pred.jpg",
]


def _victims(tmp_path: Path, run: Path, names: list[str]) -> dict[str, Path]:
    """A file outside the run folder for each name, and a link to it planted at that name in the run folder."""
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    victims = {}
    for name in names:
        victim = outside / f"victim-{name}"
        victim.write_text("precious\n")
        (run / name).symlink_to(victim)
        victims[name] = victim
    return victims


def test_the_ten_plot_files_replace_planted_links_never_follow_them(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "train" / "exp"
    run.mkdir(parents=True)
    victims = _victims(tmp_path, run, PLOTS)
    (run / "results.csv").write_text("epoch,train/box_loss\n1,1.5\n2,1.2\n")
    plots_val.plot_all(run, coco_summary([], nc=1), ConfusionMatrix(1).matrix, {0: "cat"})
    plots_val.plot_results_csv(run / "results.csv")
    imgs, boxes = np.zeros((1, 3, 32, 32), np.uint8), [(np.array([[2.0, 2, 20, 20]]), np.array([0]), None)]
    for name in ("train_batch0.jpg", "val_batch0_labels.jpg", "val_batch0_pred.jpg"):
        plots_val.plot_images(imgs, boxes, ["cat"], run / name)
    for name, victim in victims.items():
        assert victim.read_text() == "precious\n", f"{name} wrote through its link"
        assert not (run / name).is_symlink() and (run / name).stat().st_size > 100, name
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []  # no temporary file left


def test_a_weights_folder_that_is_a_link_receives_no_checkpoint(tmp_path: Path) -> None:
    run, elsewhere = tmp_path / "exp", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    (run / "weights").symlink_to(elsewhere)
    with pytest.raises(UnsafePath, match="weights' is a symbolic link"):
        save_checkpoint({"epoch": 1}, run / "weights" / "last.pt")
    assert list(elsewhere.iterdir()) == []
    problem = run_dir_problem(run)
    assert problem is not None and "weights' is a symbolic link" in problem and "\n" not in problem


def test_a_run_folder_that_is_a_link_is_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    Path("runs/train").mkdir(parents=True)
    Path("runs/train/exp").symlink_to(tmp_path / "elsewhere")
    output = Output(exist_ok=True)
    with pytest.raises(ConfigError, match=r"run folder refused: 'runs/train/exp' is a symbolic link") as e:
        agree_run_dir(output, "train", None, is_main=True)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        check_output_folder("", "train", output)  # preflight: before any process starts
    check_output_folder("", "train", Output(exist_ok=False))  # a new folder (exp2) will be made: fine


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_another_users_run_folder_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "exp"
    run.mkdir()
    os.chown(run, 12345, 12345)
    problem = run_dir_problem(run)
    assert problem is not None and "belongs to another user (uid 12345)" in problem


def test_predict_outputs_never_go_through_a_link_below_the_run_folder(tmp_path: Path) -> None:
    """Predict writes ``labels/<rel>.txt`` and images at their source's relative path: a link planted at any
    folder on the way is refused, a link at the file's own name is replaced."""
    run, elsewhere = tmp_path / "predict", tmp_path / "elsewhere"
    (run / "labels").mkdir(parents=True)
    elsewhere.mkdir()
    (run / "labels" / "sub").symlink_to(elsewhere)
    with pytest.raises(UnsafePath, match="sub' is a symbolic link"):
        atomic_write_text(run / "labels" / "sub" / "deeper" / "a.txt", "0 0.5 0.5 0.1 0.1\n", root=run)
    assert list(elsewhere.iterdir()) == []
    victim = elsewhere / "victim.jpg"
    victim.write_bytes(b"precious")
    (run / "a.jpg").symlink_to(victim)
    atomic_write_bytes(run / "a.jpg", b"drawn", root=run)
    assert victim.read_bytes() == b"precious" and (run / "a.jpg").read_bytes() == b"drawn"
    assert folder_problem(run / "a.jpg") == f"'{run / 'a.jpg'}' is not a folder"


def test_an_export_into_a_linked_folder_is_one_line(tmp_path: Path) -> None:
    from detrain.engine import export
    from detrain.errors import DetrainError

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DetrainError, match=r"cannot write the export .*out' is a symbolic link"):  # noqa: SIM117
        with export._atomic_file(tmp_path / "out" / "model.onnx"):
            pass
    assert list((tmp_path / "elsewhere").iterdir()) == []
