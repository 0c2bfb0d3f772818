"""Label verification: every bad-file kind is reported and skipped; the cache is safe and invalidates."""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

import cv2
import numpy as np
import pytest

from detrain.data.labels.verify import (
    LabelReport,
    dataset_hash,
    default_cache_path,
    img2label_path,
    load_labels,
    wait_for_cache,
)
from detrain.errors import DatasetError


def _image(path: Path, h: int = 48, w: int = 64, seed: int = 0) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = cv2.GaussianBlur(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8), (5, 5), 2)
    ok, enc = cv2.imencode(path.suffix, img)
    assert ok
    path.write_bytes(enc.tobytes())
    return str(path)


def _label(img: str, text: str) -> Path:
    p = Path(img2label_path(img))
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def _exif_jpeg(path: Path, orientation: int, h: int = 40, w: int = 100) -> str:
    """A JPEG whose EXIF says to rotate it; built by hand so the test needs nothing beyond OpenCV."""
    _image(path, h, w)
    data = path.read_bytes()
    # TIFF header (big endian), one IFD entry: tag 0x0112 Orientation, type SHORT, count 1, value.
    tiff = b"MM\x00*" + struct.pack(">I", 8) + struct.pack(">H", 1)
    tiff += struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack(">I", 0)
    app1 = b"Exif\x00\x00" + tiff
    path.write_bytes(data[:2] + b"\xff\xe1" + struct.pack(">H", len(app1) + 2) + app1 + data[2:])
    return str(path)


def test_img2label_path_replaces_last_images_component():
    assert img2label_path("/d/images/x/images/train/a.b.jpg") == "/d/images/x/labels/train/a.b.txt"
    assert img2label_path("/d/train/a.png") == "/d/train/a.txt"


def test_good_missing_empty_and_summary(tmp_path):
    imgs = [_image(tmp_path / "images" / "train" / f"{i}.jpg", seed=i) for i in range(4)]
    _label(imgs[0], "0 0.5 0.5 0.2 0.2\n1 0.25 0.25 0.1 0.1\n")
    _label(imgs[1], "2 0.5 0.5 1 1\n")
    _label(imgs[2], "")
    records, report = load_labels(imgs, nc=3, progress=False)
    assert (report.total, report.found, report.missing, report.empty, report.corrupt) == (4, 2, 1, 1, 0)
    assert [r.im_file for r in records] == imgs
    assert records[0].shape_hw == (48, 64)
    assert records[0].cls.dtype == np.int64 and records[0].cls.tolist() == [0, 1]
    assert records[0].bboxes_xywhn.dtype == np.float32 and records[0].bboxes_xywhn.shape == (2, 4)
    assert records[3].cls.shape == (0,) and records[3].bboxes_xywhn.shape == (0, 4)
    cache = tmp_path / "labels" / "train.cache"
    assert report.cache_path == cache and cache.is_file()
    assert report.summary("train") == (
        f"train: 4 images, 2 with labels, 1 missing, 1 empty, 0 corrupt (cache: {cache})"
    )


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("0 0.5 0.5 0.2\n", "4 columns"),
        ("0 0.5 0.5 0.2 0.2 0.1\n", "6 columns"),
        ("3 0.5 0.5 0.2 0.2\n", "class id 3 out of range for nc=3 (valid 0-2)"),
        ("-1 0.5 0.5 0.2 0.2\n", "class id -1 out of range"),
        ("0.5 0.5 0.5 0.2 0.2\n", "class id 0.5 out of range"),
        ("0 nan 0.5 0.2 0.2\n", "non-finite"),
        ("0 0.5 inf 0.2 0.2\n", "non-finite"),
        ("0 1.2 0.5 0.2 0.2\n", "coordinate 1.2 outside [0, 1]"),
        ("0 1.02 0.5 0.1 0.1\n", "coordinate 1.02 outside [0, 1]"),  # the centre just beyond the 1 % tolerance
        ("0 0.5 -0.011 0.1 0.1\n", "coordinate -0.011 outside [0, 1]"),
        ("0 0.5 0.5 1.05 0.2\n", "coordinate 1.05 outside [0, 1]"),  # wider than the image
        ("0 320 240 50 60\n", "coordinate 320 outside [0, 1]"),  # pixels, not normalised
        ("0 0.5 0.5 -0.1 0.2\n", "negative width -0.1"),
        ("0 0.5 0.5 0.2 -0.001\n", "negative height -0.001"),
        ("0 0.1 0.1 2.5 0.1 2.5 0.5\n", "polygon extent 1.3 outside [0, 1]"),
        ("0 0.5 abc 0.2 0.2\n", "'abc' is not a number"),
    ],
)
def test_bad_label_files_are_skipped_with_reason(tmp_path, text, reason):
    good = _image(tmp_path / "images" / "a.png")
    bad = _image(tmp_path / "images" / "b.png")
    _label(good, "0 0.5 0.5 0.2 0.2\n")
    label = _label(bad, "1 0.5 0.5 0.1 0.1\n" + text)
    records, report = load_labels([good, bad], nc=3, cache=False, progress=False)
    assert [r.im_file for r in records] == [good]
    assert report.corrupt == 1 and report.found == 1
    (msg,) = report.messages
    assert msg.startswith(f"{label}: line 2:") and reason in msg and msg.endswith("image skipped")


