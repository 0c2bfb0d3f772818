"""The rendezvous store's server, listening on one address instead of every interface.

torch's TCPStore server binds the wildcard address whatever host name it is given. On Linux it can instead serve
on a socket that is already bound (``master_listen_fd``): detrain binds one to the master's address and hands it
over. The server is multi-tenant, and torch's rendezvous (static and c10d) asks for a multi-tenant server on the
same port, so it is handed this one rather than binding its own; the caller keeps it alive for the whole launch.

>>> store = host_store("127.0.0.1", 0, bind="127.0.0.1", timeout=timedelta(seconds=5))
>>> store.port > 0
True
"""

from __future__ import annotations

import errno
import socket
import sys
from datetime import timedelta

import torch.distributed as tdist

from detrain.distributed.launch_checks import check_port_free
from detrain.distributed.netif import addresses
from detrain.errors import DistributedError

HANDS_OVER_SOCKETS = sys.platform == "linux"  # TCPStore's master_listen_fd


def host_store(
    addr: str, port: int, *, bind: str | None, timeout: timedelta, world_size: int | None = None
) -> tdist.TCPStore:
    """A TCPStore server for ``addr:port`` (port 0: a free one, read ``.port``) that listens only on ``bind``;
    on every interface, as torch does, where ``bind`` is None or the platform cannot hand a socket over.
    A busy port or an address that is not this machine's is one line."""
    if bind is None or not HANDS_OVER_SOCKETS:
        if port:
            check_port_free(port)
        return tdist.TCPStore(addr, port, world_size, True, timeout, multi_tenant=True)
    sock = bound_socket(addr, bind, port)
    try:
        bound_port = int(sock.getsockname()[1])
        fd = sock.detach()  # the store owns the descriptor from here on and closes it
    finally:
        sock.close()
    return tdist.TCPStore(bind, bound_port, world_size, True, timeout, multi_tenant=True, master_listen_fd=fd)


def bound_socket(addr: str, ip: str, port: int) -> socket.socket:
    """A TCP socket bound to ``ip:port`` (not listening yet), with the options torch's own server sets."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is not busy
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((ip, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise DistributedError(
                f"master_port={port} is already in use on this machine; choose another port or stop what holds it"
            ) from None
        if e.errno == errno.EADDRNOTAVAIL:
            own = ", ".join(sorted({a for _, a in addresses()})) or "none found"
            raise DistributedError(
                f"master_addr={addr[:100]!r} ({ip}) is not an address of this machine, and node_rank=0 hosts the "
                f"rendezvous there; give one of its addresses: {own}"
            ) from None
        raise DistributedError(f"cannot listen on {ip}:{port} (master_addr, master_port): {e.strerror}") from None
    return sock
