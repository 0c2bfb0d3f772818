"""The built-in shapes set: deterministic bytes, valid YOLO labels, the standard layout."""

from __future__ import annotations

import hashlib
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml

from detrain.data.labels.verify import load_labels
from detrain.data.synthetic import DEFAULTS, SHAPE_NAMES, fingerprint, generate_shapes
from detrain.errors import DatasetError

SMALL = {"n_train": 6, "n_val": 3, "imgsz": 64}


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def test_same_seed_gives_byte_identical_files(tmp_path):
    a = generate_shapes(tmp_path / "a", **SMALL, seed=7)
    b = generate_shapes(tmp_path / "b", **SMALL, seed=7)
    c = generate_shapes(tmp_path / "c", **SMALL, seed=8)
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(c)


def test_layout_and_data_yaml(tmp_path):
    root = generate_shapes(tmp_path / "s", **SMALL)
    assert len(list((root / "images" / "train").glob("*.png"))) == 6
    assert len(list((root / "images" / "val").glob("*.png"))) == 3
    assert len(list((root / "labels" / "train").glob("*.txt"))) == 6
    meta = yaml.safe_load((root / "data.yaml").read_text())
    assert meta["names"] == SHAPE_NAMES
    assert (meta["path"], meta["train"], meta["val"]) == (".", "images/train", "images/val")
    assert meta["fingerprint"] == fingerprint(6, 3, 64, 0)


def test_labels_are_valid_and_boxes_fit_the_drawn_shapes(tmp_path):
    root = generate_shapes(tmp_path / "s", n_train=24, n_val=1, imgsz=96, seed=1)
    imgs = sorted(str(p) for p in (root / "images" / "train").glob("*.png"))
    records, report = load_labels(imgs, nc=3, cache=False, progress=False)
    assert report.corrupt == 0 and report.found == 24 and report.messages == []
    counts = [len(r.cls) for r in records]
    assert min(counts) >= 1 and max(counts) <= 6
    assert set(np.concatenate([r.cls for r in records]).tolist()) == {0, 1, 2}
    for r in records:
        h, w = r.shape_hw
        assert max(h, w) == 96 and min(h, w) >= int(96 * 0.6)
        assert cv2.imread(r.im_file).shape[:2] == (h, w)
        for cx, cy, bw, bh in r.bboxes_xywhn:
            assert 0 < bw <= 1 and 0 < bh <= 1
            x0, y0 = round((cx - bw / 2) * w), round((cy - bh / 2) * h)
            x1, y1 = round((cx + bw / 2) * w), round((cy + bh / 2) * h)
            assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h
            assert min(x1 - x0, y1 - y0) >= 6


def test_defaults_are_what_the_bundled_yaml_says():
    bundled = yaml.safe_load((Path(__file__).resolve().parents[2] / "datasets" / "shapes.yaml").read_text())
    assert {k: bundled[k] for k in DEFAULTS} == DEFAULTS
    assert bundled["names"] == SHAPE_NAMES and bundled["synthetic"] == "shapes"


@pytest.mark.parametrize("bad", [{"n_train": 0}, {"imgsz": 16}, {"seed": -1}, {"n_val": "4"}])
def test_bad_parameters_raise(tmp_path, bad):
    with pytest.raises(DatasetError, match="shapes dataset: "):
        generate_shapes(tmp_path / "s", **{**SMALL, **bad})