def test_label_not_utf8_is_skipped(tmp_path):
    img = _image(tmp_path / "images" / "a.png")
    Path(img2label_path(img)).parent.mkdir(parents=True)
    Path(img2label_path(img)).write_bytes(b"\xff\xfe\x00garbage")
    records, report = load_labels([img], nc=1, cache=False, progress=False)
    assert records == [] and report.corrupt == 1 and "not UTF-8" in report.messages[0]


def test_small_tolerance_is_clipped_duplicates_and_zero_size_removed(tmp_path):
    img = _image(tmp_path / "images" / "a.png")
    label = _label(img, "0 0.5 0.5 0.2 0.2\n0 0.5 0.5 0.2 0.2\n1 1.0005 0.5 0.2 0.2\n1 0.3 0.3 0 0.1\n")
    (record,), report = load_labels([img], nc=2, cache=False, progress=False)
    assert record.cls.tolist() == [0, 1]
    np.testing.assert_allclose(record.bboxes_xywhn[1], [0.95025, 0.5, 0.0995, 0.2], atol=1e-6)  # x 0.9005-1
    assert f"{label}: 1 duplicate row(s) removed" in report.messages
    assert f"{label}: 1 zero-size box(es) removed" in report.messages
    assert f"{label}: 1 box(es) reaching outside the image clipped to it" in report.messages
    assert report.found == 1 and report.corrupt == 0 and report.clipped == 1


