"""Elastic's ``ChildFailedError`` -> one line naming the rank that caused the failure and how it ended."""

from __future__ import annotations

from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from detrain import dist
from detrain.errors import CheckpointError, ConfigError, DatasetError, DetrainError, DistributedError

DETRAIN_ERRORS = tuple(c.__name__ for c in (DetrainError, ConfigError, DatasetError, CheckpointError, DistributedError))


def describe_failure(e: ChildFailedError, max_restarts: int) -> str:
    """One line: the failing rank that caused it, how it ended and its own last words (from the error file).

    Elastic's own choice (earliest timestamp, in whole seconds) often names a rank whose collective merely
    noticed a dead peer; a rank that failed on its own is the root cause, so it is preferred.
    """
    failures = e.failures
    root_rank = _root_rank(failures)
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


def _is_consequence(failure: Any) -> bool:
    """A rank whose collective failed because another rank was gone (see ``dist._cause``)."""
    msg = _message(failure)
    return failure.exitcode > 0 and msg.startswith("DistributedError:") and dist.PEER_LOST_MARK in msg


def _how(failure: Any) -> str:
    msg = _message(failure)
    if failure.exitcode < 0:
        return f"was killed by {failure.signal_name()} (exit code {failure.exitcode})"
    if failure.error_file_data and msg and not msg.startswith("To enable traceback"):
        return f"failed (exit code {failure.exitcode}): {msg.splitlines()[0][:300]}"
    return f"exited with code {failure.exitcode} without a Python error (see its output above)"
