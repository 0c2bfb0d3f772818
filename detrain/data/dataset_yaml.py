"""Dataset yaml (Ultralytics' schema) -> `DatasetInfo`: absolute image lists per split and class names.

Schema: `path` (dataset root), `train`, `val`, optional `test` (each a folder of images, a `.txt` list of
image paths, a COCO annotation `.json`, or a list of those), `names` (list or {id: name}), optional `nc`,
optional `download` (a URL, {url, dir, sha256}, or a list of those). A yaml with `synthetic: shapes` is the
built-in generated set. Label files sit where `img2label_path` says: `.../images/...` -> `.../labels/...txt`.

Example (a dataset of one image per split, in the current folder):
    >>> import pathlib, cv2, numpy as np, yaml
    >>> for split in ("train", "val"):
    ...     pathlib.Path(f"toy/images/{split}").mkdir(parents=True)
    ...     _ = cv2.imwrite(f"toy/images/{split}/a.png", np.zeros((48, 64, 3), np.uint8))
    >>> toy = {"path": "toy", "train": "images/train", "val": "images/val", "names": ["cat", "dog"]}
    >>> _ = pathlib.Path("toy.yaml").write_text(yaml.safe_dump(toy))
    >>> info = load_dataset_yaml("toy.yaml")
    >>> len(info.train), info.nc, info.names
    (1, 2, {0: 'cat', 1: 'dog'})
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detrain.data import synthetic
from detrain.data.download import DownloadLimits, download_dataset, file_lock, is_url
from detrain.data.labels.verify import img2label_path
from detrain.data.ultralytics_dirs import ultralytics_datasets_dir, ultralytics_settings_file
from detrain.errors import DatasetError
from detrain.system.assets import asset_dir
from detrain.system.input_file import read_input_text, reason_of
from detrain.system.net import is_sha256, local_archive_problem
from detrain.system.safe_yaml import YamlRefused, read_yaml
from detrain.system.text import excerpt, name_problem, shown

__all__ = [
    "IMG_FORMATS",
    "DatasetInfo",
    "bundled_dataset_names",
    "datasets_dir",
    "img2label_path",
    "load_dataset_yaml",
]

IMG_FORMATS = frozenset({"bmp", "dng", "jpeg", "jpg", "mpo", "png", "tif", "tiff", "webp", "pfm"})
_SPLITS = ("train", "val", "test")
MAX_LIST_BYTES = 1 << 30  # a .txt image list: some 20 million paths
MAX_JSON_BYTES = 8 << 30  # a COCO annotation file (COCO's train2017 is 450 MB)


@dataclass(frozen=True)
class DatasetInfo:
    """A resolved dataset: absolute, sorted image paths per split and the class names.

    `coco_json` maps a split to its COCO annotation file when one is known (the split was given as a
    `.json`, or `<path>/annotations/instances_<split folder>.json` exists), for exact COCO evaluation.
    """

    yaml_file: Path
    root: Path
    train: list[str]
    val: list[str]
    test: list[str] | None
    names: dict[int, str]
    nc: int
    coco_json: dict[str, str] | None
    raw: dict
    note: str | None = None  # a line to show once (rank 0): where the files were found, when not where the yaml says


def datasets_dir() -> Path:
    """Where bundled datasets are downloaded or generated: `$DETRAIN_DATASETS_DIR`, else ~/.cache/detrain/datasets.

    Example:
        >>> datasets_dir().relative_to(Path.home()).as_posix()  # without $DETRAIN_DATASETS_DIR
        '.cache/detrain/datasets'
    """
    env = os.environ.get("DETRAIN_DATASETS_DIR")
    return Path(env).expanduser().absolute() if env else Path.home() / ".cache" / "detrain" / "datasets"


def _bundled_dir() -> Path:
    return asset_dir("datasets")


def bundled_dataset_names() -> list[str]:
    """File names of the dataset yamls that ship with detrain.

    Example:
        >>> "coco8.yaml" in bundled_dataset_names()
        True
    """
    d = _bundled_dir()
    return sorted(p.name for p in d.glob("*.yaml")) if d.is_dir() else []


def load_dataset_yaml(
    data: str | Path, cache_dir: Path | None = None, download: bool = True, limits: DownloadLimits | None = None
) -> DatasetInfo:
    """Read a dataset yaml, fetch or generate the data if needed, and list every split's images.

    `data` is a path, or a bare name of a bundled yaml (`coco8.yaml`, `coco8`, `shapes.yaml`) when no such
    file is in the current folder. Bundled datasets live under `datasets_dir()`; the synthetic set is
    generated once into `cache_dir` (default `datasets_dir()`). `limits` caps what `download:` may fetch
    (default: :class:`DownloadLimits`'s).

    Example (a bundled dataset not downloaded yet, with downloading off):
        >>> load_dataset_yaml("coco8.yaml", download=False)
        Traceback (most recent call last):
        ...
        detrain.errors.DatasetError: .../coco8.yaml: .../coco8/images/train does not exist and downloading is off; ...
    """
    yaml_file, bundled = find_dataset_yaml(data)
    raw = _read_yaml(yaml_file)
    if "synthetic" in raw:
        return _load_synthetic(yaml_file, raw, Path(cache_dir) if cache_dir is not None else datasets_dir())
    names = _parse_names(raw, yaml_file)
    for key in ("train", "val"):
        if raw.get(key) is None:
            raise DatasetError(
                f"{yaml_file}: the key '{key}:' is missing; give a folder of images, a .txt list or a list of those"
            )
    root = _resolve_root(raw, yaml_file, bundled)
    splits = {k: _split_entries(k, raw[k], yaml_file) for k in _SPLITS if raw.get(k) is not None}
    missing = [p for k in ("train", "val") for p in _missing_paths(root, splits[k])]
    note = None
    borrowed = _ultralytics_copy(raw, yaml_file, bundled, root, splits) if missing else None
    if borrowed is not None:
        root, note = borrowed
    elif missing:
        _fetch_or_explain(raw, yaml_file, root, missing, download, bundled, limits)
    lists: dict[str, list[str]] = {}
    coco_json: dict[str, str] = {}
    for key, entries in splits.items():
        lists[key], json_file = _list_split(key, entries, root, yaml_file)
        if json_file is not None:
            coco_json[key] = json_file
    return DatasetInfo(
        yaml_file=yaml_file,
        root=root,
        train=lists["train"],
        val=lists["val"],
        test=lists.get("test"),
        names=names,
        nc=len(names),
        coco_json=coco_json or None,
        raw=raw,
        note=note,
    )


# ---- the yaml itself ------------------------------------------------------------------------------------


def find_dataset_yaml(data: str | Path) -> tuple[Path, bool]:
    """(absolute yaml path, whether it is one of the bundled yamls); reads nothing, so commands call it to fail
    fast, before any process starts.

    Example:
        >>> find_dataset_yaml("coco8")[0].name, find_dataset_yaml("coco8")[1]
        ('coco8.yaml', True)
    """
    path = Path(data).expanduser()
    if path.is_dir():
        raise DatasetError(f"dataset yaml '{data}' is a folder; give the dataset's .yaml file (e.g. data/coco8.yaml)")
    bundled_dir = _bundled_dir()
    if path.is_file():
        # abspath, not resolve(): a symlinked yaml's relative `path` means beside the link, as the user sees it
        return Path(os.path.abspath(path)), path.resolve().parent == bundled_dir.resolve()
    if path.parent == Path("."):  # a bare name: look among the bundled yamls
        for candidate in (path.name, f"{path.name}.yaml"):
            if (bundled_dir / candidate).is_file():
                return (bundled_dir / candidate).resolve(), True
    names = ", ".join(bundled_dataset_names()) or "none"
    raise DatasetError(f"dataset yaml '{data}' not found (looked in {Path.cwd()}); bundled datasets: {names}")


def _read_yaml(yaml_file: Path) -> dict:
    try:
        raw = read_yaml(yaml_file)
    except YamlRefused as e:
        raise DatasetError(f"{shown(str(yaml_file))}: {e}") from None
    except OSError as e:
        raise DatasetError(f"{shown(str(yaml_file))}: cannot read it ({reason_of(e)})") from None
    if not isinstance(raw, dict):
        raise DatasetError(
            f"{yaml_file}: must be a mapping with keys path, train, val and names "
            f"(got {'an empty file' if raw is None else type(raw).__name__})"
        )
    return raw


def _parse_names(raw: dict, yaml_file: Path) -> dict[int, str]:
    names = raw.get("names")
    if names is None:
        raise DatasetError(
            f"{yaml_file}: the key 'names:' is missing; give a list of class names or a mapping {{0: name, ...}}"
        )
    values = names.values() if isinstance(names, dict) else names if isinstance(names, (list, tuple)) else []
    bad = next((v for v in values if not isinstance(v, (str, int, float)) or isinstance(v, bool)), None)
    if bad is not None:
        raise DatasetError(f"{yaml_file}: names: each class name must be text (got {excerpt(bad)})")
    if isinstance(names, (list, tuple)):
        parsed = {i: str(n) for i, n in enumerate(names)}
    elif isinstance(names, dict):
        try:
            parsed = {_class_id(k): str(v) for k, v in names.items()}
        except ValueError:
            raise DatasetError(
                f"{yaml_file}: names: keys must be integer class ids (got {excerpt(list(names))})"
            ) from None
        if sorted(parsed) != list(range(len(parsed))):
            raise DatasetError(
                f"{yaml_file}: names: ids must be 0..{len(parsed) - 1} without gaps (got {excerpt(sorted(parsed))})"
            )
        parsed = dict(sorted(parsed.items()))
    else:
        raise DatasetError(f"{yaml_file}: names: must be a list or a mapping {{id: name}} (got {type(names).__name__})")
    if not parsed:
        raise DatasetError(f"{yaml_file}: names: is empty; list at least one class name")
    problem = name_problem(parsed)
    if problem is not None:
        raise DatasetError(f"{yaml_file}: names: {problem}")
    nc = raw.get("nc")
    if nc is not None and nc != len(parsed):
        raise DatasetError(
            f"{yaml_file}: nc: {excerpt(nc)} disagrees with names: ({len(parsed)} classes); fix or drop nc"
        )
    return parsed


def _class_id(key: object) -> int:
    """A ``names:`` key as a class id: an integer, or digits in quotes ("3"); ValueError for anything else."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.strip().isdigit() and len(key.strip()) < 10:
        return int(key)
    raise ValueError(key)


def _resolve_root(raw: dict, yaml_file: Path, bundled: bool) -> Path:
    """The dataset root: bundled yamls under datasets_dir(); others beside the yaml, then the cwd."""
    value = raw.get("path")
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise DatasetError(f"{yaml_file}: path: must be a folder (got {excerpt(value)})")
    if bundled:
        base = datasets_dir()
        return (base / Path(value).expanduser()).absolute() if value else base / yaml_file.stem
    if not value:
        return yaml_file.parent
    path = Path(value).expanduser()
    if path.is_absolute():
        return Path(os.path.normpath(path))
    beside, in_cwd = yaml_file.parent / path, Path.cwd() / path
    chosen = beside if beside.exists() or not in_cwd.exists() else in_cwd
    return Path(os.path.normpath(chosen.absolute()))


def _ultralytics_copy(
    raw: dict, yaml_file: Path, bundled: bool, root: Path, splits: dict[str, list[str]]
) -> tuple[Path, str] | None:
    """(root, the line saying so) of a complete copy of the dataset in Ultralytics' datasets folder, where the
    yaml's own root lacks its train or val files: a relative ``path:`` (a bundled yaml's name when it has none)
    resolved there, as Ultralytics resolves it. None when there is no such folder or copy."""
    value = raw.get("path")
    rel = Path(str(value)).expanduser() if value else (Path(yaml_file.stem) if bundled else None)
    if rel is None or rel.is_absolute():
        return None
    base = ultralytics_datasets_dir()
    if base is None:
        return None
    candidate = Path(os.path.normpath((base / rel).absolute()))
    if candidate == root or any(_missing_paths(candidate, splits[k]) for k in ("train", "val")):
        return None
    return candidate, (
        f"{yaml_file.name}: using the copy in {candidate} (the datasets_dir of {ultralytics_settings_file()}) "
        f"instead of downloading to {root}"
    )


# ---- splits ---------------------------------------------------------------------------------------------


def _split_entries(key: str, value: Any, yaml_file: Path) -> list[str]:
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(v, (str, os.PathLike)) and str(v).strip() for v in items):
        raise DatasetError(
            f"{yaml_file}: {key}: must be a folder of images, a .txt list, a COCO .json or a list of those "
            f"(got {excerpt(value)})"
        )
    return [str(v).strip() for v in items]


