"""Two "machines" on one host for the chaos cases that need a real network between nodes: each node runs in its own
network namespace, the two joined by a veth pair (10.231.N.1 on the first, 10.231.N.2 on the second). Setting one
end down drops every packet between them silently, as a cut cable or a dead switch port does: no RST, no ICMP,
nothing the kernel of either node reports, unlike a process that dies on 127.0.0.1.

Needs root (CAP_NET_ADMIN) and iproute2's ``ip``; :func:`available` says whether this machine allows it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field

_IP = shutil.which("ip") or "/usr/sbin/ip"


def _ip(*args: str, ns: str | None = None) -> subprocess.CompletedProcess:
    cmd = [_IP, *(["netns", "exec", ns, _IP] if ns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def available() -> str | None:
    """None when namespaces can be made here, else why not (for a skip message)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not os.path.exists(_IP):
        return "no iproute2 'ip' command"
    name = f"dtprobe{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", name)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()[:200]}"
    _ip("netns", "del", name)
    return None


@dataclass
class Pair:
    """Two namespaces joined by a veth pair; ``exec_prefix(i)`` runs a command in node i's namespace."""

    subnet: int = field(default_factory=lambda: 1 + int(uuid.uuid4().hex[:4], 16) % 250)
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])

    def __post_init__(self) -> None:
        self.names = [f"dt{self.tag}n0", f"dt{self.tag}n1"]
        self.links = [f"dt{self.tag}v0", f"dt{self.tag}v1"]
        self.addrs = [f"10.231.{self.subnet}.1", f"10.231.{self.subnet}.2"]

    def __enter__(self) -> Pair:
        try:
            for ns in self.names:
                self._check(_ip("netns", "add", ns))
                self._check(_ip("link", "set", "lo", "up", ns=ns))
            self._check(_ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1]))
            for ns, link, addr in zip(self.names, self.links, self.addrs):
                self._check(_ip("link", "set", link, "netns", ns))
                self._check(_ip("addr", "add", f"{addr}/24", "dev", link, ns=ns))
                self._check(_ip("link", "set", link, "up", ns=ns))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in self.names:  # deleting a namespace deletes its end of the pair, and so the pair
            _ip("netns", "del", ns)

    @staticmethod
    def _check(proc: subprocess.CompletedProcess) -> None:
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(proc.args)}: {proc.stderr.strip()[:300]}")

    def exec_prefix(self, node: int) -> list[str]:
        return [_IP, "netns", "exec", self.names[node]]

    def cut(self, node: int = 1) -> None:
        """Drop every packet between the two nodes (node ``node``'s end of the cable goes down)."""
        self._check(_ip("link", "set", self.links[node], "down", ns=self.names[node]))

    def mend(self, node: int = 1) -> None:
        self._check(_ip("link", "set", self.links[node], "up", ns=self.names[node]))
