"""The rendezvous store's server, listening on one address instead of every interface.

torch's TCPStore server binds the wildcard address whatever host name it is given. On Linux it can instead serve
on a socket that is already bound (``master_listen_fd``): detrain binds one to the master's address and hands it
over. The server is multi-tenant, and torch's rendezvous (static and c10d) asks for a multi-tenant server on the
same port, so it is handed this one rather than binding its own; the caller keeps it alive for the whole launch.

Every value detrain and torch's rendezvous put in that store is sealed with the run's secret (:class:`SealedStore`):
a TCPStore has no password, and anyone who can reach its port can list its keys (``list_keys``) and read, write
or delete any of them. Sealed, a value is unreadable without the secret, and one written without it (or changed)
is refused on reading, one line naming the key; so a process without the secret learns nothing of the run from
the store (the addresses of the ranks, the run id and arguments, the rendezvous state) and cannot join it. Key
names and counters (``add``: heartbeats, barrier arrivals) stay readable; nothing in them is secret. The secret
is the launcher's own for a run on one machine, and ``DETRAIN_RUN_SECRET`` (the same on every node, given like
``master_addr``) for several (:func:`run_secret`).

>>> store = host_store("127.0.0.1", 0, bind="127.0.0.1", timeout=timedelta(seconds=5))
>>> store.port > 0
True
>>> sealed = SealedStore(store, "0123456789abcdef0123")
>>> sealed.set("run/id", "job-7"); sealed.get("run/id"), store.get("run/id")[:4]
(b'job-7', b'DTS1')
>>> SealedStore(store, "another secret 0123").get("run/id")
Traceback (most recent call last):
    ...
detrain.distributed.launch.master_store.Unsealed: the value of 'run/id' in the rendezvous store is not sealed with \
this run's secret (DETRAIN_RUN_SECRET): a process without it wrote it, or this one was given another; refused
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import io
import os
import pickle
import secrets
import socket
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as tdist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo

from detrain.distributed.launch.checks import check_port_free
from detrain.distributed.launch.netif import addresses
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


# ------------------------------------------------------------------------------------------- the run secret

SECRET_ENV = "DETRAIN_RUN_SECRET"
_MAKE_ONE = "python -c 'import secrets; print(secrets.token_hex(16))' makes one"


def new_secret() -> str:
    """A fresh run secret: 32 hex digits (128 random bits)."""
    return secrets.token_hex(16)


def check_secret(value: str) -> str:
    """``value`` as a run secret: 16 to 256 printable ASCII characters, no spaces (one line otherwise, without the
    value itself).

    >>> check_secret("short")
    Traceback (most recent call last):
        ...
    detrain.errors.DistributedError: DETRAIN_RUN_SECRET must be 16 to 256 printable characters without spaces, \
