"""scripts/bench_learning.py: the coco128 split, both tools' results.csv, the table, and a detrain-only smoke."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _scripts import load_script

bl = load_script("bench_learning")


def test_split_is_deterministic_disjoint_and_covers_the_set():
    images = [f"/d/images/train/{i:012d}.jpg" for i in range(128)]
    train, val = bl.split_images(images[::-1], 0.25, seed=0)  # input order does not matter
    assert (train, val) == bl.split_images(images, 0.25, seed=0)
    assert len(train) == 96 and len(val) == 32
    assert not set(train) & set(val) and sorted(train + val) == images
    assert train == sorted(train) and val == sorted(val)
    assert bl.split_images(images, 0.25, seed=1)[1] != val  # the seed chooses the split


@pytest.mark.skipif(not bl.SHARED_COCO128.is_file(), reason="../shared/data/coco128 is absent")
def test_coco128_split_links_images_and_labels(tmp_path):
    data = bl.prepare_coco128(tmp_path, bl.SHARED_COCO128, 0.25, seed=0)
    root = data.yaml.parent
    train = (root / "train.txt").read_text().split()
    val = (root / "val.txt").read_text().split()
    assert (data.n_train, data.n_val) == (len(train), len(val)) == (96, 32)
    assert not {Path(p).name for p in train} & {Path(p).name for p in val}
    assert all(Path(p).is_symlink() and Path(p).resolve().is_file() for p in train + val)
    labelled = [p for p in val if bl.label_of(Path(p)).exists()]
    assert labelled and all(bl.label_of(Path(p)).parent == root / "labels" / "val" for p in labelled)
    from detrain.data.dataset_yaml import load_dataset_yaml

    info = load_dataset_yaml(data.yaml, download=False)
    assert (info.train, info.val, info.nc) == (sorted(train), sorted(val), 80)


def test_results_csv_of_both_tools(tmp_path):
    ours = tmp_path / "detrain.csv"
    ours.write_text("epoch,train/box_loss,metrics/mAP50,metrics/mAP50-95\n1,1.2,0.1,0.05\n2,1.1,0.2,0.125\n")
    theirs = tmp_path / "ultralytics.csv"  # older Ultralytics pads its header and values with spaces
    theirs.write_text(
        "                  epoch,  metrics/mAP50(B),  metrics/mAP50-95(B)\n"
        "                      1,           0.1,            0.04\n"
        "                      2,           0.2,            0.1\n"
    )
    assert bl.read_results_csv(ours) == {1: 0.05, 2: 0.125}
    assert bl.read_results_csv(theirs) == {1: 0.04, 2: 0.1}
    bad = tmp_path / "bad.csv"
    bad.write_text("epoch,loss\n1,2\n")
    with pytest.raises(ValueError, match="mAP50-95"):
        bl.read_results_csv(bad)


def _run(impl: str, seed: int, maps: list[float], final: float, wall: float):
    return bl.Run(
        impl,
        seed,
        f"/runs/{impl}{seed}",
        {e + 1: m for e, m in enumerate(maps)},
        {"map": final, "map50": 2 * final, "last_map": final / 2},
        wall,
        1,
        0,
    )


def test_table_means_over_seeds_and_ratios():
    assert bl.selected_epochs(12) == [5, 10, 12] and bl.selected_epochs(10) == [5, 10]
    assert bl.selected_epochs(3, all_epochs=True) == [1, 2, 3]
    runs = {
        "detrain": [
            _run("detrain", 0, [0.1] * 4 + [0.3] * 6, 0.4, 100.0),
            _run("detrain", 1, [0.1] * 4 + [0.5] * 6, 0.6, 120.0),
        ],
        "ultralytics": [
            _run("ultralytics", 0, [0.0] * 4 + [0.2] * 6, 0.25, 200.0),
            _run("ultralytics", 1, [0.0] * 4 + [0.2] * 6, 0.25, 240.0),
        ],
    }
    s = bl.summarize(runs, bl.selected_epochs(10))
    assert s["per_epoch"]["detrain"][5] == pytest.approx(0.4)
    assert s["ratio"]["per_epoch"][10] == pytest.approx(2.0)
    assert s["final"]["detrain"]["map"] == pytest.approx(0.5)
    assert s["ratio"]["final_map"] == pytest.approx(2.0) and s["ratio"]["wall_s"] == pytest.approx(0.5)
    text = bl.render_markdown(runs, s, ["# header"])
    assert "| 10 | 0.4000 | 0.2000 | 2.00x |" in text
    assert "**0.5000** (0.400, 0.600)" in text and "**2.00x**" in text
    assert "| wall s per run | 110.0 | 220.0 | 0.50x |" in text
    assert s["ratio"]["final_last_map"] == pytest.approx(2.0) and "| last.pt mAP50-95, detrain validator |" in text


def test_a_missing_side_or_a_zero_gives_no_ratio():
    runs = {"detrain": [_run("detrain", 0, [0.1, 0.2], 0.3, 10.0)]}
    s = bl.summarize(runs, [2])
    assert s["ratio"] == {} and s["final"]["detrain"]["map"] == pytest.approx(0.3)
    assert "detrain / Ultralytics" not in bl.render_markdown(runs, s, [])
    assert bl.ratio(0.3, 0.0) is None and bl.ratio(None, 0.2) is None


def test_detrain_side_end_to_end_on_a_tiny_shapes_set(tmp_path):
    out = tmp_path / "table.md"
    report = bl.main(
        [
            "--dataset",
            "shapes",
            "--impls",
            "detrain",
            "--n-train",
            "8",
            "--n-val",
            "4",
            "--gen-imgsz",
            "64",
            "--epochs",
            "1",
            "--imgsz",
            "64",
            "--batch",
            "4",
            "--workers",
            "0",
            "--seeds",
            "0",
            "--threads",
            "1",
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ]
    )
    saved = json.loads(out.with_suffix(".json").read_text())
    (run,) = saved["runs"]["detrain"]
    assert set(run["final"]) == {"map", "map50", "last_map"} and 0.0 <= run["final"]["map"] <= 1.0
    assert 0.0 <= run["final"]["last_map"] <= 1.0
    assert run["per_epoch"].keys() == {"1"} and run["wall_s"] > 0 and not run["reused"]
    assert report["summary"]["final"]["detrain"]["map"] == run["final"]["map"]
    text = out.read_text()
    assert "best.pt mAP50-95, detrain validator" in text and "--impls detrain" in text
    assert "last.pt mAP50-95, detrain validator" in text
    # a second call with --reuse keeps the finished run and its score
    again = bl.main(
        [
            "--dataset",
            "shapes",
            "--impls",
            "detrain",
            "--n-train",
            "8",
            "--n-val",
            "4",
            "--gen-imgsz",
            "64",
            "--epochs",
            "1",
            "--imgsz",
            "64",
            "--batch",
            "4",
            "--workers",
            "0",
            "--seeds",
            "0",
            "--threads",
            "1",
            "--work",
            str(tmp_path / "work"),
            "--reuse",
        ]
    )
    assert again["runs"]["detrain"][0]["reused"] and again["runs"]["detrain"][0]["final"] == run["final"]