def test_boxes_slightly_outside_are_clipped_and_the_image_kept(tmp_path):
    """What Ultralytics accepts (centre within 1 % of the image, size at most 1.01) is kept, clipped to the image."""
    img = _image(tmp_path / "images" / "train" / "a.jpg")
    other = _image(tmp_path / "images" / "train" / "b.jpg", seed=1)
    _label(
        img,
        "0 0.005 0.5 0.02 0.2\n"  # left edge at -0.005
        "1 0.5 1.008 0.2 0.04\n"  # centre below the image, within the tolerance
        "2 0.5 0.5 1.01 1.0\n"  # a hair wider than the image
        "2 -0.009 0.3 0.01 0.1\n"  # entirely outside: nothing left after clipping
        "0 0.5 0.5 0.2 0.2\n",
    )
    _label(other, "0 0.5 0.5 1.0000005 0.2\n")  # rounding of the label text: clipped, not counted
    records, report = load_labels([img, other], nc=3, progress=False)
    assert report.found == 2 and report.corrupt == 0 and report.clipped == 3
    assert "2 with labels, 0 missing, 0 empty, 0 corrupt, 3 boxes clipped to the image (cache:" in report.summary()
    boxes = records[0].bboxes_xywhn.astype(np.float64)
    assert records[0].cls.tolist() == [0, 1, 2, 0]
    np.testing.assert_allclose(
        boxes[:3], [[0.0075, 0.5, 0.015, 0.2], [0.5, 0.994, 0.2, 0.012], [0.5, 0.5, 1, 1]], atol=1e-6
    )
    corners = np.concatenate([boxes[:, :2] - boxes[:, 2:] / 2, boxes[:, :2] + boxes[:, 2:] / 2], 1)
    assert corners.min() >= 0 and corners.max() <= 1 + 1e-6
    np.testing.assert_allclose(records[1].bboxes_xywhn, [[0.5, 0.5, 1.0, 0.2]], atol=1e-6)
    _, cached = load_labels([img, other], nc=3, progress=False)
    assert cached.from_cache and cached.clipped == 3 and cached.summary() == report.summary()


def test_polygon_slightly_outside_is_clipped(tmp_path):
    img = _image(tmp_path / "images" / "a.png")
    _label(img, "1 -0.005 0.2 0.5 0.2 0.3 0.6\n")
    (record,), report = load_labels([img], nc=2, cache=False, progress=False)
    np.testing.assert_allclose(record.bboxes_xywhn[0], [0.25, 0.4, 0.5, 0.4], atol=1e-6)
    assert report.clipped == 1


@pytest.mark.parametrize(
    "text",
    [
        "0 1.005 0.5 0.3 0.2",
        "0 -0.01 0.5 0.05 0.2",
        "0 0.5 0.5 1.01 1.01",
        "0 0.5 0.5 0 0.2",
        "0 0.999 0.001 0.9 0.9",
        "0 1.011 0.5 0.1 0.1",
        "0 0.5 -0.02 0.1 0.1",
        "0 0.5 0.5 1.02 0.1",
        "0 0.5 0.5 -0.001 0.1",
        "0 0.1 0.1 1.2 0.1 1.2 0.5",
        "0 -0.05 0.1 1.0 0.1 1.0 0.5",
    ],
)
def test_accepts_whatever_ultralytics_accepts(tmp_path, monkeypatch, text):
    """The same verdict as Ultralytics' verify_image_label (when it is importable, e.g. PYTHONPATH=/opt/ulib)."""
    monkeypatch.setenv("YOLO_CONFIG_DIR", str(tmp_path / "yolo"))
    monkeypatch.setenv("YOLO_OFFLINE", "1")
    utils = pytest.importorskip("ultralytics.data.utils")
    img = _image(tmp_path / "images" / "a.jpg", 64, 64)
    label = _label(img, text + "\n")
    theirs = utils.verify_image_label((img, str(label), "", False, 1, 0, 0, False))
    _, report = load_labels([img], nc=1, cache=False, progress=False)
    assert (report.corrupt == 1) == (theirs[0] is None), (text, report.messages, theirs[-1])


def test_polygon_rows_become_their_extent(tmp_path):
    img = _image(tmp_path / "images" / "a.png")
    _label(img, "1 0.1 0.2 0.5 0.2 0.3 0.6\n")
    (record,), _ = load_labels([img], nc=2, cache=False, progress=False)
    np.testing.assert_allclose(record.bboxes_xywhn[0], [0.3, 0.4, 0.4, 0.4], atol=1e-6)


