"""Which job a node belongs to: the run id, and the check that keeps two jobs that share a master and port apart.

The master (node_rank 0) publishes its run id in the rendezvous store before anything else. Every other node reads
it before it joins: a different id ends that node with one line naming both ids, and the node leaves a record of
its visit, so that a master waiting for a fixed number of nodes ends with the same line instead of going on
waiting. Nodes of one job wait for the master's word that all of them came before they start.

``run_id=''`` (the default) derives the id from the arguments every node of one job gives alike, which the caller
passes: all of them but those a node may give differently (the keys ``config/keys.py`` marks ``per_node``:
``Cfg.node_shared()``; this layer takes plain values, never a Cfg). When both ids are derived, the line also names
the arguments that differ.

>>> derive("train", {"epochs": 3}) == derive("train", {"epochs": 3}) != derive("val", {"epochs": 3})
True
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import timedelta
from typing import Any

import torch.distributed as tdist

from detrain.distributed.launch.master_store import SECRET_ENV, Unsealed, sealed
from detrain.errors import DistributedError
from detrain.log import console

_KEYS = "detrain/run/"
_ID, _ARGS, _COUNT, _VERDICT = (f"{_KEYS}{k}" for k in ("id", "args", "arrivals", "verdict"))
_GO = "go"
_POLL_S = 0.2
_MAX_RECORD = 1 << 16  # bytes: a record from the network larger than any detrain writes is not one of ours


def shared_args(task: str, alike: dict[str, Any]) -> dict[str, Any]:
    """The task and ``alike`` (the arguments every node of one job must give alike), as JSON values."""
    shared = {"task": task, **alike}
    result: dict[str, Any] = json.loads(json.dumps(shared, sort_keys=True, default=str))
    return result


def derive(task: str, alike: dict[str, Any]) -> str:
    """The run id of ``run_id=''``: a hash of ``shared_args``.

    Example:
        >>> derive("train", {"epochs": 3}) != derive("train", {"epochs": 4})
        True
    """
    text = json.dumps(shared_args(task, alike), sort_keys=True)
    return "auto-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def host(store: tdist.Store, run_id: str, args: dict[str, Any] | None) -> None:
    """On the master: publish this job's run id (and, for a derived id, the arguments it came from)."""
    if args is not None:
        store.set(_ARGS, json.dumps(args, sort_keys=True))
    store.set(_ID, run_id)


def wait_for_nodes(
    store: tdist.Store, run_id: str, args: dict[str, Any] | None, count: int, timeout_s: float, where: str
) -> None:
    """On the master: wait until ``count`` other nodes of this job have come, then tell them to go. A node with
    another run id ends the wait with one line naming both ids (the nodes that came are told to stop too)."""
    deadline = time.monotonic() + timeout_s
    came: set[int] = set()
    seen = 0
    try:
        while len(came) < count:
            arrived = int(store.add(_COUNT, 0))
            while seen < arrived and store.check([f"{_KEYS}arrival/{seen}"]):
                try:
                    theirs, node_rank, their_args = _arrival(store.get(f"{_KEYS}arrival/{seen}"))
                except Unsealed:  # written without this run's secret: not a node of this run, and not a reason to stop
                    console.print(f"warning: a process without this run's secret tried to join at {where}; ignored")
                    seen += 1
                    continue
                seen += 1
                if theirs != run_id:
                    raise DistributedError(
                        f"node_rank={node_rank} came with run_id={theirs!r}, but this master's run_id is {run_id!r}: "
                        f"a node of another job was turned away and this job stops; give every node of one job the "
                        f"same run_id (and each job its own master_port){_differences(args, their_args, 'node')}"
                    )
                came.add(node_rank)
            if len(came) >= count:
                break
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"could not form the group at {where} (node_rank=0): {len(came)} of {count} other node(s) came "
                    f"within {timeout_s:g}s"
                )
            time.sleep(_POLL_S)
    except DistributedError as e:
        store.set(_VERDICT, f"stop: {e}")
        raise
    store.set(_VERDICT, _GO)


