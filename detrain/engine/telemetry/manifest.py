"""``manifest.json``: what a run ran with - versions, platform, detrain's git commit and a hash of its installed files
(:func:`code_identity`, for installs without git), a fingerprint of the dataset's
files, the full arguments - written atomically by rank 0 when the run starts, and updated on each restart.

The dataset fingerprint is cheap by default: sha256 over the sorted (path relative to the dataset root, size) of
every train and val image, its label file and the split's COCO json when there is one. It changes when a file is
added, removed, renamed or changes size; it does not read contents (an edit that keeps the size is not seen).
``fingerprint=content`` also hashes every byte of those files (``content-sha256:...``), which sees any edit and
costs one read of the dataset (scripts/bench_fingerprint.py measures it). The weights a run starts from
(``model=`` or ``pretrained=`` naming a .pt) are recorded with their sha256 and size.

>>> m = build_manifest({"epochs": 3}, None)
>>> sorted(m)[:4]
['args', 'code', 'created', 'dataset']
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

import detrain
from detrain.data.labels.verify import img2label_path
from detrain.errors import CheckpointError
from detrain.log import atomic_write_text
from detrain.system.file_tail import read_regular
from detrain.system.process_env import without_git_variables
from detrain.weights.hub import file_sha256, local_weights

MAX_MANIFEST_BYTES = 1 << 20  # an earlier manifest.json larger than this is not read back (a fresh one is written)
GIT_TIMEOUT_S = 5.0


def dataset_fingerprint(
    root: str | Path, images: Iterable[str], extra: Iterable[str] = (), content: bool = False
) -> dict[str, Any]:
    """sha256 over the sorted (relative path, size) of ``images``, their label files (where present) and ``extra``
    files, with ``content`` also each file's own sha256; also the count of files and their total size. A listed
    image that is gone counts with size -1 (and no content)."""
    root = Path(os.path.abspath(root))
    files: dict[tuple[str, int], str] = {}  # (relative path, size) -> the path to read for its content
    for path in images:
        files[(_relative(path, root), _size(path))] = str(path)
        label = img2label_path(path)
        size = _size(label)
        if size >= 0:
            files[(_relative(label, root), size)] = label
    for path in extra:
        files[(_relative(path, root), _size(path))] = str(path)
    h = hashlib.sha256()
    for rel, size in sorted(files):
        # the paths fingerprint's line is "rel\0size\n", as it always was; content adds each file's own sha256
        line = f"{rel}\0{size}\n"
        if content:
            line = f"{rel}\0{size}\0{_content_sha256(files[(rel, size)]) if size >= 0 else ''}\n"
        h.update(line.encode("utf-8", "surrogateescape"))
    return {
        "fingerprint": f"{'content-sha256' if content else 'sha256'}:{h.hexdigest()}",
        "files": len(files),
        "bytes": sum(size for _, size in files if size > 0),
    }


def same_kind(a: str, b: str) -> bool:
    """Whether two fingerprints were made the same way (paths, or content), so comparing them means something.

    >>> same_kind("sha256:ab", "sha256:cd"), same_kind("sha256:ab", "content-sha256:ab")
    (True, False)
    """
    return a.split(":", 1)[0] == b.split(":", 1)[0]


def starting_weights(args: dict[str, Any]) -> dict[str, Any] | None:
    """The weights files a run starts from (``model=`` and ``pretrained=`` when they name a .pt): the name given,
    the file found (as the builder finds it: the path, else the current folder or the weights cache for a release
    name), its sha256 and size; None for a run that starts from a yaml alone. A file that cannot be read is
    recorded with ``sha256`` null."""
    out: dict[str, Any] = {}
    for key in ("model", "pretrained"):
        value = args.get(key)
        if not isinstance(value, str) or not value.endswith((".pt", ".pth")):
            continue
        path = local_weights(value)
        record: dict[str, Any] = {"name": value, "path": None, "sha256": None, "bytes": None}
        if path is not None:
            record.update(path=str(path.absolute()), bytes=_size(path), sha256=_content_sha256(str(path)) or None)
        out[key] = record
    return out or None


def _content_sha256(path: str) -> str:
    """A file's sha256 (:func:`detrain.weights.hub.file_sha256`: a regular file only), "" when it cannot be read
    (gone, a FIFO, a device)."""
    try:
        return file_sha256(path)
    except (OSError, CheckpointError):
        return ""


def split_fingerprint(datasets: Iterable[Any], content: bool = False) -> dict[str, Any]:
    """The fingerprint of the train and val splits of loaded :class:`~detrain.data.prepare.SplitData` objects."""
    datasets = list(datasets)
    info = datasets[0].info
    images: list[str] = []
    jsons: list[str] = []
    for d in datasets:
        images += list(getattr(d.info, d.split) or [])
        json_file = (d.info.coco_json or {}).get(d.split)
        if json_file:
            jsons.append(str(json_file))
    fingerprint = dataset_fingerprint(info.root, images, jsons, content)
    return {"yaml": str(info.yaml_file), "root": str(info.root), **fingerprint}


def dataset_identity(datasets: Iterable[Any]) -> dict[str, Any]:
    """What every node's copy of the dataset must share (:mod:`detrain.distributed.launch.node_consistency`): the number
    of images of each split and the fingerprint of :func:`split_fingerprint`.

    >>> from types import SimpleNamespace as NS
    >>> info = NS(train=[], val=[], coco_json=None, yaml_file="d.yaml", root=".")
    >>> dataset_identity([NS(info=info, split="train"), NS(info=info, split="val")])["train images"]
    0
    """
    datasets = list(datasets)
    counts = {f"{d.split} images": len(getattr(d.info, d.split) or []) for d in datasets}
    return {**counts, "dataset files": split_fingerprint(datasets)["fingerprint"]}


def versions() -> dict[str, Any]:
    """detrain's, Python's and the libraries' versions; CUDA, cuDNN and NCCL where this torch has them."""
    out: dict[str, Any] = {
        "detrain": detrain.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cuda": torch.version.cuda,
        "cudnn": None,
        "nccl": None,
    }
    try:  # its installed version, not `import torchvision`, which costs a process ~2 s of CPU
        out["torchvision"] = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        out["torchvision"] = None
    if torch.backends.cudnn.is_available():
        out["cudnn"] = torch.backends.cudnn.version()
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - a build without NCCL
            pass
    return out


