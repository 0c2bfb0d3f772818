"""Where the label cache goes, and what it may replace: the dataset's folder places it (a line of an image list that
points elsewhere never does), and it replaces only an earlier label cache (never another file, never a link)."""

from __future__ import annotations

import os
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml

from detrain.data.labels import cache as label_cache
from detrain.data.labels.verify import default_cache_path, img2label_path, load_labels
from detrain.data.prepare import load_split

pytestmark = pytest.mark.unit

BOX = "0 0.5 0.5 0.2 0.2\n"


def _image(path: Path, seed: int = 0) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = np.random.default_rng(seed).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    assert cv2.imwrite(str(path), img)
    return str(path)


def _labelled(path: Path, seed: int = 0) -> str:
    img = _image(path, seed)
    label = Path(img2label_path(img))
    label.parent.mkdir(parents=True, exist_ok=True)
    label.write_text(BOX)
    return img


def _dataset(root: Path, n: int = 3) -> list[str]:
    """`root/images/train/<i>.png` with a box each in `root/labels/train/<i>.txt`."""
    return [_labelled(root / "images" / "train" / f"{i}.png", seed=i) for i in range(n)]


def _yaml(root: Path, train: str) -> str:
    path = root / "data.yaml"
    path.write_text(yaml.safe_dump({"path": ".", "train": train, "val": train, "names": ["thing"]}))
    return str(path)


def _hostile_list(tmp_path: Path) -> tuple[Path, Path]:
    """A dataset whose `train.txt` first names (sorted) an image outside it, `a_system/etc/ld.so/x.jpg`: (the dataset's
    folder, the path the old code put the cache at, `a_system/etc/ld.so.cache`)."""
    root = tmp_path / "ds"
    imgs = _dataset(root)
    _image(tmp_path / "a_system" / "etc" / "ld.so" / "x.jpg")  # "a_system" sorts before "ds"
    lines = ["../a_system/etc/ld.so/x.jpg", *(os.path.relpath(i, root) for i in imgs)]
    (root / "train.txt").write_text("\n".join(lines) + "\n")
    return root, tmp_path / "a_system" / "etc" / "ld.so.cache"


@pytest.mark.parametrize("decoy", [b"", bytes(range(256)) * 4], ids=["nothing there", "decoy"])
def test_a_list_line_outside_the_dataset_does_not_place_the_cache(tmp_path: Path, decoy: bytes) -> None:
    root, old_place = _hostile_list(tmp_path)
    if decoy:
        old_place.write_bytes(decoy)
    data = load_split(_yaml(root, "train.txt"), "train", verbose=False)
    assert len(data.records) == 4  # the image outside too (unlabelled): it is the cache's place that matters here
    if decoy:
        assert old_place.read_bytes() == decoy
    else:
        assert not os.path.lexists(old_place)
    assert sorted(p.name for p in old_place.parent.iterdir()) == ["ld.so", *(["ld.so.cache"] if decoy else [])]
    cache = root / "labels" / "train.cache"
    assert cache.is_file()
    _, report = load_labels([r.im_file for r in data.records], nc=1, progress=False, cache_path=cache)
    assert report.from_cache and report.found == 3 and report.missing == 1


def test_labels_all_outside_the_dataset_go_to_the_cache_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DETRAIN_CACHE_DIR", str(tmp_path / "cachehome"))
    _dataset(tmp_path / "elsewhere")
    (tmp_path / "ds").mkdir()
    data = _yaml(tmp_path / "ds", str(tmp_path / "elsewhere" / "images" / "train"))
    assert len(load_split(data, "train", verbose=False).records) == 3
    assert not (tmp_path / "elsewhere" / "labels" / "train.cache").exists()
    (written,) = (tmp_path / "cachehome" / "labels").iterdir()
    assert written.name.startswith("train-") and written.suffix == ".cache"
    before = written.stat().st_mtime_ns
    load_split(data, "train", verbose=False)  # read back, not written again
    assert written.stat().st_mtime_ns == before


def test_a_labels_folder_linked_out_of_the_dataset_does_not_place_the_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DETRAIN_CACHE_DIR", str(tmp_path / "cachehome"))
    root = tmp_path / "ds"
    for i in range(2):
        _image(root / "images" / "train" / f"{i}.png", seed=i)
    (tmp_path / "outside" / "train").mkdir(parents=True)
    (root / "labels").symlink_to(tmp_path / "outside")  # ds/labels/train.cache would land in outside/
    load_split(_yaml(root, "images/train"), "train", verbose=False)
    assert sorted(os.listdir(tmp_path / "outside")) == ["train"]
    assert [p.name.startswith("train-") for p in (tmp_path / "cachehome" / "labels").iterdir()] == [True]