def join(
    addr: str,
    port: int,
    run_id: str,
    node_rank: int,
    args: dict[str, Any] | None,
    *,
    wait_go: bool,
    connect_timeout_s: float,
    start_timeout_s: float,
    secret: str = "",
) -> None:
    """On every other node: compare this node's run id with the master's before joining; with ``wait_go`` (a
    fixed number of nodes) then wait for the master's word that all of them came. Every value is sealed with
    ``secret`` (:class:`detrain.distributed.launch.master_store.SealedStore`): a master whose values it does not open
    seals them with another secret, and this node ends with one line saying so."""
    where = f"{addr}:{port}"
    try:
        client = tdist.TCPStore(addr, port, None, False, timedelta(seconds=max(1.0, connect_timeout_s)))
    except Exception as e:  # noqa: BLE001 - any failure to connect is the same story for the user
        raise DistributedError(f"cannot reach the rendezvous at {where}: {_first_line(e)}") from None
    store = sealed(client, secret)
    try:
        try:
            theirs = _read(store, _ID, connect_timeout_s, where, "publish its run_id")[:200]
        except Unsealed:
            raise DistributedError(
                f"the master at {where} seals its rendezvous with another secret than this node's {SECRET_ENV} "
                f"(node_rank={node_rank}): give every node the value node_rank=0 was given or printed"
            ) from None
        index = int(store.add(_COUNT, 1)) - 1
        store.set(f"{_KEYS}arrival/{index}", json.dumps({"run_id": run_id, "node_rank": node_rank, "args": args}))
        if theirs != run_id:
            their_args = _json(store.get(_ARGS)) if args is not None and store.check([_ARGS]) else None
            raise DistributedError(
                f"run_id={run_id!r} of this node (node_rank={node_rank}) differs from run_id={theirs!r} of the master "
                f"at {where}: it hosts another job, so this node does not join it; give every node of one job the "
                f"same run_id{_differences(args, their_args, 'master')}"
            )
        if wait_go:
            verdict = _read(store, _VERDICT, start_timeout_s, where, "see every node of this job")
            if verdict != _GO:
                reason = _printable(verdict.removeprefix("stop: "))
                raise DistributedError(f"the master at {where} stopped before the group formed: {reason}")
    except DistributedError:
        raise
    except Exception as e:  # noqa: BLE001 - the master went away (its own output says why)
        raise DistributedError(f"lost the master at {where} before the group formed: {_first_line(e)}") from None
    finally:
        del store, client


def _read(store: tdist.Store, key: str, timeout_s: float, where: str, what: str) -> str:
    """A short text value from the master, once it is there; checked in small steps so Ctrl-C stays prompt."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() >= deadline:
            raise DistributedError(f"the master at {where} did not {what} within {timeout_s:g}s")
        time.sleep(_POLL_S)
    raw = store.get(key)
    return raw[:_MAX_RECORD].decode(errors="replace")


def _arrival(raw: bytes) -> tuple[str, int, Any]:
    """(run id, node_rank, the arguments of a derived id) from a node's record; a record detrain did not write
    is one line."""
    try:
        record = _json(raw)
        theirs, node_rank = record["run_id"], record["node_rank"]
        if not isinstance(theirs, str) or type(node_rank) is not int:
            raise ValueError
    except (ValueError, TypeError, KeyError):
        shown = raw[:60].decode(errors="replace")
        raise DistributedError(
            f"something that is not a detrain node wrote {shown!r} into the rendezvous (another program on "
            f"master_port?); this job stops"
        ) from None
    return theirs[:200], node_rank, record.get("args")


def _json(raw: bytes) -> Any:
    """A JSON value from the network, no larger than any detrain writes (ValueError otherwise)."""
    if len(raw) > _MAX_RECORD:
        raise ValueError("record too large")
    return json.loads(raw)


def _differences(mine: dict[str, Any] | None, theirs: Any, whose: str) -> str:
    """Where both ids are derived from the arguments: the ones that differ from ``whose`` (the other side's)."""
    if mine is None or not isinstance(theirs, dict):
        return ""
    differ = sorted(k for k in mine if mine[k] != theirs.get(k))  # only this side's own key names are shown
    if not differ:
        return ""
    shown = ", ".join(differ[:5]) + (", ..." if len(differ) > 5 else "")
    return f" (the id is derived from the arguments, and these differ from the {whose}'s: {shown})"


def _printable(text: str) -> str:
    """Text from the network, safe to print on one line: no control characters, bounded."""
    return "".join(c if c.isprintable() else "?" for c in text[:300])


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]
