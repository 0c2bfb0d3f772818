"""Every skipped or corrected file is reported with its reason: on screen, the count per reason and the first files
with theirs (a handful of lines however large the dataset); in the run folder, every message in
``labels_<split>.txt``; a split without any labels is a warning line; a split left without images says why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from detrain.config.cfg import make_cfg
from detrain.data.labels.reasons import SHOWN_FILES, SHOWN_REASONS, reason_lines
from detrain.data.labels.record import LabelReport
from detrain.data.labels.report_file import write_label_reports
from detrain.data.prepare import load_split
from detrain.data.synthetic import generate_shapes
from detrain.distributed.world import World
from detrain.errors import DatasetError

pytestmark = pytest.mark.unit

OUT_OF_RANGE = "line 1: class id 23 out of range for nc=3 (valid 0-2); image skipped"


def _shapes(root: Path, n_train: int = 5) -> Path:
    generate_shapes(root, n_train=n_train, n_val=2, imgsz=64, seed=1)
    return root / "data.yaml"


@pytest.fixture
def bad(tmp_path: Path) -> dict[str, str]:
    """The shapes set with one corrupt image and one label of a class id beyond nc=3 in its train split."""
    yaml_file = _shapes(tmp_path / "bad")
    images = sorted((tmp_path / "bad" / "images" / "train").iterdir())
    images[0].write_bytes(b"not an image at all")
    label = tmp_path / "bad" / "labels" / "train" / f"{images[1].stem}.txt"
    label.write_text("23 0.5 0.5 0.2 0.2\n")
    return {"yaml": str(yaml_file), "image": str(images[0]), "label": str(label)}


@pytest.fixture
def unlabelled(tmp_path: Path) -> dict[str, str]:
    """The shapes set without its labels/ folder."""
    yaml_file = _shapes(tmp_path / "unlabelled")
    shutil.rmtree(tmp_path / "unlabelled" / "labels")
    return {"yaml": str(yaml_file), "labels": str(tmp_path / "unlabelled" / "labels" / "train")}


def test_each_reason_is_on_screen_with_its_file(bad: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    data = load_split(bad["yaml"], "train")
    out = capsys.readouterr().out
    assert "train: 2 files skipped or corrected (every one in labels_train.txt in the run folder):" in out
    assert "  1 x class id out of range for nc=3; image skipped\n" in out
    assert "  1 x not a readable image" in out
    # the wrong class id names the file, the class id and the valid range
    assert f"    {bad['label']}: {OUT_OF_RANGE}\n" in out
    assert f"    {bad['image']}: not a readable image" in out
    assert data.report.corrupt == 2 and len(data.records) == 3
    # read back from the label cache, the same lines (without the verification's progress bar)
    again = load_split(bad["yaml"], "train")
    assert again.report.from_cache and capsys.readouterr().out.strip() == out.strip()


def test_run_folder_file_holds_every_message(bad: dict[str, str], tmp_path: Path) -> None:
    """``detrain val`` (here scoring an empty predictions file on the train split) writes labels_train.txt into its
    run folder; the trainer's call writes one file per split."""
    from detrain.engine.evaluate.val_worker import run_val

    predictions = tmp_path / "predictions.json"
    predictions.write_text("[]")
    cfg = make_cfg(
        {
            "data": bad["yaml"],
            "split": "train",
            "predictions": str(predictions),
            "project": str(tmp_path / "runs"),
            "plots": False,
            "verbose": False,
            "workers": 0,
        }
    )
    save_dir = Path(run_val(cfg, World(device="cpu"))["save_dir"])
    lines = (save_dir / "labels_train.txt").read_text().splitlines()
    assert f"{bad['label']}: {OUT_OF_RANGE}" in lines
    assert any(line.startswith(f"{bad['image']}: not a readable image") for line in lines)
    assert len(lines) == 2

    train, val = load_split(bad["yaml"], "train", verbose=False), load_split(bad["yaml"], "val", verbose=False)
    written = write_label_reports(tmp_path / "run", train, val)
    assert [p.name for p in written] == ["labels_train.txt", "labels_val.txt"]
    assert written[0].read_text().splitlines() == train.report.messages
    assert written[1].read_text() == ""  # nothing to report: an empty file, none of an earlier run left
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["labels_train.txt", "labels_val.txt"]