def test_only_a_label_folder_inside_the_root_chooses_the_place(tmp_path: Path) -> None:
    (tmp_path / "ds" / "labels" / "train").mkdir(parents=True)
    (tmp_path / "etc" / "ld.so").mkdir(parents=True)
    inside, outside = str(tmp_path / "ds" / "labels" / "train" / "b.txt"), str(tmp_path / "etc" / "ld.so" / "a.txt")
    assert default_cache_path([outside, inside], root=tmp_path / "ds") == tmp_path / "ds" / "labels" / "train.cache"
    assert default_cache_path([outside], root=tmp_path / "ds").parent.name == "labels"
    assert default_cache_path([outside], root=tmp_path / "ds") != tmp_path / "etc" / "ld.so.cache"
    assert default_cache_path([outside]) == tmp_path / "etc" / "ld.so.cache"  # no root: the caller's own files


@pytest.mark.parametrize("kind", ["text", "npy", "npz without meta", "zip-like"])
def test_a_file_that_is_not_a_label_cache_is_kept(tmp_path: Path, kind: str) -> None:
    imgs = _dataset(tmp_path)
    cache = tmp_path / "labels" / "train.cache"
    if kind == "text":
        cache.write_bytes(b"somebody's file\n")
    elif kind == "npy":
        with open(cache, "wb") as fh:
            np.save(fh, np.arange(5))
    elif kind == "npz without meta":
        with open(cache, "wb") as fh:
            np.savez(fh, shapes=np.zeros((1, 2), np.int64))
    else:
        cache.write_bytes(b"PK\x03\x04" + bytes(100))
    before = cache.read_bytes()
    with pytest.warns(UserWarning, match=r"cannot write label cache .*train\.cache \(.*not a detrain label cache"):
        records, report = load_labels(imgs, nc=1, progress=False)
    assert cache.read_bytes() == before and not cache.is_symlink()
    assert report.cache_path is None and len(records) == 3 and report.found == 3
    assert [p.name for p in cache.parent.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    # a follower does not wait for a cache the lead cannot write
    with pytest.warns(UserWarning, match="not a detrain label cache"):
        _, follower = load_labels(imgs, nc=1, progress=False, build=False, timeout_s=60)
    assert follower.found == 3 and cache.read_bytes() == before


@pytest.mark.parametrize("dangling", [False, True])
def test_a_link_at_the_cache_path_is_left_alone(tmp_path: Path, dangling: bool) -> None:
    imgs = _dataset(tmp_path / "ds")
    target = tmp_path / "target.cache"
    if not dangling:
        target.write_bytes(b"the link's target\n")
    cache = tmp_path / "ds" / "labels" / "train.cache"
    cache.symlink_to(target)
    with pytest.warns(UserWarning, match=r"train\.cache \(a symbolic link is there"):
        _, report = load_labels(imgs, nc=1, progress=False)
    assert cache.is_symlink() and os.readlink(cache) == str(target)
    if dangling:
        assert not target.exists()
    else:
        assert target.read_bytes() == b"the link's target\n"
    assert report.cache_path is None and report.found == 3


def test_a_link_to_a_good_cache_is_not_read(tmp_path: Path) -> None:
    imgs = _dataset(tmp_path / "ds")
    _, built = load_labels(imgs, nc=1, progress=False)
    real = tmp_path / "elsewhere.cache"
    assert built.cache_path is not None
    built.cache_path.rename(real)
    built.cache_path.symlink_to(real)
    with pytest.warns(UserWarning, match="symbolic link"):
        _, report = load_labels(imgs, nc=1, progress=False)
    assert not report.from_cache and built.cache_path.is_symlink()


def test_the_usual_layout_writes_and_reads_labels_train_cache(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    _dataset(root)
    data = load_split(_yaml(root, "images/train"), "train", verbose=False)
    cache = root / "labels" / "train.cache"
    assert cache.is_file() and len(data.records) == 3
    written = cache.stat().st_mtime_ns
    _, report = load_labels([r.im_file for r in data.records], nc=1, progress=False)
    assert report.from_cache and report.cache_path == cache and cache.stat().st_mtime_ns == written
    assert report.summary("train").endswith(f"(cache: {cache})")


def test_an_earlier_label_cache_is_still_replaced(tmp_path: Path, monkeypatch) -> None:
    imgs = _dataset(tmp_path)
    monkeypatch.setattr(label_cache, "CACHE_VERSION", label_cache.CACHE_VERSION - 1)
    _, old = load_labels(imgs, nc=1, progress=False)
    monkeypatch.undo()
    _, rebuilt = load_labels(imgs, nc=1, progress=False)
    _, now = load_labels(imgs, nc=1, progress=False)
    assert old.cache_path == rebuilt.cache_path == now.cache_path and not rebuilt.from_cache and now.from_cache
