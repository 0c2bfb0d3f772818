"""Downloads from a local HTTP server: zip and tar.gz, once only, atomic, and refusing unsafe archives."""

from __future__ import annotations

import io
import socket
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest
from _http_server import served  # noqa: F401 (a fixture)

from detrain.data.dataset_yaml import load_dataset_yaml
from detrain.data.download import download_dataset, marker_name
from detrain.errors import DatasetError


def _zip(path: Path, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)


def _targz(path: Path, members: dict[str, bytes], links: dict[str, str] | None = None) -> None:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tf.addfile(info)


DATASET = {
    "toy/images/train/a.jpg": b"jpg-a",
    "toy/labels/train/a.txt": b"0 0.5 0.5 0.1 0.1\n",
    "toy/images/val/b.jpg": b"jpg-b",
}


def test_zip_is_extracted_with_its_top_folder_stripped_and_only_once(served, tmp_path):
    server, www = served
    _zip(www / "toy.zip", DATASET)
    dest = tmp_path / "datasets" / "toy"
    assert download_dataset(server.url("toy.zip"), dest, progress=False) == dest
    assert (dest / "images" / "train" / "a.jpg").read_bytes() == b"jpg-a"
    assert (dest / "labels" / "train" / "a.txt").is_file()
    assert (dest / marker_name(server.url("toy.zip"))).is_file()
    download_dataset(server.url("toy.zip"), dest, progress=False)
    assert server.counts() == {"/toy.zip": 1}
    # Only the dataset and the lock file remain: no temp files or half-extracted folders.
    assert sorted(p.name for p in dest.parent.iterdir()) == [".toy.download.lock", "toy"]


def test_tar_gz_with_progress_bar(served, tmp_path):
    server, www = served
    _targz(www / "toy.tar.gz", DATASET)
    dest = tmp_path / "toy"
    download_dataset([server.url("toy.tar.gz")], dest, progress=True)
    assert (dest / "images" / "val" / "b.jpg").read_bytes() == b"jpg-b"


def test_several_archives_into_one_folder_and_plain_files(served, tmp_path):
    server, www = served
    _zip(www / "labels.zip", {"coco/labels/val/b.txt": b"", "coco/val.txt": b"./images/val/b.jpg\n"})
    _zip(www / "val.zip", {"val/b.jpg": b"jpg"})
    (www / "README.txt").write_text("hello")
    root = tmp_path / "coco"
    download_dataset(server.url("labels.zip"), root, progress=False)
    download_dataset(server.url("val.zip"), root / "images" / "val", progress=False)
    download_dataset(server.url("README.txt"), root, progress=False)  # merged into the existing folder
    assert (root / "val.txt").is_file() and (root / "images" / "val" / "b.jpg").read_bytes() == b"jpg"
    assert (root / "README.txt").read_text() == "hello" and (root / "labels" / "val" / "b.txt").is_file()
    download_dataset([server.url("labels.zip"), server.url("README.txt")], root, progress=False)
    assert server.counts() == {"/labels.zip": 1, "/val.zip": 1, "/README.txt": 1}


def test_concurrent_callers_download_once(served, tmp_path):
    server, www = served
    _zip(www / "toy.zip", DATASET)
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            download_dataset(server.url("toy.zip"), tmp_path / "toy", progress=False)
        except BaseException as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=fetch) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == [] and server.counts() == {"/toy.zip": 1}
    assert (tmp_path / "toy" / "images" / "train" / "a.jpg").is_file()


@pytest.mark.parametrize("evil", ["../evil.txt", "toy/../../evil.txt", "/tmp/evil-abs.txt"])
def test_zip_escaping_the_target_is_refused_and_nothing_written(served, tmp_path, evil):
    server, www = served
    _zip(www / "bad.zip", {"toy/ok.txt": b"ok", evil: b"pwned"})
    dest = tmp_path / "area" / "toy"
    with pytest.raises(DatasetError, match=r"refusing to extract .*bad\.zip: member .* would land outside"):
        download_dataset(server.url("bad.zip"), dest, progress=False)
    assert not dest.exists()
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "area" / "evil.txt").exists()
    assert [p.name for p in (tmp_path / "area").iterdir()] == [".toy.download.lock"]


def test_tar_symlink_pointing_outside_is_refused(served, tmp_path):
    server, www = served
    _targz(www / "bad.tar.gz", {"toy/ok.txt": b"ok"}, links={"toy/escape": "../../outside"})
    dest = tmp_path / "area" / "toy"
    with pytest.raises(DatasetError, match=r"link 'toy/escape' -> '\.\./\.\./outside' points outside"):
        download_dataset(server.url("bad.tar.gz"), dest, progress=False)
    assert not dest.exists()


def test_tar_symlink_inside_is_fine(served, tmp_path):
    server, www = served
    _targz(www / "ok.tar.gz", {"toy/data/a.txt": b"a"}, links={"toy/alias": "data/a.txt"})
    dest = tmp_path / "toy"
    download_dataset(server.url("ok.tar.gz"), dest, progress=False)
    assert (dest / "alias").read_bytes() == b"a"


def test_connection_refused_is_a_clear_error(tmp_path):
    with socket.socket() as s:  # a port that was just free: nothing listens there now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/toy.zip"
    dest = tmp_path / "toy"
    match = rf"cannot download {url} \(.*offline\?\); download it by hand and extract it into .*toy"
    with pytest.raises(DatasetError, match=match):
        download_dataset(url, dest, progress=False)
    assert not dest.exists() and [p.name for p in tmp_path.iterdir()] == [".toy.download.lock"]


def test_http_404_is_a_clear_error(served, tmp_path):
    server, _ = served
    with pytest.raises(DatasetError, match=r"answered HTTP 404"):
        download_dataset(server.url("missing.zip"), tmp_path / "x", progress=False)


def test_not_a_url(tmp_path):
    with pytest.raises(DatasetError, match="is not a URL"):
        download_dataset("images/train", tmp_path / "x", progress=False)


def test_dataset_yaml_downloads_missing_data_once(served, tmp_path):
    server, www = served
    _zip(www / "toy.zip", DATASET)
    _zip(www / "extra.zip", {"more/x.jpg": b"x"})
    y = tmp_path / "toy.yaml"
    y.write_text(
        "path: data/toy\ntrain: images/train\nval: images/val\nnames: [thing]\n"
        f"download:\n  - {server.url('toy.zip')}\n  - url: {server.url('extra.zip')}\n    dir: images/more\n"
    )
    info = load_dataset_yaml(y)
    assert info.train == [str(tmp_path / "data" / "toy" / "images" / "train" / "a.jpg")]
    assert (tmp_path / "data" / "toy" / "images" / "more" / "x.jpg").is_file()
    load_dataset_yaml(y)
    assert server.counts() == {"/toy.zip": 1, "/extra.zip": 1}


def test_dataset_yaml_offline_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    y = tmp_path / "toy.yaml"
    url = f"http://127.0.0.1:{port}/toy.zip"
    y.write_text(f"path: toy\ntrain: images/train\nval: images/val\nnames: [a]\ndownload: {url}\n")
    with pytest.raises(DatasetError, match=r"cannot download http://127\.0\.0\.1:\d+/toy\.zip .*extract it into .*toy"):
        load_dataset_yaml(y)
