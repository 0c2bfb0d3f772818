"""A dataset yaml's ``download: file://...`` names an archive in the yaml's own folder, nothing else (issue 37
item 9): any regular file it named (a private key) was copied into the dataset folder. Each refusal is one line
naming the yaml, the URL and the rule, and nothing is copied.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from detrain.data.dataset_yaml import load_dataset_yaml
from detrain.errors import DatasetError

HEADER = "train: images/train\nval: images/val\nnames: [thing]\n"
TOY = {
    "toy/images/train/a.jpg": b"jpg-a",
    "toy/images/val/b.jpg": b"jpg-b",
    "toy/labels/train/a.txt": b"0 .5 .5 .1 .1\n",
}
SECRET = b"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\n"
RULE = "a file:// URL may only name a zip or tar archive in the yaml's own folder"


def _zip(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in TOY.items():
            zf.writestr(name, data)
    return path


def _yaml(folder: Path, url: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    yaml_file = folder / "data.yaml"
    yaml_file.write_text(f"path: toy\n{HEADER}download: {url}\n")
    return yaml_file


def _holds_secret(folder: Path) -> bool:
    return any(p.is_file() and not p.is_symlink() and SECRET in p.read_bytes() for p in folder.rglob("*"))


def _refused(yaml_file: Path, url: str, reason: str) -> None:
    with pytest.raises(DatasetError) as info:
        load_dataset_yaml(yaml_file)
    said = str(info.value)
    assert said.startswith(f"{yaml_file}: download: {url} is refused: {reason}") and RULE in said, said
    assert "\n" not in said
    assert not (yaml_file.parent / "toy").exists() and not _holds_secret(yaml_file.parent)


def test_a_file_outside_the_yamls_folder_is_refused_and_nothing_copied(tmp_path: Path) -> None:
    key = tmp_path / "home" / ".ssh" / "id_ed25519"
    key.parent.mkdir(parents=True)
    key.write_bytes(SECRET)
    yaml_file = _yaml(tmp_path / "project", key.as_uri())
    _refused(yaml_file, key.as_uri(), f"it names {key}, outside {yaml_file.parent}")


def test_an_archive_outside_the_yamls_folder_is_refused(tmp_path: Path) -> None:
    archive = _zip(tmp_path / "elsewhere" / "toy.zip")
    yaml_file = _yaml(tmp_path / "project", archive.as_uri())
    _refused(yaml_file, archive.as_uri(), f"it names {archive}, outside")


def test_a_link_inside_the_folder_to_a_file_outside_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "id_rsa"
    key.write_bytes(SECRET)
    link = tmp_path / "project" / "toy.zip"
    link.parent.mkdir()
    link.symlink_to(key)
    yaml_file = _yaml(tmp_path / "project", link.as_uri())
    _refused(yaml_file, link.as_uri(), "it names")


def test_a_file_inside_the_folder_that_is_no_archive_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "project" / "id_rsa"
    key.parent.mkdir()
    key.write_bytes(SECRET)
    yaml_file = _yaml(tmp_path / "project", key.as_uri())
    with pytest.raises(DatasetError, match=f"is refused: {key} is no zip or tar archive; {RULE}"):
        load_dataset_yaml(yaml_file)
    assert not (tmp_path / "project" / "toy").exists()


def test_an_archive_in_the_yamls_folder_is_accepted(tmp_path: Path) -> None:
    archive = _zip(tmp_path / "project" / "archives" / "toy.zip")
    yaml_file = _yaml(tmp_path / "project", archive.as_uri())
    assert load_dataset_yaml(yaml_file).train
    assert (tmp_path / "project" / "toy" / "images" / "val" / "b.jpg").read_bytes() == b"jpg-b"