and it has 5; python -c 'import secrets; print(secrets.token_hex(16))' makes one
    """
    if not 16 <= len(value) <= 256 or not value.isascii() or not value.isprintable() or " " in value:
        raise DistributedError(
            f"{SECRET_ENV} must be 16 to 256 printable characters without spaces, and it has {len(value)}; {_MAKE_ONE}"
        )
    return value


def run_secret(env: Mapping[str, str]) -> str | None:
    """The run secret ``env`` gives (``DETRAIN_RUN_SECRET``, checked), or None."""
    value = env.get(SECRET_ENV, "")
    return check_secret(value) if value else None


def missing_secret(node_rank: int) -> DistributedError:
    """The one line of a node other than node 0 of a run of several nodes that was given no secret."""
    return DistributedError(
        f"node_rank={node_rank} of a run of several nodes needs the run's secret: set {SECRET_ENV} in its "
        f"environment to the value node_rank=0 was given or printed (given to every node like master_addr; "
        f"{_MAKE_ONE})"
    )


# ------------------------------------------------------------------------------------------ sealed values

_MARK = b"DTS1"
_TAG = 16  # bytes of the synthetic IV, which is also the value's MAC


class Unsealed(DistributedError):
    """A value in the store that this run's secret did not seal: written without it, changed, or another run's."""

    def __init__(self, key: str) -> None:
        super().__init__(
            f"the value of {key[:120]!r} in the rendezvous store is not sealed with this run's secret ({SECRET_ENV}): "
            "a process without it wrote it, or this one was given another; refused"
        )


class SealedStore(tdist.Store):
    """``inner`` (a TCPStore, or a PrefixStore over one) with every value sealed by ``secret``: encrypted and
    authenticated, bound to its key (a value moved to another key is refused too).

    Deterministic authenticated encryption (SIV): the tag is an HMAC-SHA256 of the key and the value, and the
    value is XORed with SHAKE-256 of the tag under the encryption key. The same value under the same key seals to
    the same bytes, which ``compare_set`` needs (the store compares bytes), and reveals only that two values are
    equal. Counters (``add``) stay numbers: the store adds to them itself. Both keys come from the secret.
    """

    def __init__(self, inner: Any, secret: str) -> None:
        super().__init__()
        self.inner = inner
        root = hashlib.sha256(b"detrain run secret v1\0" + secret.encode()).digest()
        self._enc = hmac.new(root, b"encrypt", hashlib.sha256).digest()
        self._mac = hmac.new(root, b"authenticate", hashlib.sha256).digest()
        timeout = getattr(inner, "timeout", None)
        if isinstance(timeout, timedelta):
            tdist.Store.set_timeout(self, timeout)  # what callers in C++ read as this store's timeout

    # sealing
    def seal(self, key: str, value: bytes) -> bytes:
        tag = self._tag(key, value)
        return _MARK + tag + _xor(value, hashlib.shake_256(self._enc + tag).digest(len(value)))

    def unseal(self, key: str, raw: bytes) -> bytes:
        raw = bytes(raw)
        if not raw.startswith(_MARK) or len(raw) < len(_MARK) + _TAG:
            raise Unsealed(key)
        tag, body = raw[len(_MARK) : len(_MARK) + _TAG], raw[len(_MARK) + _TAG :]
        value = _xor(body, hashlib.shake_256(self._enc + tag).digest(len(body)))
        if not hmac.compare_digest(tag, self._tag(key, value)):
            raise Unsealed(key)
        return value

    def _tag(self, key: str, value: bytes) -> bytes:
        name = key.encode()
        return hmac.new(self._mac, len(name).to_bytes(4, "big") + name + value, hashlib.sha256).digest()[:_TAG]

    # the store's operations
    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, self.seal(key, _bytes(value)))

    def get(self, key: str) -> bytes:
        return self.unseal(key, self.inner.get(key))

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        expected = _bytes(expected_value)  # b"": "only where the key is absent", as the store reads it
        raw = self.inner.compare_set(
            key, self.seal(key, expected) if expected else b"", self.seal(key, _bytes(desired_value))
        )
        return self.unseal(key, raw)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [self.unseal(k, raw) for k, raw in zip(keys, self.inner.multi_get(list(keys)), strict=True)]

    def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        self.inner.multi_set(list(keys), [self.seal(k, _bytes(v)) for k, v in zip(keys, values, strict=True)])

    def add(self, key: str, value: int) -> int:
        return int(self.inner.add(key, value))

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self.inner.check(list(keys)))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(list(keys))
        else:
            self.inner.wait(list(keys), timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        tdist.Store.set_timeout(self, timeout)
        self.inner.set_timeout(timeout)

    def has_extended_api(self) -> bool:
        return False  # multi_get / multi_set above; append and the queues are not sealed: callers do without


def sealed(store: Any, secret: str | None) -> Any:
    """``store`` sealed by ``secret`` (:class:`SealedStore`); ``store`` itself without a secret (torchrun, srun
    without DETRAIN_RUN_SECRET: see docs/security.md)."""
    return SealedStore(store, secret) if secret else store


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(len(a), "little")


# ------------------------------------------------------------------------------- torch's rendezvous, sealed

# torch's c10d rendezvous keeps its state as a pickle in the store and unpickles whatever is there: sealed, only a
# holder of the secret can write it, and before torch reads it the state is loaded once by an unpickler that knows
# only these classes, so that not even a node of the run can make the others' launchers run code through it.
_STATE_CLASSES = frozenset(
    {
        ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
        ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
        ("datetime", "datetime"),
        ("datetime", "timezone"),
        ("datetime", "timedelta"),
    }
)
MAX_STATE = 16 << 20  # bytes; a state of 1,000 nodes takes about 100 KB


class _StateCheck(pickle.Unpickler):
    """An unpickler that finds only the classes of torch's rendezvous state (:data:`_STATE_CLASSES`)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _STATE_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module[:80]}.{name[:80]}")