def test_bad_images_are_skipped_with_reason(tmp_path):
    d = tmp_path / "images"
    good = _image(d / "good.jpg")
    zero = d / "zero.jpg"
    zero.write_bytes(b"")
    text = d / "text.png"
    text.write_text("definitely not a png")
    absent = str(d / "absent.jpg")
    full = Path(_image(d / "big.jpg", 128, 128)).read_bytes()
    truncated = d / "truncated.jpg"
    truncated.write_bytes(full[: len(full) // 2])
    broken_png = d / "broken.png"
    broken_png.write_bytes(Path(_image(d / "src.png", 64, 64)).read_bytes()[:200])
    files = [good, str(zero), str(text), absent, str(truncated), str(broken_png)]
    for f in files:
        _label(f, "0 0.5 0.5 0.2 0.2\n")
    records, report = load_labels(files, nc=1, cache=False, progress=False)
    assert [r.im_file for r in records] == [good]
    assert report.corrupt == 5 and report.found == 1
    joined = "\n".join(report.messages)
    assert f"{zero}: empty image file (0 bytes); image skipped" in joined
    assert f"{text}: not a readable image" in joined
    assert f"{absent}: image file not found" in joined
    assert f"{truncated}: truncated JPEG" in joined
    assert f"{broken_png}: not a readable image" in joined


def test_jpeg_missing_only_its_end_marker_is_kept_with_warning(tmp_path):
    img = tmp_path / "images" / "a.jpg"
    data = Path(_image(img, 64, 80)).read_bytes()
    assert data.endswith(b"\xff\xd9")
    img.write_bytes(data[:-2])
    _label(str(img), "0 0.5 0.5 0.2 0.2\n")
    (record,), report = load_labels([str(img)], nc=1, cache=False, progress=False)
    assert record.shape_hw == (64, 80) and report.corrupt == 0
    assert "no end-of-image marker" in report.messages[0]


def test_exif_rotation_gives_the_shape_cv2_loads(tmp_path):
    img = _exif_jpeg(tmp_path / "images" / "rot.jpg", orientation=6, h=40, w=100)
    assert cv2.imread(img).shape[:2] == (100, 40)
    (record,), _ = load_labels([img], nc=1, cache=False, progress=False)
    assert record.shape_hw == (100, 40)


def test_no_labels_at_all_warns_not_raises(tmp_path):
    imgs = [_image(tmp_path / "images" / f"{i}.png") for i in range(2)]
    records, report = load_labels(imgs, nc=1, progress=False)
    assert len(records) == 2 and report.missing == 2
    assert any("training on backgrounds only" in m for m in report.messages)


def test_cache_is_reused_then_invalidated_by_changes(tmp_path):
    imgs = [_image(tmp_path / "images" / "train" / f"{i}.png", seed=i) for i in range(3)]
    for img in imgs:
        _label(img, "0 0.5 0.5 0.2 0.2\n")
    _, first = load_labels(imgs, nc=2, progress=False)
    assert not first.from_cache
    records, again = load_labels(imgs, nc=2, progress=False)
    assert again.from_cache and again.summary() == first.summary()
    assert [r.cls.tolist() for r in records] == [[0], [0], [0]]

    # Same size, new content: the mtime moves on, so the cache must be rebuilt.
    label = Path(img2label_path(imgs[1]))
    label.write_text("1 0.5 0.5 0.2 0.2\n")
    st = label.stat()
    os.utime(label, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    records, changed = load_labels(imgs, nc=2, progress=False)
    assert not changed.from_cache and records[1].cls.tolist() == [1]

    extra = _image(tmp_path / "images" / "train" / "new.png", seed=9)
    _, added = load_labels([*imgs, extra], nc=2, progress=False)
    assert not added.from_cache and added.total == 4 and added.missing == 1

    _, other_nc = load_labels([*imgs, extra], nc=3, progress=False)
    assert not other_nc.from_cache


def test_cache_of_an_older_version_is_rebuilt(tmp_path, monkeypatch):
    from detrain.data.labels import cache as label_cache

    img = _image(tmp_path / "images" / "a.png")
    _label(img, "0 0.5 0.5 0.2 0.2\n")
    monkeypatch.setattr(label_cache, "CACHE_VERSION", label_cache.CACHE_VERSION - 1)
    _, old = load_labels([img], nc=1, progress=False)
    monkeypatch.undo()
    _, now = load_labels([img], nc=1, progress=False)
    assert old.cache_path == now.cache_path and not now.from_cache


def test_cache_messages_survive_and_unreadable_cache_is_rebuilt(tmp_path):
    img = _image(tmp_path / "images" / "a.png")
    _label(img, "0 0.5 0.5 0.2 0.2\n0 0.5 0.5 0.2 0.2\n")
    _, built = load_labels([img], nc=1, progress=False)
    _, cached = load_labels([img], nc=1, progress=False)
    assert cached.from_cache and cached.messages == built.messages and len(built.messages) == 1
    built.cache_path.write_bytes(b"not an npz")
    _, rebuilt = load_labels([img], nc=1, progress=False)
    assert not rebuilt.from_cache and rebuilt.found == 1


def test_cache_has_no_pickles(tmp_path):
    img = _image(tmp_path / "images" / "a.png")
    _label(img, "0 0.5 0.5 0.2 0.2\n")
    _, report = load_labels([img], nc=1, progress=False)
    with np.load(report.cache_path, allow_pickle=False) as npz:  # raises if anything needed pickle
        assert all(npz[k].dtype != object for k in npz.files)


def test_follower_waits_for_the_lead_cache(tmp_path):
    imgs = [_image(tmp_path / "images" / f"{i}.png", seed=i) for i in range(3)]
    for img in imgs:
        _label(img, "0 0.5 0.5 0.2 0.2\n")
    result: dict[str, LabelReport] = {}

    def follower() -> None:
        result["r"] = load_labels(imgs, nc=1, progress=False, build=False, timeout_s=120)[1]

    t = threading.Thread(target=follower)
    t.start()
    load_labels(imgs, nc=1, progress=False)  # the lead builds and writes the cache
    t.join(timeout=120)
    assert result["r"].from_cache and result["r"].found == 3


def test_wait_for_cache_times_out_naming_the_file(tmp_path):
    cache = tmp_path / "labels" / "train.cache"
    with pytest.raises(DatasetError, match=r"waiting for the label cache .*train\.cache"):
        wait_for_cache(cache, timeout_s=0.0, poll_s=0.01)


def test_stale_cache_is_not_accepted_by_a_waiting_follower(tmp_path):
    img = _image(tmp_path / "images" / "a.png")
    _, report = load_labels([img], nc=1, progress=False)
    wrong = dataset_hash([img], [img2label_path(img)], nc=5)
    with pytest.raises(DatasetError, match="timed out"):
        wait_for_cache(report.cache_path, timeout_s=0.0, expected_hash=wrong, poll_s=0.01)


def test_cache_falls_back_when_there_is_no_labels_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("DETRAIN_CACHE_DIR", str(tmp_path / "cachehome"))
    img = _image(tmp_path / "flat" / "images" / "train" / "a.png")
    label_files = [img2label_path(img)]
    # .../flat/labels/train.cache's folder (.../flat/labels) does not exist: use the user cache.
    path = default_cache_path(label_files)
    assert path.parent == tmp_path / "cachehome" / "labels" and path.name.startswith("train-")
    _, report = load_labels([img], nc=1, progress=False)
    assert report.cache_path == path and path.is_file()


def test_bad_nc_and_empty_list(tmp_path):
    with pytest.raises(DatasetError, match="nc=0"):
        load_labels([], nc=0)
    records, report = load_labels([], nc=1, progress=False)
    assert records == [] and report.total == 0 and report.cache_path is None


def test_progress_bar_path_runs(tmp_path):
    imgs = [_image(tmp_path / "images" / f"{i}.png", seed=i) for i in range(3)]
    records, report = load_labels(imgs, nc=1, cache=False, progress=True, workers=2)
    assert len(records) == 3 and report.missing == 3
