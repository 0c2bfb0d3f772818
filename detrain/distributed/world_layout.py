"""Which host, node and device each rank runs on, and how the world changed since a previous start.

A node is the launcher's group (``GROUP_RANK``, set by torch's elastic agent and torchrun), else SLURM's node id,
else the host name, numbered in the order of the lowest rank on it. Two launchers on one machine are two
nodes, as the rendezvous sees them.

>>> membership_change([{"host": "a"}, {"host": "b"}], [{"host": "a"}])
{'previous_world_size': 2, 'world_size': 1, 'left': {'b': 1}, 'joined': {}}
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from typing import Any

import torch

from detrain.distributed import dist


def node_key() -> str | None:
    """This process's node as its launcher numbers it (None outside a launcher that says)."""
    for var in ("GROUP_RANK", "SLURM_NODEID"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return value
    return None


def place(device: torch.device) -> dict[str, Any]:
    """Where this rank runs: rank, local rank, node key, host, device (and the CUDA device's name), pid."""
    where: dict[str, Any] = {"rank": dist.rank(), "local_rank": dist.local_rank(), "node_key": node_key(),
                             "host": socket.gethostname(), "device": str(device), "pid": os.getpid()}
    if device.type == "cuda":
        where["device_name"] = torch.cuda.get_device_name(device)
    return where


def number_nodes(places: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``places`` (in rank order) with ``node``: 0, 1, ... in the order of each node's lowest rank."""
    ids: dict[Any, int] = {}
    out = []
    for p in places:
        key = ("launcher", p.get("node_key")) if p.get("node_key") is not None else ("host", p.get("host"))
        ids.setdefault(key, len(ids))
        out.append({k: v for k, v in p.items() if k != "node_key"} | {"node": ids[key]})
    return out


def gather_layout(device: torch.device) -> list[dict[str, Any]]:
    """Every rank's place, numbered by node, on every rank."""
    # collective: one all_gather_object of every rank's host and device, once at start
    return number_nodes(dist.all_gather_object(place(device)))


def membership_change(previous: list[dict[str, Any]], world: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Who left and who joined, by host (how many workers each host lost or gained), when the world size differs
    from ``previous``'s; None when it does not."""
    if len(previous) == len(world):
        return None
    before = Counter(str(p.get("host")) for p in previous)
    now = Counter(str(p.get("host")) for p in world)
    return {"previous_world_size": len(previous), "world_size": len(world),
            "left": dict(sorted((before - now).items())), "joined": dict(sorted((now - before).items()))}