def _abs(root: Path, entry: str) -> Path:
    path = Path(entry).expanduser()
    return Path(os.path.normpath(path if path.is_absolute() else root / path))


def _missing_paths(root: Path, entries: list[str]) -> list[Path]:
    """Entries that do not exist; a .txt list counts as missing when its first image is (data not yet fetched)."""
    missing = []
    for entry in entries:
        path = _abs(root, entry)
        if not path.exists():
            missing.append(path)
        elif path.suffix.lower() == ".txt" and path.is_file():
            first = next(iter(_read_txt_list(path, root)), None)
            if first is not None and not Path(first).exists():
                missing.append(Path(first).parent)
    return missing


def _list_split(key: str, entries: list[str], root: Path, yaml_file: Path) -> tuple[list[str], str | None]:
    images: list[str] = []
    json_file: str | None = None
    for entry in entries:
        path = _abs(root, entry)
        if not path.exists():
            raise DatasetError(f"{yaml_file}: {key}: {path} does not exist; put the {key} images there or fix '{key}:'")
        if path.is_dir():
            found = _images_in(path)
            if not found:
                exts = ", ".join(sorted(IMG_FORMATS))
                raise DatasetError(f"{yaml_file}: {key}: folder {path} holds no images (accepted extensions: {exts})")
            images += found
            json_file = json_file or _annotations_json(root, path.name)
        elif path.suffix.lower() == ".txt":
            listed = [f for f in _read_txt_list(path, root) if _is_image(f)]
            if not listed:
                raise DatasetError(f"{yaml_file}: {key}: list {path} names no image files (one image path per line)")
            images += listed
            json_file = json_file or _annotations_json(root, path.stem)
        elif path.suffix.lower() == ".json":
            images += _images_from_coco_json(path, root, key, yaml_file)
            json_file = str(path)
        elif path.is_file() and _is_image(str(path)):
            images.append(str(path))
        else:
            raise DatasetError(f"{yaml_file}: {key}: {path} is not a folder, a .txt list, a COCO .json or an image")
    return sorted(images), json_file


