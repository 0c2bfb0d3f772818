"""Elastic's ``ChildFailedError`` -> one line naming the rank that caused the failure and how it ended (on NCCL, with
what its watchdog logged before it ended a rank: :mod:`detrain.distributed.launch.nccl_watch`)."""

from __future__ import annotations

import re
import signal
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from detrain.distributed import dist
from detrain.distributed.launch import nccl_watch
from detrain.distributed.launch.nccl_watch import WatchdogFinding
from detrain.errors import CheckpointError, ConfigError, DatasetError, DetrainError, DistributedError

DETRAIN_ERRORS = tuple(c.__name__ for c in (DetrainError, ConfigError, DatasetError, CheckpointError, DistributedError))


def signal_stop(e: SignalException) -> KeyboardInterrupt | DistributedError:
    """The launcher stopped by a signal (torch's agent turns SIGINT/SIGTERM into ``SignalException``): SIGINT is a
    Ctrl-C (``KeyboardInterrupt``), any other one line saying which signal stopped it."""
    if e.sigval == signal.SIGINT:
        return KeyboardInterrupt()
    return DistributedError(f"stopped by {signal.Signals(e.sigval).name}; all workers were terminated")


def describe_failure(
    e: ChildFailedError,
    max_restarts: int,
    nccl: dict[int, WatchdogFinding] | None = None,
    stopped: dict[int, float] | None = None,
) -> str:
    """One line: the failing rank that caused it, how it ended and its own last words (from the error file).

    Elastic's own choice (earliest timestamp, in whole seconds) often names a rank whose collective merely
    noticed a dead peer; a rank that failed on its own is the root cause, so it is preferred. ``nccl``: what NCCL's
    watchdog logged before it ended ranks (:mod:`detrain.distributed.launch.nccl_watch`), a rank whose collective timed
    out being such a consequence too; ``stopped``: the ranks whose heartbeat stopped well before the others', with by
    how much (:func:`detrain.distributed.heartbeat.stopped_early`), named as the cause of such a timeout.
    """
    failures, nccl = e.failures, nccl or {}
    root_rank = _root_rank(failures, nccl)
    root = failures[root_rank]
    silent = _SILENT.match(_message(root)) if root.exitcode > 0 else None
    finding = nccl.get(root_rank) if root.exitcode < 0 else None
    if silent:  # it waited in vain for ranks that stopped (dist.silent_peers_error): those are the story
        parts = [f"{silent.group(1)} stopped responding ({silent.group(2)}, seen by worker rank {root_rank})"]
    elif finding is not None:
        parts = [_ended_by_watchdog(root_rank, root, finding, stopped or {})]
    else:
        parts = [f"worker rank {root_rank} {_how(root)}"]
    others = sorted(r for r in failures if r != root_rank)
    if others:
        parts.append(f"(also failed: rank {', '.join(map(str, others))})")
    if max_restarts:
        parts.append(f"after max_restarts={max_restarts} restarts")
    return " ".join(parts)


def _ended_by_watchdog(rank: int, failure: Any, finding: WatchdogFinding, stopped: dict[int, float]) -> str:
    """A rank that NCCL's watchdog ended: the ranks that stopped first where the heartbeats tell (as on gloo), else
    the watchdog's finding and the signal."""
    if finding.waited and stopped:
        ranks = sorted(stopped)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        lead = min(stopped.values())
        return (
            f"{who} stopped responding (its heartbeat stopped {lead:g}s before the others'; {finding.text}, seen by "
            f"worker rank {rank})"
        )
    cause = f" {dist.PEER_LOST_MARK}" if finding.waited else ""
    return f"worker rank {rank} was ended ({failure.signal_name()}) by {finding.text}{cause}"


def explained(e: ChildFailedError) -> bool:
    """Whether that one line says it all: the rank that caused the failure raised one of detrain's own errors,
    whose message is written for the user, so elastic's copy of its traceback would add nothing."""
    msg = _message(e.failures[_root_rank(e.failures, {})])
    return msg.split(":", 1)[0].strip() in DETRAIN_ERRORS


def _root_rank(failures: dict[int, Any], nccl: dict[int, WatchdogFinding]) -> int:
    primary = [r for r, f in failures.items() if not _is_consequence(f, nccl.get(r))] or list(failures)
    return min(primary, key=lambda r: (failures[r].timestamp, r))


def _message(failure: Any) -> str:
    msg = failure.message
    if isinstance(msg, dict):  # written by @record: {"message": "Type: text", "extraInfo": {...}}
        msg = msg.get("message", "")
    return str(msg).strip()


_SILENT = re.compile(r"DistributedError: (ranks? [\d, ]+) stopped responding: (no heartbeat for [\d.]+s)")

# gloo's own words when the other end of a connection went away (as ``dist._cause`` reads them); its messages
# start with its source file ("[.../gloo/transport/tcp/pair.cc:561] Connection closed by peer ...")
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe")


def is_consequence(message: str) -> bool:
    """Whether a worker's error (``"Type: text"``) only says that another rank was gone: one of ``dist``'s
    collectives (see ``dist._cause``), or one inside torch that ``dist`` does not wrap (DDP's gradient all-reduce),
    which raises gloo's own error (or NCCL's, :func:`nccl_watch.peer_gone`) when, say, rank 0 left the step on an
    exception of its own."""
    if message.startswith("DistributedError:"):
        return dist.PEER_LOST_MARK in message
    low = message.lower()
    return ("gloo" in low and any(word in low for word in _PEER_GONE)) or nccl_watch.peer_gone(message)


def _is_consequence(failure: Any, finding: WatchdogFinding | None = None) -> bool:
    """A Python error that only says a peer was gone, or an end by NCCL's watchdog after a collective waited in
    vain for the other ranks."""
    if failure.exitcode < 0:
        return finding is not None and finding.waited
    return failure.exitcode > 0 and is_consequence(_message(failure))


def _how(failure: Any) -> str:
    msg = _message(failure)
    if failure.exitcode < 0:
        return f"was killed by {failure.signal_name()} (exit code {failure.exitcode})"
    if failure.error_file_data and msg and not msg.startswith("To enable traceback"):
        return f"failed (exit code {failure.exitcode}): {msg.splitlines()[0][:300]}"
    return f"exited with code {failure.exitcode} without a Python error (see its output above)"