def git_commit(package_dir: str | Path | None = None) -> dict[str, Any] | None:
    """The commit (and whether the tree has changes) of the git checkout detrain itself lives in: the checkout
    whose top folder holds the ``detrain`` package. None when it is not in one, git is absent or says no."""
    here = Path(package_dir or Path(detrain.__file__).parent).resolve()
    env = without_git_variables()  # GIT_DIR would name another repository
    try:
        top = _git(here, env, "rev-parse", "--show-toplevel")
        if top is None or Path(top).resolve() != here.parent:
            return None  # not a checkout, or a package installed inside some other project's repository
        commit = _git(here, env, "rev-parse", "HEAD")
        if commit is None:
            return None
        changes = _git(here, env, "status", "--porcelain", "--untracked-files=no")
        return {"commit": commit, "dirty": None if changes is None else bool(changes)}
    except (OSError, subprocess.SubprocessError):
        return None


@functools.lru_cache(maxsize=1)
def code_identity(package_dir: str | None = None) -> dict[str, Any]:
    """What code ran, with any install (a checkout, ``pip install .``, a wheel): sha256 over the sorted relative
    paths and contents of every file of the installed ``detrain`` package (compiled caches left out), and how many.
    Two installs of the same source give the same hash; any edit changes it. Read once per process (~2 MB)."""
    root = Path(package_dir or Path(detrain.__file__).parent).resolve()
    h = hashlib.sha256()
    count = 0
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        if path.suffix in (".pyc", ".pyo"):
            continue
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
        count += 1
    return {"sha256": h.hexdigest(), "files": count}


def build_manifest(args: dict[str, Any], dataset: dict[str, Any] | None) -> dict[str, Any]:
    """A fresh manifest for a run started now with ``args``."""
    now = _now()
    v = versions()
    return {
        "detrain": v.pop("detrain"),
        "created": now,
        "updated": now,
        "versions": v,
        "platform": platform.platform(),
        "git": git_commit(),
        "code": code_identity(),
        "dataset": dataset,
        "weights": starting_weights(args),
        "args": args,
        "restarts": 0,
        "launcher_restart_count": 0,
        "resumed_from": None,
    }


def read_manifest(path: str | Path) -> dict[str, Any] | None:
    """An earlier manifest.json as a dict; None when absent, not a regular file, too large or not a JSON object."""
    raw = read_regular(path, MAX_MANIFEST_BYTES, tail=False)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def write_start(
    path: str | Path,
    args: dict[str, Any],
    dataset: dict[str, Any] | None,
    *,
    restarted: bool,
    launcher_restarts: int,
    resumed_from: str | None,
) -> dict[str, Any]:
    """Write the manifest of a start: fresh on a first start; on a restart the earlier one (when readable) with
    its restart count raised, ``launcher_restart_count`` and ``resumed_from`` set. Returns what was written."""
    earlier = read_manifest(path) if restarted else None
    manifest = earlier if earlier is not None else build_manifest(args, dataset)
    if restarted:
        manifest["restarts"] = (_count(manifest.get("restarts")) + 1) if earlier is not None else 1
        manifest["launcher_restart_count"] = launcher_restarts
        manifest["resumed_from"] = resumed_from
        manifest["updated"] = _now()
    atomic_write_text(path, json.dumps(manifest, indent=2, default=str) + "\n")
    return manifest


def _count(value: Any) -> int:
    """An earlier manifest's count, if it is one (it is read back, so anything may stand there)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _git(cwd: Path, env: dict[str, str], *args: str) -> str | None:
    proc = subprocess.run(
        ["git", "-C", str(cwd), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=GIT_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    return proc.stdout.strip() if proc.returncode == 0 else None


def _relative(path: str | os.PathLike[str], root: Path) -> str:
    p = Path(os.path.abspath(path))
    try:
        return p.relative_to(root).as_posix()
    except ValueError:
        return p.as_posix()  # outside the dataset root (a list file may name any path): absolute


def _size(path: str | os.PathLike[str]) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")
