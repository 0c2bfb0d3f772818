"""Elastic's ``ChildFailedError`` -> one line naming the rank that caused the failure and how it ended."""

from __future__ import annotations

import re
import signal
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from detrain.distributed import dist
from detrain.errors import CheckpointError, ConfigError, DatasetError, DetrainError, DistributedError

DETRAIN_ERRORS = tuple(c.__name__ for c in (DetrainError, ConfigError, DatasetError, CheckpointError, DistributedError))


def signal_stop(e: SignalException) -> KeyboardInterrupt | DistributedError:
    """The launcher stopped by a signal (torch's agent turns SIGINT/SIGTERM into ``SignalException``): SIGINT is a
    Ctrl-C (``KeyboardInterrupt``), any other one line saying which signal stopped it."""
    if e.sigval == signal.SIGINT:
        return KeyboardInterrupt()
    return DistributedError(f"stopped by {signal.Signals(e.sigval).name}; all workers were terminated")


def describe_failure(e: ChildFailedError, max_restarts: int) -> str:
    """One line: the failing rank that caused it, how it ended and its own last words (from the error file).

    Elastic's own choice (earliest timestamp, in whole seconds) often names a rank whose collective merely
    noticed a dead peer; a rank that failed on its own is the root cause, so it is preferred.
    """
    failures = e.failures
    root_rank = _root_rank(failures)
    silent = _SILENT.match(_message(failures[root_rank])) if failures[root_rank].exitcode > 0 else None
    if silent:  # it waited in vain for ranks that stopped (dist.silent_peers_error): those are the story
        parts = [f"{silent.group(1)} stopped responding ({silent.group(2)}, seen by worker rank {root_rank})"]
    else:
        parts = [f"worker rank {root_rank} {_how(failures[root_rank])}"]
    others = sorted(r for r in failures if r != root_rank)
    if others:
        parts.append(f"(also failed: rank {', '.join(map(str, others))})")
    if max_restarts:
        parts.append(f"after max_restarts={max_restarts} restarts")
    return " ".join(parts)


def explained(e: ChildFailedError) -> bool:
    """Whether that one line says it all: the rank that caused the failure raised one of detrain's own errors,
    whose message is written for the user, so elastic's copy of its traceback would add nothing."""
    msg = _message(e.failures[_root_rank(e.failures)])
    return msg.split(":", 1)[0].strip() in DETRAIN_ERRORS


def _root_rank(failures: dict[int, Any]) -> int:
    primary = [r for r, f in failures.items() if not _is_consequence(f)] or list(failures)
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
    which raises gloo's own error when, say, rank 0 left the step on an exception of its own."""
    if message.startswith("DistributedError:"):
        return dist.PEER_LOST_MARK in message
    low = message.lower()
    return "gloo" in low and any(word in low for word in _PEER_GONE)


def _is_consequence(failure: Any) -> bool:
    return failure.exitcode > 0 and is_consequence(_message(failure))


def _how(failure: Any) -> str:
    msg = _message(failure)
    if failure.exitcode < 0:
        return f"was killed by {failure.signal_name()} (exit code {failure.exitcode})"
    if failure.error_file_data and msg and not msg.startswith("To enable traceback"):
        return f"failed (exit code {failure.exitcode}): {msg.splitlines()[0][:300]}"
    return f"exited with code {failure.exitcode} without a Python error (see its output above)"
