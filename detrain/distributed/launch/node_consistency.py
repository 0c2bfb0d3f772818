"""Nodes that must be alike, checked once when the group has formed: a node with other code, another torch, another
copy of the dataset, or (elastic nodes) another number of workers is refused with one line before training starts.

Without the check such a node joins without a word: a dataset with one image fewer gives its ranks another number
of batches, so the collectives fall out of step and the run ends in a timeout blamed on a rank that only waited;
another detrain or torch may build another model or take other steps. Every rank gathers every node's record (one
``all_gather_object`` over the group: each node's first process sends its record, the others None) and compares
the same list in the same order, so every rank reaches the same verdict and none waits for another.

A record (:func:`node_record`) holds what must match, in the order the line names a difference: ``detrain`` and
``torch`` (their versions), ``code`` (a hash of the detrain package's source files: it tells two checkouts of one
version apart, and a git commit is shown beside it where the package is a git checkout), ``devices per node`` (the
workers on the node: compared only for elastic nodes, ``nnodes=MIN:MAX``, whose batch is planned for MAX nodes of
this node's size; a fixed node count plans the batch over the world as it is, and SLURM may give nodes different
task counts), the dataset (``train images``, ``val images``, then ``dataset files``: the run manifest's
fingerprint of every image's and label's path and size, from the caller) and ``settings``: the arguments every
rank's steps follow, from the caller (:mod:`detrain.engine.train.shared_settings`; ``parallel=fsdp`` on one node
and ``ddp`` on another would call different collectives), of which the line names the first that differs.

>>> mine = {"detrain": "0.1", "torch": "2.4", "code": "abc", "devices per node": 2}
>>> first_difference([(0, "a", mine), (1, "b", {**mine, "torch": "2.5"})], elastic=False)
"node_rank=1 (host b) differs from node 0 (host a): torch '2.5' there, '2.4' on node 0"
"""

from __future__ import annotations

import functools
import hashlib
import socket
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

import detrain
from detrain.distributed import dist
from detrain.distributed.launch.restart_policy import AgreedStop
from detrain.distributed.world import World
from detrain.system.process_env import without_git_variables

# what must match, in the order a difference is named; "devices per node" only for elastic nodes
COMPARED = (
    "detrain",
    "torch",
    "code",
    "devices per node",
    "train images",
    "val images",
    "dataset files",
    "settings",
)
_SHOWN = 120  # characters of a value the line shows
_SOURCE_SUFFIXES = (".py", ".yaml")
_GIT_TIMEOUT_S = 5.0


class NodesDiffer(AgreedStop):
    """Raised on every rank alike when a node's record differs from node 0's (see the module): no restart mends
    it, so the launcher ends the run with its line (:mod:`restart_policy`)."""


@functools.cache
def code_hash(package_dir: str | None = None) -> str:
    """sha256 (16 hex digits) over the sorted relative paths and contents of the detrain package's source files
    (``.py`` and the packaged model ``.yaml``), read once per process: a few milliseconds for the whole package."""
    root = Path(package_dir or Path(detrain.__file__).parent)
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in _SOURCE_SUFFIXES and "__pycache__" not in p.parts):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@functools.cache
def git_commit() -> str | None:
    """The commit of the git checkout the detrain package lives in (its top folder holds the package), shown beside
    the code hash; None when it is not one or git is absent."""
    here = Path(detrain.__file__).parent.resolve()
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--show-toplevel", "HEAD"],
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            env=without_git_variables(),  # GIT_DIR would name another repository
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != here.parent:
        return None
    return lines[1][:12]


def node_record(world: World, dataset: Mapping[str, Any], settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """This node's record: versions, code, the workers on this node, ``dataset`` (``train images``, ``val
    images``, ``dataset files``) and ``settings`` (the arguments every rank's steps follow, by key), with the host
    and the git commit (shown, not compared)."""
    return {
        "detrain": detrain.__version__,
        "torch": str(torch.__version__),  # a TorchVersion: plain text travels (detrain.distributed.wire)
        "code": code_hash(),
        "devices per node": world.local_world_size,
        **dataset,
        "settings": dict(settings or {}),
        "host": socket.gethostname(),
        "git": git_commit(),
    }


def check_nodes(
    world: World,
    dataset: Callable[[], Mapping[str, Any]],
    *,
    elastic: bool,
    settings: Mapping[str, Any] | None = None,
) -> None:
    """Compare every node's record with node 0's (a collective: call on every rank; ``dataset`` is called on each
    node's first process only). Raises :class:`NodesDiffer` with one line on every rank when one differs."""
    if not world.distributed:
        return
    mine = node_record(world, dataset(), settings) if world.local_rank == 0 else None
    # collective: one all_gather_object of each node's record (None from the other ranks), once at start
    gathered = dist.all_gather_object((world.node_rank, mine))
    records = [(node if node is not None else i, r["host"], r) for i, (node, r) in enumerate(gathered) if r]
    line = first_difference(records, elastic=elastic)
    if line is not None:
        raise NodesDiffer(
            f"{line}; every node of one run needs the same detrain code, torch, dataset and training arguments"
            + (" and the same number of devices (nnodes=MIN:MAX)" if elastic else "")
        )


def first_difference(records: list[tuple[int, str, Mapping[str, Any]]], *, elastic: bool) -> str | None:
    """The first node (in rank order) whose record differs from the first one's (node 0's), and its first
    differing key: ``node_rank=N (host H) differs from node 0 (host h): KEY 'theirs' there, 'ours' on node 0``;
    None when all agree. ``records``: (node number, host, record) per node."""
    if not records:
        return None
    node0, host0, first = records[0]
    keys = [k for k in COMPARED if elastic or k != "devices per node"]
    for node, host, record in records[1:]:
        for key in keys:
            if record.get(key) != first.get(key):
                if key == "settings":  # the first argument that differs, by name
                    detail = _settings_difference(record, first, node0)
                else:
                    detail = f"{key} {_shown(record, key)} there, {_shown(first, key)} on node {node0}"
                return f"node_rank={node} (host {host}) differs from node {node0} (host {host0}): {detail}"
    return None


def _settings_difference(record: Mapping[str, Any], first: Mapping[str, Any], node0: int) -> str:
    """The first argument in which a node's ``settings`` differ from node 0's, with both values."""
    theirs, ours = record.get("settings") or {}, first.get("settings") or {}
    name = next(k for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k))
    return f"{name}={str(theirs.get(name))[:_SHOWN]} there, {name}={str(ours.get(name))[:_SHOWN]} on node {node0}"


def _shown(record: Mapping[str, Any], key: str) -> str:
    value = repr(record.get(key))[:_SHOWN]
    if key == "code" and record.get("git"):
        value += f" (git {record['git']})"
    return value
