"""Dataset yaml -> DatasetInfo: schema, path resolution, bundled names, synthetic set, every error."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from detrain.data.dataset_yaml import DatasetInfo, bundled_dataset_names, datasets_dir, load_dataset_yaml
from detrain.errors import DatasetError

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


@pytest.fixture(autouse=True)
def _isolated_datasets_dir(tmp_path, monkeypatch):
    # Never touch the user's ~/.cache while testing bundled yamls.
    monkeypatch.setenv("DETRAIN_DATASETS_DIR", str(tmp_path / "datasets_home"))


def _touch_images(folder: Path, names: list[str]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    for n in names:
        (folder / n).write_bytes(b"x")  # content is the label verifier's business, not the yaml loader's
    return [folder / n for n in names]


def _dataset(root: Path) -> None:
    _touch_images(root / "images" / "train", ["b.jpg", "a.PNG", "notes.md"])
    _touch_images(root / "images" / "train" / "sub", ["c.webp"])
    _touch_images(root / "images" / "val", ["v.jpeg"])


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_folders_names_list_and_sorted_absolute_paths(tmp_path):
    _dataset(tmp_path / "ds")
    y = _write(tmp_path / "data.yaml", "path: ds\ntrain: images/train\nval: images/val\nnames: [cat, dog]\n")
    info = load_dataset_yaml(y)
    assert isinstance(info, DatasetInfo)
    assert info.root == tmp_path / "ds" and info.yaml_file == y
    train = tmp_path / "ds" / "images" / "train"
    assert info.train == sorted([str(train / "a.PNG"), str(train / "b.jpg"), str(train / "sub" / "c.webp")])
    assert info.val == [str(tmp_path / "ds" / "images" / "val" / "v.jpeg")]
    assert info.test is None and info.coco_json is None
    assert info.names == {0: "cat", 1: "dog"} and info.nc == 2
    assert info.raw["names"] == ["cat", "dog"]


def test_names_dict_nc_agreeing_and_no_path_means_yaml_folder(tmp_path):
    _dataset(tmp_path)
    y = _write(tmp_path / "d.yaml", "train: images/train\nval: images/val\nnc: 2\nnames: {1: dog, 0: cat}\n")
    info = load_dataset_yaml(y)
    assert info.root == tmp_path and info.names == {0: "cat", 1: "dog"}


def test_txt_lists_with_relative_dot_and_absolute_entries_and_lists_of_sources(tmp_path):
    root = tmp_path / "ds"
    _dataset(root)
    extra = _touch_images(tmp_path / "elsewhere", ["z.jpg"])[0]
    _write(root / "train.txt", f"./images/train/b.jpg\nimages/train/a.PNG\n\n{extra}\nreadme.txt\n")
    y = _write(
        tmp_path / "d.yaml",
        f"path: {root}\ntrain: train.txt\nval: [images/val, images/train/sub]\ntest: train.txt\nnames: [a]\n",
    )
    info = load_dataset_yaml(y)
    assert info.train == sorted([str(root / "images/train/b.jpg"), str(root / "images/train/a.PNG"), str(extra)])
    assert info.val == sorted([str(root / "images/val/v.jpeg"), str(root / "images/train/sub/c.webp")])
    assert info.test == info.train


def test_relative_path_falls_back_to_the_cwd(tmp_path, monkeypatch):
    _dataset(tmp_path / "work" / "ds")
    y = _write(tmp_path / "yamls" / "d.yaml", "path: ds\ntrain: images/train\nval: images/val\nnames: [a]\n")
    monkeypatch.chdir(tmp_path / "work")
    assert load_dataset_yaml(y).root == tmp_path / "work" / "ds"


def test_bare_name_prefers_cwd_then_bundled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _dataset(tmp_path)
    _write(tmp_path / "coco8.yaml", "train: images/train\nval: images/val\nnames: [mine]\n")
    assert load_dataset_yaml("coco8.yaml").names == {0: "mine"}
    assert {"coco8.yaml", "coco128.yaml", "coco.yaml", "shapes.yaml"} <= set(bundled_dataset_names())


def test_bundled_yaml_root_is_in_the_datasets_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert datasets_dir() == tmp_path / "datasets_home"
    _dataset(tmp_path / "datasets_home" / "coco8")
    for name in ("coco8.yaml", "coco8"):
        info = load_dataset_yaml(name)
        assert info.root == tmp_path / "datasets_home" / "coco8"
        assert info.yaml_file.name == "coco8.yaml" and info.nc == 80 and info.names[79] == "toothbrush"


def test_missing_yaml_lists_bundled_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetError, match=r"'nope\.yaml' not found .*bundled datasets: .*coco8\.yaml.*shapes\.yaml"):
        load_dataset_yaml("nope.yaml")
    with pytest.raises(DatasetError, match="not found"):
        load_dataset_yaml(tmp_path / "sub" / "coco8.yaml")  # a path, not a bare name: no bundled fallback


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("- a\n- b\n", r"must be a mapping .* \(got list\)"),
        ("# nothing\n", r"must be a mapping .* \(got an empty file\)"),
        ("train: [unclosed\n", "not valid YAML"),
        ("train: images/train\nval: images/val\n", r"the key 'names:' is missing"),
        ("val: images/val\nnames: [a]\n", r"the key 'train:' is missing"),
        ("train: images/train\nnames: [a]\n", r"the key 'val:' is missing"),
        ("train: images/train\nval: images/val\nnames: [a, b]\nnc: 3\n", r"nc: 3 disagrees with names: \(2 classes\)"),
        ("train: images/train\nval: images/val\nnames: {0: a, 2: b}\n", r"ids must be 0\.\.1 without gaps"),
        ("train: images/train\nval: images/val\nnames: {x: a}\n", "integer class ids"),
        ("train: images/train\nval: images/val\nnames: []\n", "is empty"),
        ("train: images/train\nval: images/val\nnames: cat\n", "must be a list or a mapping"),
        ("train: 5\nval: images/val\nnames: [a]\n", r"train: must be a folder of images"),
        ("train: images/train\nval: images/val\ntest: nowhere\nnames: [a]\n", r"test: .*nowhere does not exist"),
    ],
)
def test_yaml_errors_are_one_clear_line(tmp_path, text, match):
    _dataset(tmp_path)
    y = _write(tmp_path / "d.yaml", text)
    with pytest.raises(DatasetError, match=match) as e:
        load_dataset_yaml(y)
    assert "\n" not in str(e.value)


def test_missing_data_without_download_says_where_to_put_it(tmp_path):
    y = _write(tmp_path / "d.yaml", "path: ds\ntrain: images/train\nval: images/val\nnames: [a]\n")
    match = r"images/train does not exist and the yaml has no download:; put the dataset in .*ds"
    with pytest.raises(DatasetError, match=match):
        load_dataset_yaml(y)


def test_download_off_names_the_url(tmp_path):
    text = "path: ds\ntrain: images/train\nval: images/val\nnames: [a]\ndownload: https://x.invalid/ds.zip\n"
    y = _write(tmp_path / "d.yaml", text)
    with pytest.raises(DatasetError, match=r"downloading is off; .*https://x\.invalid/ds\.zip"):
        load_dataset_yaml(y, download=False)


def test_download_script_is_not_run(tmp_path):
    text = "train: images/train\nval: images/val\nnames: [a]\ndownload: |\n  import os\n  os.system('x')\n"
    y = _write(tmp_path / "d.yaml", text)
    with pytest.raises(DatasetError, match="download: is not a URL"):
        load_dataset_yaml(y)


def test_empty_image_folder_names_folder_and_extensions(tmp_path):
    _touch_images(tmp_path / "images" / "train", ["readme.md"])
    _touch_images(tmp_path / "images" / "val", ["v.jpg"])
    y = _write(tmp_path / "d.yaml", "train: images/train\nval: images/val\nnames: [a]\n")
    match = r"train: folder .*images/train holds no images \(accepted extensions: bmp, dng.*webp\)"
    with pytest.raises(DatasetError, match=match):
        load_dataset_yaml(y)


def test_txt_list_whose_images_are_missing_counts_as_missing_data(tmp_path):
    _write(tmp_path / "train.txt", "./images/train/a.jpg\n")
    _touch_images(tmp_path / "images" / "val", ["v.jpg"])
    y = _write(tmp_path / "d.yaml", "train: train.txt\nval: images/val\nnames: [a]\n")
    with pytest.raises(DatasetError, match=r"images/train does not exist and the yaml has no download"):
        load_dataset_yaml(y)


def test_coco_json_split_and_annotations_detection(tmp_path):
    root = tmp_path / "coco"
    _touch_images(root / "images" / "val2017", ["1.jpg", "2.jpg"])
    _touch_images(root / "images" / "train2017", ["t.jpg"])
    ann = _write(
        root / "annotations" / "instances_val2017.json",
        json.dumps({"images": [{"id": 2, "file_name": "2.jpg"}, {"id": 1, "file_name": "1.jpg"}], "annotations": []}),
    )
    text = f"path: {root}\ntrain: images/train2017\nval: annotations/instances_val2017.json\nnames: [a]\n"
    y = _write(tmp_path / "d.yaml", text)
    info = load_dataset_yaml(y)
    assert info.val == [str(root / "images/val2017/1.jpg"), str(root / "images/val2017/2.jpg")]
    assert info.coco_json == {"val": str(ann)}
    # A plain folder split picks up annotations/instances_<folder>.json by itself.
    y2 = _write(tmp_path / "d2.yaml", f"path: {root}\ntrain: images/train2017\nval: images/val2017\nnames: [a]\n")
    assert load_dataset_yaml(y2).coco_json == {"val": str(ann)}


def test_coco_json_whose_images_are_nowhere(tmp_path):
    _touch_images(tmp_path / "images" / "train", ["t.jpg"])
    _write(tmp_path / "ann.json", json.dumps({"images": [{"id": 1, "file_name": "x.jpg"}]}))
    y = _write(tmp_path / "d.yaml", "train: images/train\nval: ann.json\nnames: [a]\n")
    with pytest.raises(DatasetError, match=r"images named in ann\.json \(e\.g\. x\.jpg\) not found"):
        load_dataset_yaml(y)


def test_shapes_is_generated_once_into_the_cache_dir(tmp_path):
    y = _write(tmp_path / "s.yaml", "synthetic: shapes\nn_train: 4\nn_val: 2\nimgsz: 48\n")
    info = load_dataset_yaml(y, cache_dir=tmp_path / "cache")
    assert info.root == tmp_path / "cache" / "shapes-4-2-48-0"
    assert len(info.train) == 4 and len(info.val) == 2 and info.names == {0: "circle", 1: "rectangle", 2: "triangle"}
    stamp = (info.root / "data.yaml").stat().st_mtime_ns
    assert load_dataset_yaml(y, cache_dir=tmp_path / "cache").train == info.train
    assert (info.root / "data.yaml").stat().st_mtime_ns == stamp  # reused, not regenerated
    assert not [p for p in (tmp_path / "cache").iterdir() if ".tmp-" in p.name]


def test_shapes_concurrent_callers_see_one_complete_set(tmp_path):
    y = _write(tmp_path / "s.yaml", "synthetic: shapes\nn_train: 5\nn_val: 2\nimgsz: 48\n")
    out: list[DatasetInfo] = []
    load = lambda: out.append(load_dataset_yaml(y, cache_dir=tmp_path / "c"))  # noqa: E731
    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(out) == 3 and all(len(i.train) == 5 and i.train == out[0].train for i in out)
    assert sorted(p.name for p in (tmp_path / "c").iterdir() if not p.name.endswith(".lock")) == ["shapes-5-2-48-0"]


def test_shapes_stale_set_is_regenerated(tmp_path):
    y = _write(tmp_path / "s.yaml", "synthetic: shapes\nn_train: 3\nn_val: 1\nimgsz: 48\n")
    info = load_dataset_yaml(y, cache_dir=tmp_path / "c")
    (info.root / "data.yaml").write_text("fingerprint: from-an-older-version\n")
    (info.root / "images" / "train" / "train_00000.png").unlink()
    again = load_dataset_yaml(y, cache_dir=tmp_path / "c")
    assert len(again.train) == 3 and Path(again.train[0]).is_file()


def test_bundled_shapes_uses_defaults_and_plain_folder_name(tmp_path, monkeypatch):
    import detrain.data.dataset_yaml as dy

    seen = {}

    def fake_ensure(target, params):  # the default-size set takes seconds; only check where it would go
        seen["target"], seen["params"] = target, params
        raise DatasetError("stop")

    monkeypatch.setattr(dy, "_ensure_synthetic", fake_ensure)
    with pytest.raises(DatasetError, match="stop"):
        load_dataset_yaml("shapes.yaml")
    assert seen["target"] == tmp_path / "datasets_home" / "shapes"
    assert seen["params"] == {"n_train": 256, "n_val": 64, "imgsz": 160, "seed": 0}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("synthetic: blobs\n", r"synthetic: 'blobs' is unknown; valid: shapes"),
        ("synthetic: shapes\nnames: [a, b, c]\n", "names: must be"),
        ("synthetic: shapes\nimgsz: 8\n", r"imgsz=8 is invalid"),
    ],
)
def test_synthetic_errors(tmp_path, text, match):
    y = _write(tmp_path / "s.yaml", text)
    with pytest.raises(DatasetError, match=match):
        load_dataset_yaml(y, cache_dir=tmp_path / "c")


@pytest.mark.skipif(not (SHARED / "coco8.yaml").is_file(), reason="shared coco8 not present")
def test_shared_coco8_loads_4_train_4_val(tmp_path):
    # A copy, so that nothing (e.g. a label cache) is ever written into the shared folder.
    shutil.copytree(SHARED / "coco8", tmp_path / "coco8")
    shutil.copy(SHARED / "coco8.yaml", tmp_path / "coco8.yaml")
    info = load_dataset_yaml(tmp_path / "coco8.yaml")
    assert len(info.train) == 4 and len(info.val) == 4
    assert info.names[0] == "person" and info.nc == 80
    assert all(Path(p).is_file() and "/images/train/" in p for p in info.train)

    from detrain.data.labels.verify import load_labels

    records, report = load_labels(info.val, info.nc, progress=False)
    assert report.corrupt == 0 and report.found == 4 and sum(len(r.cls) for r in records) == 17
