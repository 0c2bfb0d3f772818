"""``source=`` parsing for predict: every kind, where outputs go, and what hostile sources get."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import numpy as np
import pytest

from detrain.data.sources import mask_url, parse_source, safe_rel
from detrain.errors import ConfigError


def touch(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def layout(items) -> list[tuple[str, str]]:
    return [(i.kind, str(i.rel)) for i in items]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    for name in (
        "a/x.jpg",
        "b/x.jpg",
        "b/c/y.PNG",
        "clip.mp4",
        "notes.txt",
        "labels.json",
        ".hidden.jpg",
        ".cache/z.jpg",
    ):
        touch(root / name)
    return root


def test_a_folder_is_walked_recursively_in_order_keeping_relative_paths(tree: Path) -> None:
    src = parse_source(str(tree))
    assert layout(src.items) == [
        ("video", "clip.mp4"),
        ("image", "a/x.jpg"),
        ("image", "b/x.jpg"),
        ("image", "b/c/y.PNG"),
    ]
    assert not src.single
    # non-images are reported, hidden files and folders are not entered
    assert sorted(Path(p).name for p in src.skipped) == ["labels.json", "notes.txt"]


def test_the_predict_project_folder_inside_the_source_is_not_read(tree: Path) -> None:
    touch(tree / "runs" / "predict" / "exp" / "x.jpg")
    assert "runs/predict/exp/x.jpg" in [str(i.rel) for i in parse_source(str(tree)).items]
    src = parse_source(str(tree), exclude=tree / "runs" / "predict")
    assert not any(str(i.rel).startswith("runs") for i in src.items)


def test_a_folder_linking_back_into_itself_is_walked_once(tree: Path) -> None:
    os.symlink(tree, tree / "a" / "loop")
    rels = [str(i.rel) for i in parse_source(str(tree)).items]
    assert rels.count("a/x.jpg") == 1 and len(rels) == 4


def test_a_glob_places_outputs_below_its_fixed_part(tree: Path) -> None:
    src = parse_source(str(tree / "**" / "*.jpg"))
    assert layout(src.items) == [("image", "a/x.jpg"), ("image", "b/x.jpg")]
    # a glob that climbs out with '..' still cannot place anything outside the run folder
    (tree / "a" / "sub").mkdir()
    climbing = parse_source(str(tree / "a" / "*" / ".." / ".." / "b" / "x.jpg"))
    assert layout(climbing.items) == [("image", "x.jpg")]


def test_a_txt_list_resolves_lines_from_cwd_then_its_folder(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    listing = touch(tree / "list.txt", b"a/x.jpg\n\n  data/b/x.jpg  \nb/c\nnotes.txt\n")
    src = parse_source(str(listing))
    # a/x.jpg from the list's folder, data/b/x.jpg from the cwd, b/c walked; the .txt line is not followed
    assert layout(src.items) == [("image", "a/x.jpg"), ("image", "b/x.jpg"), ("image", "b/c/y.PNG")]
    assert [Path(p).name for p in src.skipped] == ["notes.txt"]


def test_a_txt_list_may_name_files_anywhere_but_outputs_stay_inside(tmp_path: Path) -> None:
    outside = touch(tmp_path / "elsewhere" / "deep" / "o.jpg")
    listing = touch(tmp_path / "lists" / "l.txt", f"{outside}\n../lists/../elsewhere/deep/o.jpg\n".encode())
    src = parse_source(str(listing))
    assert next(i.target for i in src.items) == str(outside) and len(src.items) == 2
    assert [str(i.rel) for i in src.items] == ["o.jpg", "o.jpg"]  # the writer keeps them apart (_2)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"a.jpg\nmissing.jpg\n", "line 2: 'missing.jpg' does not exist"),
        (b"\xff\xfe\x00binary", "is not UTF-8 text"),
        (b"\n  \n", "names no files"),
    ],
)
def test_a_bad_txt_list_is_one_line_naming_it(tmp_path: Path, content: bytes, message: str) -> None:
    touch(tmp_path / "a.jpg")
    listing = touch(tmp_path / "l.txt", content)
    with pytest.raises(ConfigError, match=message) as e:
        parse_source(str(listing))
    assert "l.txt" in str(e.value) and "\n" not in str(e.value)


def test_single_files_cameras_and_streams(tree: Path) -> None:
    assert (layout(parse_source(str(tree / "a" / "x.jpg")).items), parse_source(str(tree / "clip.mp4")).single) == (
        [("image", "x.jpg")],
        True,
    )
    camera = parse_source("1").items[0]
    assert (camera.kind, camera.target, str(camera.rel), camera.live) == ("camera", "1", "camera1", True)
    stream = parse_source("rtsp://admin:s3cret@10.1.2.3:554/live/cam.1?x=y").items[0]
    assert (stream.kind, str(stream.rel), stream.live) == ("stream", "cam", True)
    assert "s3cret" not in stream.name and "s3cret" in stream.target


def test_a_file_named_like_a_camera_index_is_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    touch(tmp_path / "0", b"")
    with pytest.raises(ConfigError, match="source '0' is not an image"):
        parse_source("0")


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("", "predict needs source="),
        ("   ", "predict needs source="),
        ("/no/such/dir", "source '/no/such/dir' does not exist"),
        ("file:///etc/passwd", "URL scheme 'file' is not a stream"),
        ("ftp://u:pw@host/x.mp4", r"'ftp://u:\*\*\*@host/x.mp4'"),
        ("/no/such/*.jpg", "glob '/no/such/\\*.jpg' has no images"),
        ("bad\nname.jpg", "source 'bad\\?name.jpg' does not exist"),  # a newline cannot forge a second line
    ],
)
def test_bad_sources_are_one_line(source: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        parse_source(source)
    assert "\n" not in str(e.value)


def test_a_file_of_another_kind_and_an_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"is not an image \(.*\), a video \(.*\) or a .txt list"):
        parse_source(str(touch(tmp_path / "doc.pdf")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no images"):
        parse_source(str(tmp_path / "empty"))


def test_python_lists_and_arrays(tree: Path) -> None:
    src = parse_source([tree / "a" / "x.jpg", str(tree / "b")])
    assert layout(src.items) == [("image", "a/x.jpg"), ("image", "b/x.jpg"), ("image", "b/c/y.PNG")]
    arrays = parse_source([np.zeros((4, 4, 3), np.uint8), np.zeros((4, 4), np.uint8)])
    assert layout(arrays.items) == [("array", "image0.jpg"), ("array", "image1.jpg")]
    with pytest.raises(ConfigError, match="image array 0: expected uint8"):
        parse_source(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(ConfigError, match="entry 1: expected a path"):
        parse_source([str(tree / "a" / "x.jpg"), np.zeros((4, 4, 3), np.uint8)])
    with pytest.raises(ConfigError, match="empty list"):
        parse_source([])


def test_safe_rel_and_mask_url() -> None:
    assert safe_rel("/r/a/b.jpg", "/r") == PurePosixPath("a/b.jpg")
    assert safe_rel("/elsewhere/b.jpg", "/r") == PurePosixPath("b.jpg")
    assert mask_url("http://host/x") == "http://host/x"
    assert mask_url("rtsp://user:p%40ss@h:1/s") == "rtsp://user:***@h:1/s"
