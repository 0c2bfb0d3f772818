"""results.csv and atomic text files."""

from __future__ import annotations

import csv

from detrain.log import ResultsCSV, atomic_write_text, save_yaml


def test_results_csv_keeps_each_epoch_once_across_a_resume(tmp_path):
    path = tmp_path / "results.csv"
    log = ResultsCSV(path)
    for epoch in (1, 2, 3):
        log.add({"epoch": epoch, "train/box_loss": 1.0 / epoch})
    # a run that resumes after epoch 2 rewrites epoch 3 and goes on
    log = ResultsCSV(path, keep_epochs_upto=2)
    log.add({"epoch": 3, "train/box_loss": 0.3, "metrics/mAP50": 0.5})
    log.add({"epoch": 4, "train/box_loss": 0.25, "metrics/mAP50": 0.6})
    rows = list(csv.DictReader(path.read_text().splitlines()))
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3, 4]
    assert rows[2]["train/box_loss"] == "0.3" and rows[3]["metrics/mAP50"] == "0.6"


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "x")
    save_yaml(tmp_path / "args.yaml", {"epochs": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "args.yaml"]
    assert (tmp_path / "args.yaml").read_text() == "epochs: 3\n"
