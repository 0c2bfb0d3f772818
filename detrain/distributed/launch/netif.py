"""This machine's network interfaces, and the address a run's listeners should bind.

Left alone, torch's rendezvous store listens on every interface (the wildcard address) and gloo on whatever the
hostname resolves to. A run only needs to be reachable where ``master_addr`` is: on loopback when every rank is on
this machine (the default ``master_addr=127.0.0.1``), on the interface that reaches the master otherwise. This
module finds that address and that interface, and checks the ``socket_ifname`` key against the interfaces that
exist here.

>>> listen_address("127.0.0.1", whole_world_here=True)
'127.0.0.1'
>>> interface_of("127.0.0.1")
'lo'
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import socket
import sys

from detrain.errors import DistributedError

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_IFNAME = "NCCL_SOCKET_IFNAME"
_MAX_IFNAME = 15  # IFNAMSIZ - 1 on Linux


def interfaces() -> list[str]:
    """The names of this machine's network interfaces, in the kernel's order.

    Example:
        >>> "lo" in interfaces()
        True
    """
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def check_ifname(value: str) -> str:
    """``socket_ifname`` checked against this machine: every comma-separated name must be an interface here.
    Returns the names joined by commas; a name that does not exist is one line naming it and the ones that do.

    Example:
        >>> check_ifname("lo")
        'lo'
    """
    names = [n.strip() for n in value.split(",")]
    present = interfaces()
    for name in names:
        if name not in present:
            shown = repr(name[:40]) if name else "an empty name"
            raise DistributedError(
                f"socket_ifname={value[:80]!r}: no network interface {shown} on this machine; "
                f"its interfaces are: {', '.join(present) or 'none found'}"
            )
    return ",".join(names)


def ifname_env(value: str) -> dict[str, str]:
    """The variables that make gloo and NCCL use the interfaces of ``socket_ifname`` (already checked).
    NCCL reads its list as prefixes ("eth1" also matches "eth10"); a leading "=" makes it exact.

    Example:
        >>> ifname_env("eth0")
        {'GLOO_SOCKET_IFNAME': 'eth0', 'NCCL_SOCKET_IFNAME': '=eth0'}
    """
    return {GLOO_IFNAME: value, NCCL_IFNAME: f"={value}"}


def resolve(host: str) -> str:
    """The first address ``host`` resolves to (a literal IP is itself); one line naming it when it does not.

    Example:
        >>> resolve("127.0.0.1")
        '127.0.0.1'
    """
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise DistributedError(f"master_addr={host[:100]!r} does not resolve to an address: {reason}") from None
    return str(infos[0][4][0]).split("%", 1)[0]


def is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def listen_address(master_addr: str, whole_world_here: bool) -> str | None:
    """The address the master's store listens on (``master_addr`` resolved), or None to leave torch's default
    (every interface).

    None only for a host *name* that resolves to loopback while ranks run on other machines too: a common
    /etc/hosts entry (``127.0.1.1 gpu07``) makes a node's own name loopback to itself alone, and listening there
    would lock the other nodes out. A loopback address given as such (127.0.0.1, ::1, localhost) means every
    rank is on this machine: nothing else could reach it.

    Example:
        >>> listen_address("127.0.0.1", whole_world_here=False)
        '127.0.0.1'
    """
    ip = resolve(master_addr)
    if is_loopback(ip) and not whole_world_here:
        literal = _is_ip(master_addr) or master_addr.lower().rstrip(".").endswith("localhost")
        return ip if literal else None
    return ip


def node_address(master_addr: str, whole_world_here: bool) -> str | None:
    """This node's address towards the master: where its gloo (and a c10d round's store) should listen; None to
    leave torch's defaults (see ``listen_address``).

    Example:
        >>> node_address("127.0.0.1", whole_world_here=True)
        '127.0.0.1'
    """
    ip = listen_address(master_addr, whole_world_here)
    return None if ip is None else route_source(ip)


def transport_env(master_addr: str, whole_world_here: bool) -> dict[str, str]:
    """The interface variables that keep gloo (and, on one machine, NCCL) on the master's interface: gloo
    otherwise listens on whatever the host name resolves to. NCCL keeps its own choice across machines, where
    a faster network than the master's may exist. Empty when the interface cannot be told.

    Example:
        >>> transport_env("127.0.0.1", whole_world_here=True)
        {'GLOO_SOCKET_IFNAME': 'lo', 'NCCL_SOCKET_IFNAME': '=lo'}
    """
    ip = node_address(master_addr, whole_world_here)
    name = interface_of(ip) if ip else None
    if name is None:
        return {}
    return ifname_env(name) if is_loopback(ip or "") else {GLOO_IFNAME: name}


def route_source(ip: str) -> str | None:
    """This machine's address on the route to ``ip`` (``ip`` itself when it is local), or None without a route.
    A datagram socket's connect only asks the routing table; nothing is sent.

    Example:
        >>> route_source("127.0.0.1")
        '127.0.0.1'
    """
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return str(s.getsockname()[0]).split("%", 1)[0]
    except OSError:
        return None


def interface_of(ip: str) -> str | None:
    """The name of the interface that holds address ``ip``, or None (not an address of this machine, or a
    platform whose interfaces cannot be listed).

    Example:
        >>> interface_of("192.0.2.250") is None   # TEST-NET-1: nobody's address
        True
    """
    want = ipaddress.ip_address(ip)
    for name, addr in addresses():
        if ipaddress.ip_address(addr) == want:
            return name
    return None


def addresses() -> list[tuple[str, str]]:
    """(interface, address) for every IPv4 and IPv6 address of this machine, from getifaddrs(3); empty where the
    C library has no getifaddrs (Windows).

    Example:
        >>> ("lo", "127.0.0.1") in addresses()
        True
    """
    libc_name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        getifaddrs, freeifaddrs = libc.getifaddrs, libc.freeifaddrs
    except (OSError, AttributeError, TypeError):
        return []
    head = ctypes.POINTER(_IfAddrs)()
    if getifaddrs(ctypes.byref(head)) != 0:
        return []
    out: list[tuple[str, str]] = []
    try:
        node = head
        while node:
            entry = node.contents
            if entry.ifa_addr and entry.ifa_name:
                found = _sockaddr_ip(entry.ifa_addr)
                if found:
                    out.append((entry.ifa_name.decode(errors="replace")[:_MAX_IFNAME], found))
            node = entry.ifa_next
    finally:
        freeifaddrs(head)
    return out


class _IfAddrs(ctypes.Structure):
    """``struct ifaddrs`` (the same layout on Linux and the BSDs up to ``ifa_data``)."""


_IfAddrs._fields_ = [
    ("ifa_next", ctypes.POINTER(_IfAddrs)),
    ("ifa_name", ctypes.c_char_p),
    ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.c_void_p),
    ("ifa_netmask", ctypes.c_void_p),
    ("ifa_ifu", ctypes.c_void_p),
    ("ifa_data", ctypes.c_void_p),
]


def _sockaddr_ip(ptr: int) -> str | None:
    """The IP in a ``struct sockaddr``: Linux starts with a 16-bit family; the BSDs with a length byte and a
    family byte. The address sits at byte 4 (IPv4) or 8 (IPv6) in both."""
    head = ctypes.string_at(ptr, 2)
    family = int.from_bytes(head, sys.byteorder) if sys.platform == "linux" else head[1]
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, ctypes.string_at(ptr + 4, 4))
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, ctypes.string_at(ptr + 8, 16))
    return None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return False
    return True
