"""Which host, node and device each rank runs on, and how the world changed since a previous start.

A node is the launcher's group (``GROUP_RANK``, set by torch's elastic agent and torchrun), else SLURM's node id
(both as :class:`detrain.distributed.world.World` read them), else the host name, numbered in the order of the
lowest rank on it. Two launchers on one machine are two nodes, as the rendezvous sees them. Between starts a node
is known by its host and its launcher's pid (the worker's parent: detrain's launcher, torchrun's agent,
slurmstepd), which its restarts keep, while the numbers torch gives nodes change when the group re-forms.

>>> change = membership_change([{"host": "a", "launcher_pid": 7}, {"host": "b", "launcher_pid": 9}],
...                            [{"host": "a", "launcher_pid": 7}])
>>> change["left"], change["left_nodes"], change["joined_nodes"]
({'b': 1}, [{'host': 'b', 'launcher_pid': 9, 'workers': 1}], [])
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from typing import Any

import torch

from detrain.distributed import dist
from detrain.distributed.world import World


def place(world: World, device: torch.device) -> dict[str, Any]:
    """Where this rank of ``world`` runs: rank, local rank, node key (the node's number as its launcher gives it,
    None where it does not), host, device (and the CUDA device's name), pid, its launcher's pid."""
    where: dict[str, Any] = {
        "rank": world.rank,
        "local_rank": world.local_rank,
        "node_key": world.node_rank,
        "host": socket.gethostname(),
        "device": str(device),
        "pid": os.getpid(),
        "launcher_pid": os.getppid(),
    }
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


def gather_layout(world: World, device: torch.device) -> list[dict[str, Any]]:
    """Every rank's place, numbered by node, on every rank (a collective: call on every rank)."""
    # collective: one all_gather_object of every rank's host and device, once at start
    return number_nodes(dist.all_gather_object(place(world, device)))


def membership_change(previous: list[dict[str, Any]], world: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Who left and who joined since ``previous`` (None: the same nodes): how many workers each host lost or
    gained (``left``, ``joined``), and each node that left or joined with its host, launcher pid and workers
    (``left_nodes``, ``joined_nodes``). Nodes are told apart by launcher where every entry names its launcher (an
    ``events.jsonl`` written before that was recorded: by host alone)."""
    by_launcher = all(type(p.get("launcher_pid")) is int for p in [*previous, *world])
    before, now = Counter(_node(p, by_launcher) for p in previous), Counter(_node(p, by_launcher) for p in world)
    if before == now:
        return None
    hosts_before, hosts_now = Counter(str(p.get("host")) for p in previous), Counter(str(p.get("host")) for p in world)
    return {
        "previous_world_size": len(previous),
        "world_size": len(world),
        "left": dict(sorted((hosts_before - hosts_now).items())),
        "joined": dict(sorted((hosts_now - hosts_before).items())),
        "left_nodes": _nodes(before - now),
        "joined_nodes": _nodes(now - before),
    }


def describe_nodes(nodes: list[dict[str, Any]]) -> str:
    """Nodes of a membership change for people: ``host (launcher pid N): W worker(s)``, or ``-`` for none.

    >>> describe_nodes([{"host": "b", "launcher_pid": 9, "workers": 1}]), describe_nodes([])
    ('b (launcher pid 9): 1 worker(s)', '-')
    """
    return (
        ", ".join(
            f"{n['host']}"
            + (f" (launcher pid {n['launcher_pid']})" if n["launcher_pid"] is not None else "")
            + f": {n['workers']} worker(s)"
            for n in nodes
        )
        or "-"
    )


def _node(place_: dict[str, Any], by_launcher: bool) -> tuple[str, int | None]:
    return str(place_.get("host")), place_["launcher_pid"] if by_launcher else None


def _nodes(counts: Counter[tuple[str, int | None]]) -> list[dict[str, Any]]:
    return [
        {"host": host, "launcher_pid": pid, "workers": n}
        for (host, pid), n in sorted(counts.items(), key=lambda kv: str(kv[0]))
    ]
