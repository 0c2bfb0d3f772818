"""The TCP sockets a process listens on, read from /proc: its socket inodes (``/proc/PID/fd``) matched against
the LISTEN entries of ``/proc/PID/net/tcp`` and ``tcp6``.

>>> listening(os.getpid())  # doctest: +SKIP
[('127.0.0.1', 29500)]
"""

from __future__ import annotations

import ipaddress
import os

_LISTEN = "0A"


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on; IPv4-mapped IPv6 shows as IPv4."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:  # no IPv6 here
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == _LISTEN and fields[9] in inodes:
                found.append(_address(fields[1]))
    return found


def _address(hex_addr: str) -> tuple[str, int]:
    """'0100007F:1F90' -> ('127.0.0.1', 8080): the kernel prints each 32-bit word of the address in host order."""
    addr, port = hex_addr.split(":")
    raw = bytes.fromhex(addr)
    ordered = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(ordered)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)