def _is_image(path: str) -> bool:
    return path.rsplit(".", 1)[-1].lower() in IMG_FORMATS


def _images_in(folder: Path) -> list[str]:
    found: list[str] = []
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:  # a symlink loop: walk each real folder once
            dirnames[:] = []
            continue
        seen.add(real)
        found += [os.path.join(dirpath, f) for f in filenames if _is_image(f)]
    return found


def _read_txt_list(path: Path, root: Path) -> list[str]:
    try:
        lines = read_input_text(path, MAX_LIST_BYTES).splitlines()
    except OSError as e:  # a FIFO or device is refused, never waited on
        raise DatasetError(f"{shown(str(path))}: cannot read the image list ({reason_of(e)})") from None
    return [str(_abs(root, line.strip())) for line in lines if line.strip()]


def _annotations_json(root: Path, split_name: str) -> str | None:
    candidate = root / "annotations" / f"instances_{split_name}.json"
    return str(candidate) if candidate.is_file() else None


def _images_from_coco_json(path: Path, root: Path, key: str, yaml_file: Path) -> list[str]:
    """Image paths named in a COCO annotation file, found in the usual COCO or YOLO folder layouts."""
    try:
        doc = json.loads(read_input_text(path, MAX_JSON_BYTES))
        file_names = [str(im["file_name"]) for im in doc["images"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        reason = excerpt(str(e), 120, quote=False)
        raise DatasetError(f"{yaml_file}: {key}: {path} is not a readable COCO annotation file ({reason})") from None
    if not file_names:
        raise DatasetError(f"{yaml_file}: {key}: {path} lists no images")
    tag = path.stem.split("_", 1)[-1]  # instances_val2017 -> val2017
    above = path.parent.parent
    candidates = [root / "images" / tag, root / tag, above / "images" / tag, above / tag, root]
    for folder in candidates:
        if (folder / file_names[0]).is_file():
            return [os.path.normpath(folder / f) for f in file_names]
    raise DatasetError(
        f"{yaml_file}: {key}: images named in {path.name} (e.g. {file_names[0]}) not found; put them in {candidates[0]}"
    )


# ---- getting the data -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Fetch:
    """One `download:` entry: the URL, the folder it fills, its sha256 if given, and the folder that one must
    stay in once symlinks are resolved (the yaml's `path` for a `dir:` inside it)."""

    url: str
    dest: Path
    sha256: str | None
    inside: Path | None


_ENTRY_KEYS = ("url", "dir", "sha256")
_SYNTHETIC_BOUNDS = {"n_train": (1, 1_000_000), "n_val": (1, 1_000_000), "imgsz": (32, 4096), "seed": (0, 2**31 - 1)}


def _download_plan(value: Any, root: Path, yaml_file: Path, bundled: bool) -> list[_Fetch] | None:
    """The entries of `download:`, or None when it is not something detrain can fetch (e.g. a script).

    Forms: a URL, ``{url, dir, sha256}`` (dir and sha256 optional), or a list of those. `dir` is a folder
    inside `path`; a bundled yaml's `path` stays inside the datasets folder.
    """
    items = value if isinstance(value, list) else [value]
    if bundled:
        base = os.path.normpath(datasets_dir())
        if os.path.commonpath([os.path.normpath(root), base]) != base:
            raise DatasetError(f"{yaml_file}: path: {root} leaves the datasets folder {base}")
    plan: list[_Fetch] = []
    for i, item in enumerate(items, 1):
        where = f"{yaml_file}: download:" + (f" entry {i}:" if isinstance(value, list) else "")
        if is_url(item):
            plan.append(_Fetch(item.strip(), root, None, None))
        elif isinstance(item, dict) and is_url(item.get("url")):
            unknown = [k for k in item if k not in _ENTRY_KEYS]
            if unknown:
                raise DatasetError(f"{where} unknown key {excerpt(unknown[0])}; valid keys: {', '.join(_ENTRY_KEYS)}")
            sub = _download_dir(item.get("dir"), root, where)
            sha256 = _download_sha256(item.get("sha256"), where)
            plan.append(_Fetch(item["url"].strip(), sub, sha256, None if sub == root else root))
        else:
            return None
    return plan or None


def _check_download_root(root: Path, yaml_file: Path) -> None:
    """A yaml's download: fills its ``path:`` only inside the yaml's own folder or the datasets folder (links
    resolved): a ``path:`` naming any new or empty folder (an autostart folder, another user's home) would
    otherwise receive the archive's files. ``download_anywhere=true`` lifts it."""
    real = os.path.realpath(root)
    allowed = [os.path.realpath(yaml_file.parent), os.path.realpath(datasets_dir())]
    if not any(os.path.commonpath([real, base]) == base for base in allowed):
        raise DatasetError(
            f"{shown(str(yaml_file))}: path: {shown(str(root))} is outside the yaml's folder and the datasets folder "
            f"{datasets_dir()}: download: does not write there; move the yaml beside the data, or give "
            "download_anywhere=true"
        )


def _check_file_url(url: str, yaml_file: Path) -> None:
    """A ``file://`` URL of a yaml's download: names a zip or tar archive inside the yaml's own folder (links
    resolved), never any other file: a yaml handed over could otherwise copy a private key into the dataset folder
    (:func:`detrain.system.net.local_archive_problem`)."""
    problem = local_archive_problem(url, yaml_file.parent)
    if problem is not None:
        raise DatasetError(
            f"{shown(str(yaml_file))}: download: {shown(url)} is refused: {problem}; a file:// URL may only name a "
            f"zip or tar archive in the yaml's own folder {shown(str(yaml_file.parent))}"
        )


def _download_dir(value: Any, root: Path, where: str) -> Path:
    """`dir:` -> a folder inside `root`: relative, without '..'."""
    if value is None or str(value).strip() in ("", "."):
        return root
    text = str(value).strip()
    parts = Path(text.replace("\\", "/")).parts
    if not isinstance(value, str) or Path(text).is_absolute() or text.startswith(("/", "\\", "~")) or ".." in parts:
        raise DatasetError(f"{where} dir: {excerpt(value)} must be a folder inside {root} (relative, without '..')")
    return Path(os.path.normpath(root / text))


def _download_sha256(value: Any, where: str) -> str | None:
    if value is None:
        return None
    text = str(value).strip().lower()
    if not isinstance(value, str) or not is_sha256(text):
        quote = "" if isinstance(value, str) else " in quotes (YAML read this one as a number)"
        raise DatasetError(
            f"{where} sha256: {excerpt(value)} is not a sha256; give the 64 hex digits sha256sum prints{quote}"
        )
    return text


def _fetch_or_explain(
    raw: dict,
    yaml_file: Path,
    root: Path,
    missing: list[Path],
    download: bool,
    bundled: bool,
    limits: DownloadLimits | None,
) -> None:
    where = f"put the dataset in {root} (images under images/, labels under labels/)"
    if raw.get("download") is None:
        raise DatasetError(f"{yaml_file}: {missing[0]} does not exist and the yaml has no download:; {where}")
    plan = _download_plan(raw["download"], root, yaml_file, bundled)
    if plan is None:
        raise DatasetError(
            f"{yaml_file}: {missing[0]} does not exist and download: is not a URL, a list of URLs or of "
            f"{{url, dir, sha256}}; {where}"
        )
    for entry in plan:
        _check_file_url(entry.url, yaml_file)
    if not download:
        raise DatasetError(
            f"{yaml_file}: {missing[0]} does not exist and downloading is off; {where}, "
            f"or allow download to fetch {plan[0].url}"
        )
    if not bundled and not (limits or DownloadLimits()).anywhere:
        _check_download_root(root, yaml_file)
    for entry in plan:
        download_dataset(entry.url, entry.dest, sha256=entry.sha256, limits=limits, inside=entry.inside)
    still = [p for p in missing if not p.exists()]
    if still:
        raise DatasetError(f"{yaml_file}: {still[0]} still does not exist after downloading; {where}")


def _load_synthetic(yaml_file: Path, raw: dict, cache_dir: Path) -> DatasetInfo:
    kind = raw.get("synthetic")
    if kind != "shapes":
        raise DatasetError(f"{yaml_file}: synthetic: {excerpt(kind)} is unknown; valid: shapes")
    params = {k: raw.get(k, default) for k, default in synthetic.DEFAULTS.items()}
    for k, (low, high) in _SYNTHETIC_BOUNDS.items():  # checked here: they name the set's folder
        if not isinstance(params[k], int) or isinstance(params[k], bool) or not low <= params[k] <= high:
            raise DatasetError(
                f"{yaml_file}: {k}={excerpt(params[k])} is invalid; it must be an integer from {low} to {high}"
            )
    if raw.get("names") is not None and _parse_names(raw, yaml_file) != synthetic.SHAPE_NAMES:
        raise DatasetError(f"{yaml_file}: names: must be {synthetic.SHAPE_NAMES} for the shapes dataset (or left out)")
    suffix = "" if params == synthetic.DEFAULTS else "-" + "-".join(str(params[k]) for k in synthetic.DEFAULTS)
    root = _ensure_synthetic(cache_dir / f"shapes{suffix}", params)
    generated = _read_yaml(root / "data.yaml")
    lists = {k: _list_split(k, [generated[k]], root, root / "data.yaml")[0] for k in ("train", "val")}
    names = dict(synthetic.SHAPE_NAMES)
    return DatasetInfo(yaml_file, root, lists["train"], lists["val"], None, names, len(names), None, raw)


def _ensure_synthetic(target: Path, params: dict) -> Path:
    """Generate the set into `target` once: under a lock, into a temp folder renamed into place."""
    fp = synthetic.fingerprint(**params)
    if _synthetic_ready(target, fp):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{target.name}.lock", what=f"the generation of {target}"):
        if _synthetic_ready(target, fp):  # another rank finished it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            synthetic.generate_shapes(tmp, **params)
            tmp.chmod(0o755)  # mkdtemp makes it private; the set is for everyone who can read the cache
            if target.exists():  # an older or different set: move it aside, then swap ours in
                stale = target.parent / f".{target.name}.stale-{uuid.uuid4().hex[:8]}"
                os.replace(target, stale)
                os.replace(tmp, target)
                shutil.rmtree(stale, ignore_errors=True)
            else:
                os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _synthetic_ready(target: Path, fp: str) -> bool:
    try:
        return f"fingerprint: {fp}\n" in (target / "data.yaml").read_text()
    except OSError:
        return False
