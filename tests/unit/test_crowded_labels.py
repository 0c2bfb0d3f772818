"""Crowded images: a label file with more boxes than MAX_BOXES_PER_IMAGE (a 1 MB file of 30,000 valid boxes would
make the loss's assigner allocate dense boxes x anchors tensors) is skipped with its reason, like other unusable label
files; one with exactly the cap is kept."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from detrain.data.labels.check import MAX_BOXES_PER_IMAGE, parse_labels
from detrain.data.labels.verify import img2label_path, load_labels

pytestmark = pytest.mark.unit


def _boxes(n: int) -> str:
    """`n` distinct valid boxes on a 200-wide grid of small boxes (about 32 bytes a row)."""
    rows = [f"0 {(i % 200 + 0.5) / 200:.6f} {(i // 200 + 0.5) / 200:.6f} 0.004 0.004" for i in range(n)]
    return "\n".join(rows) + "\n"


def _image_with(tmp_path: Path, name: str, text: str) -> str:
    img = tmp_path / "images" / "train" / f"{name}.png"
    img.parent.mkdir(parents=True, exist_ok=True)
    assert cv2.imwrite(str(img), np.zeros((48, 64, 3), np.uint8))
    label = Path(img2label_path(img))
    label.parent.mkdir(parents=True, exist_ok=True)
    label.write_text(text)
    return str(img)


def test_the_cap_is_the_documented_value() -> None:
    assert MAX_BOXES_PER_IMAGE == 4096


def test_thirty_thousand_boxes_are_skipped_with_the_reason(tmp_path: Path) -> None:
    text = _boxes(30_000)
    assert len(text) < 1_000_000  # the finding's file: under 1 MB, far under the label file cap
    crowded = _image_with(tmp_path, "crowded", text)
    plain = _image_with(tmp_path, "plain", _boxes(3))
    for cache in (False, True, True):  # verified, then written to the cache, then read from it
        records, report = load_labels([crowded, plain], nc=1, cache=cache, progress=False)
        assert [r.im_file for r in records] == [plain] and len(records[0].cls) == 3
        assert (report.found, report.corrupt) == (1, 1)
        label = img2label_path(crowded)
        assert f"{label}: too many boxes: 30000, at most 4096; image skipped" in report.messages
    assert report.from_cache


@pytest.mark.parametrize(("n", "kept"), [(MAX_BOXES_PER_IMAGE, True), (MAX_BOXES_PER_IMAGE + 1, False)])
def test_exactly_the_cap_is_kept_one_more_is_not(tmp_path: Path, n: int, kept: bool) -> None:
    img = _image_with(tmp_path, "a", _boxes(n))
    records, report = load_labels([img], nc=1, cache=False, progress=False)
    if kept:
        assert len(records) == 1 and len(records[0].cls) == n and records[0].bboxes_xywhn.shape == (n, 4)
        assert (report.found, report.corrupt) == (1, 0)
    else:
        assert records == [] and (report.found, report.corrupt) == (0, 1)
        reason = f"{img2label_path(img)}: too many boxes: {n}, at most {MAX_BOXES_PER_IMAGE}; image skipped"
        assert reason in report.messages


def test_the_cap_counts_boxes_left_after_duplicates_are_removed() -> None:
    text = _boxes(MAX_BOXES_PER_IMAGE) + _boxes(1)  # one row twice: 4097 rows, 4096 boxes
    parsed = parse_labels(text, nc=1)
    assert parsed.problem is None and len(parsed.cls) == MAX_BOXES_PER_IMAGE
    assert "1 duplicate row(s) removed" in parsed.notes