def check_rendezvous_state(bits: bytes) -> None:
    """Refuse (one line) a c10d rendezvous state that is anything but torch's own, before torch unpickles it.

    >>> check_rendezvous_state(pickle.dumps(print))
    Traceback (most recent call last):
        ...
    detrain.errors.DistributedError: the c10d rendezvous state in the store is not torch's (it names builtins.print); \
refused, nothing of it was run
    """
    try:
        if len(bits) > MAX_STATE:
            raise ValueError(f"{len(bits)} bytes, over {MAX_STATE}")
        _StateCheck(io.BytesIO(bits)).load()
    except Exception as e:  # noqa: BLE001 - whatever is wrong with it, torch must not read it
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise DistributedError(
            f"the c10d rendezvous state in the store is not torch's ({reason}); refused, nothing of it was run"
        ) from None


def rendezvous_backend(backend: str) -> str:
    """The name under which torch's rendezvous ``backend`` (static, c10d) is registered with the store sealed by the
    secret in this process's ``DETRAIN_RUN_SECRET`` (the launcher sets it around the launch): what the launcher
    gives torch's agent as ``rdzv_backend``.

    >>> rendezvous_backend("static"), rendezvous_backend("c10d")
    ('detrain-static', 'detrain-c10d')
    """
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    name = f"detrain-{backend}"
    registry.register(name, {"static": _sealed_static, "c10d": _sealed_c10d}[backend])  # again: a no-op
    return name


def _secret_here() -> str:
    secret = run_secret(os.environ)
    if secret is None:  # the launcher sets it around every launch
        raise DistributedError(f"{SECRET_ENV} is not set in the launcher; the rendezvous cannot be sealed")
    return secret


def _sealed_static(params: Any) -> Any:
    """torch's static rendezvous, whose store (every key its agents write) is sealed."""
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous

    return _SealedHandler(static_tcp_rendezvous.create_rdzv_handler(params), _secret_here())


def _sealed_c10d(params: Any) -> Any:
    """torch's c10d rendezvous over the sealed store: its state, its agents' keys and the workers' address."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, _create_tcp_store
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class CheckedBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:
            return "detrain-c10d"  # the name it is registered under

        def get_state(self) -> Any:
            got = super().get_state()
            if got is not None:
                check_rendezvous_state(got[0])
            return got

        def set_state(self, state: bytes, token: Any | None = None) -> Any:
            got = super().set_state(state, token)
            if got is not None:
                check_rendezvous_state(got[0])
            return got

    # the store as torch's create_backend makes it, without the backend it makes there (which would write the
    # state's first value unsealed)
    store = SealedStore(_create_tcp_store(params), _secret_here())
    return create_handler(store, CheckedBackend(store, params.run_id), params)


class _SealedHandler(RendezvousHandler):
    """``inner``, each round's store sealed by ``secret``; everything else is ``inner``'s."""

    def __init__(self, inner: RendezvousHandler, secret: str) -> None:
        self.inner, self.secret = inner, secret

    def next_rendezvous(self) -> RendezvousInfo:
        info = self.inner.next_rendezvous()
        bootstrap = info.bootstrap_store_info
        assert bootstrap is not None  # the static rendezvous always says where its store is
        return RendezvousInfo(SealedStore(info.store, self.secret), info.rank, info.world_size, bootstrap)

    def get_backend(self) -> str:
        return f"detrain-{self.inner.get_backend()}"  # the name it is registered under

    @property
    def use_agent_store(self) -> bool:
        return self.inner.use_agent_store

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        return self.inner.shutdown()