def test_no_labels_folder_is_a_warning_line(
    unlabelled: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = load_split(unlabelled["yaml"], "train")
    out = capsys.readouterr().out
    warning = (
        f"warning: no labels found for any of the 5 'train' images (looked in {unlabelled['labels']}): "
        "training on backgrounds only\n"
    )
    assert warning in out
    assert len(data.records) == 5 and data.report.missing == 5
    (path,) = write_label_reports(tmp_path / "run", data)
    assert "training on backgrounds only" in path.read_text()


def test_no_usable_images_names_the_reason_and_the_first_file(tmp_path: Path) -> None:
    yaml_file = _shapes(tmp_path / "ds", n_train=3)
    labels = sorted((tmp_path / "ds" / "labels" / "train").iterdir())
    for label in labels:
        label.write_text("23 0.5 0.5 0.2 0.2\n")
    with pytest.raises(DatasetError) as e:
        load_split(str(yaml_file), "train", verbose=False)
    assert str(e.value) == (
        f"{yaml_file}: no usable images in the 'train' split: 3 of 3 images skipped, 3 x class id out of range for "
        f"nc=3; first: {labels[0]}: line 1: class id 23 out of range for nc=3 (valid 0-2)"
    )


def test_screen_stays_a_handful_of_lines_for_any_number_of_files() -> None:
    report = LabelReport(total=100_000, found=80_000, corrupt=20_000)
    reasons = [
        "line {k}: class id {k} out of range for nc=2 (valid 0-1); image skipped",
        "line 1: {k} columns; expected 5 (class x_center y_center width height) or a polygon; image skipped",
        "{k} duplicate row(s) removed",
        "line 2: coordinate {k}.5 outside [0, 1] (boxes are normalised x_center y_center width height); image skipped",
        "line 3: negative width -0.{k}; image skipped",
        "not a readable image (OpenCV cannot decode it); image skipped",
    ]
    for k in range(20_000):
        file = f"d/labels/train/{k}.txt"
        report.add(f"{file}: {reasons[k % len(reasons)].format(k=k + 7)}", file)
    lines = reason_lines(report, "train")
    assert len(lines) == 1 + SHOWN_REASONS + 1 + SHOWN_FILES
    assert lines[0] == "train: 20000 files skipped or corrected (every one in labels_train.txt in the run folder):"
    assert lines[1] == "  3334 x class id out of range for nc=2; image skipped"
    assert lines[SHOWN_REASONS] == "  9999 x 3 other reasons"  # 6 reasons: the 3 most common, then the rest
    assert lines[SHOWN_REASONS + 1] == "  first 5 of 20000:"
    assert lines[-1] == "    d/labels/train/4.txt: line 3: negative width -0.11; image skipped"


def test_the_reason_of_a_file_whose_name_holds_a_colon(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    yaml_file = _shapes(tmp_path / "a: b", n_train=2)
    label = sorted((tmp_path / "a: b" / "labels" / "train").iterdir())[0]
    label.write_text("23 0.5 0.5 0.2 0.2\n")
    load_split(str(yaml_file), "train")
    out = capsys.readouterr().out
    assert "  1 x class id out of range for nc=3; image skipped\n" in out
    assert f"    {label}: {OUT_OF_RANGE}\n" in out


def test_a_coco_json_split_has_no_missing_labels_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A split given as a COCO json takes its boxes from the json: its images have no label files, and that is no
    warning (nor a line in the run folder's file)."""
    yaml_file = _shapes(tmp_path / "ds", n_train=2)
    root = tmp_path / "ds"
    images = sorted((root / "images" / "val").iterdir())
    coco = {
        "images": [{"id": k + 1, "file_name": p.name, "width": 64, "height": 64} for k, p in enumerate(images)],
        "annotations": [],
        "categories": [{"id": k + 1, "name": n} for k, n in enumerate(["circle", "rectangle", "triangle"])],
    }
    (root / "val.json").write_text(json.dumps(coco))
    shutil.rmtree(root / "labels" / "val")
    yaml_file.write_text(yaml_file.read_text().replace("val: images/val", "val: val.json"))
    data = load_split(str(yaml_file), "val")
    out = capsys.readouterr().out
    assert "warning" not in out and data.report.messages == []
