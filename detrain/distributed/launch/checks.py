"""Checks ``launch`` makes before any worker starts: rendezvous settings, the entry function, the master port
(free here, reachable from the other nodes), and the node count; each failure is one clear line."""

from __future__ import annotations

import errno
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from detrain.errors import DistributedError


def parse_nnodes(nnodes: str | int) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4), like torchrun's ``--nnodes``.

    Example:
        >>> parse_nnodes("1:4")
        (1, 4)
    """
    text = str(nnodes).strip()
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if lo < 1 or hi < lo:
        raise DistributedError(f"nnodes={text!r} is not valid; use a node count like 2 or a range MIN:MAX like 1:4")
    return lo, hi


def rendezvous_settings(
    lo: int, hi: int, node_rank: int, addr: str, port: int, backend: str | None
) -> tuple[str, str, dict[str, Any]]:
    """Check the node and rendezvous settings; return (rendezvous backend, endpoint, its configs).

    Example:
        >>> rendezvous_settings(1, 1, 0, "127.0.0.1", 29500, None)
        ('static', '127.0.0.1:29500', {'rank': 0})
    """
    if not 0 <= node_rank < hi:
        shown = str(lo) if lo == hi else f"{lo}:{hi}"
        raise DistributedError(f"node_rank={node_rank} must be in 0..{hi - 1} for nnodes={shown}")
    if not 0 <= port <= 65535:
        raise DistributedError(f"master_port={port} is not a TCP port (0..65535)")
    if hi > 1 and not port:
        raise DistributedError("several nodes need master_port=PORT (the same free port on every node)")
    if backend not in (None, "static", "c10d"):
        raise DistributedError(f"rdzv_backend={backend!r} is not supported; use static or c10d")
    if lo != hi and backend == "static":
        raise DistributedError(f"nnodes={lo}:{hi} is elastic and needs rdzv_backend=c10d, not static")
    if backend is None or (backend == "static" and not port and hi == 1):
        # Static rendezvous needs a known port; launch binds master_port=0 to a free one before it asks here
        # again, so only a direct caller with port 0 gets c10d, whose store then binds a free port itself.
        backend = "static" if lo == hi and port else "c10d"
    endpoint = f"{addr}:{port}"
    if backend == "static":
        return backend, endpoint, {"rank": node_rank}
    # Name the host explicitly: guessing from hostnames fails for two "nodes" on one machine.
    return backend, endpoint, {"is_host": node_rank == 0} if port else {}


def check_entry(entry: Callable[..., Any]) -> None:
    qual = getattr(entry, "__qualname__", "")
    module = getattr(entry, "__module__", None)
    # A notebook's __main__ has no file, so spawned workers cannot import what was defined there.
    no_file = module == "__main__" and not getattr(sys.modules.get("__main__"), "__file__", None)
    if "<lambda>" in qual or "<locals>" in qual or not module or no_file:
        raise DistributedError(
            f"entry {qual or entry!r} cannot be sent to spawned workers; "
            "use a top-level function of an importable module"
        )


def check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # Same option as torch's TCPStore, so a port in TIME_WAIT is not reported as busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                raise DistributedError(
                    f"master_port={port} is already in use on this machine; choose another port or stop what holds it"
                ) from None
            raise DistributedError(f"cannot listen on master_port={port}: {e.strerror}") from None


def wait_reachable(addr: str, port: int, timeout_s: float) -> None:
    """Retry a TCP connect to the master until ``timeout_s``: nodes may start in any order."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            with socket.create_connection((addr, port), timeout=min(5.0, max(0.1, timeout_s))):
                return
        except OSError as e:
            last = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise DistributedError(
                f"cannot reach the master at {addr}:{port} within {timeout_s:g}s ({last}); "
                "start node_rank=0 first and check master_addr, master_port and the firewall"
            )
        time.sleep(0.5)
