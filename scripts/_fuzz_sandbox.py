"""Run one fuzz case in a forked child under CPU, memory and wall-clock limits, and say how it ended.

A crash (SIGSEGV, abort), a hang or a runaway allocation in the code under test must be *seen*, not take the
fuzzer down with it, so every case runs in ``os.fork()``'s child: cheap, because the parent has already
imported torch and detrain and the child inherits them. The child gets

- ``RLIMIT_CPU`` of ``cpu_s`` seconds (SIGXCPU past it): a hang is measured in CPU time, so a case on a
  loaded machine is not called hung for waiting its turn;
- ``RLIMIT_AS`` of its address space at the fork plus ``mem_bytes``: any allocation past that fails
  (MemoryError, or torch's "can't allocate memory");
- a wall-clock limit ``wall_s`` (SIGKILL past it) for a child that blocks without using CPU.

The outcome kinds: ``ok`` (returned), ``refused`` (raised one of the expected exception types), ``error``
(any other exception), ``memory``, ``hang``, ``crash`` (killed by a signal, or an exit code nobody wrote).
Only ``ok`` and ``refused`` are acceptable ends.

Example:
    >>> run_isolated(lambda: "fine", expected=(ValueError,)).kind             # doctest: +SKIP
    'ok'
"""

from __future__ import annotations

import faulthandler
import math
import os
import resource
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ACCEPTABLE", "KINDS", "Outcome", "run_isolated"]

KINDS = ("ok", "refused", "error", "memory", "hang", "crash")
ACCEPTABLE = frozenset({"ok", "refused"})

# How the child reports: its exit code says the kind, the pipe carries a one-line detail.
_EXIT_KIND = {0: "ok", 10: "refused", 11: "error", 12: "memory"}
_KIND_EXIT = {kind: code for code, kind in _EXIT_KIND.items()}
_DETAIL_BYTES = 2000


@dataclass(frozen=True)
class Outcome:
    """How one case ended: ``kind`` (one of :data:`KINDS`), a one-line ``detail``, the child's CPU seconds and
    how far its peak resident memory rose above its resident memory right after the fork."""

    kind: str
    detail: str
    cpu_s: float
    peak_growth_mb: float

    @property
    def acceptable(self) -> bool:
        return self.kind in ACCEPTABLE


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _first_line(e: BaseException) -> str:
    try:
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    except Exception:  # noqa: BLE001 - a message whose str() fails
        text = ""
    return f"{type(e).__name__}: {text[:300]}"


def _child(
    target: Callable[[], str], expected: tuple[type[BaseException], ...], cpu_s: float, mem_bytes: int, write_fd: int
) -> None:
    """Runs in the forked child and never returns: every path ends in os._exit."""
    code, detail = 13, "the child did not finish its report"
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # warnings and prints of the code under test would garble the fuzzer's table
        os.dup2(devnull, 2)
        faulthandler.disable()  # it writes to a saved copy of stderr (pytest's); the signal says enough
        os.write(write_fd, b"%d\n" % _status_kb("VmRSS"))  # the baseline, before the code under test runs
        cpu = max(1, math.ceil(cpu_s))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        address_space = _status_kb("VmSize") * 1024 + mem_bytes
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        try:
            detail = str(target())[:_DETAIL_BYTES]
            code = _KIND_EXIT["ok"]
        except expected as e:
            code, detail = _KIND_EXIT["refused"], _first_line(e)
        except MemoryError as e:
            code, detail = _KIND_EXIT["memory"], _first_line(e)
        except BaseException as e:  # noqa: BLE001 - every other end is the finding
            memory = isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
            code, detail = _KIND_EXIT["memory" if memory else "error"], _first_line(e)
        os.write(write_fd, detail.encode("utf-8", "replace")[:_DETAIL_BYTES])
    finally:
        os._exit(code)


def _read_until_eof(fd: int, deadline: float) -> tuple[bytes, bool]:
    """What the child writes, until it closes the pipe (exits) or the deadline passes (False)."""
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), False
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks), True
            chunks.append(chunk)


def run_isolated(
    target: Callable[[], str],
    expected: tuple[type[BaseException], ...],
    *,
    cpu_s: float = 5.0,
    mem_bytes: int = 1 << 30,
    wall_s: float = 60.0,
) -> Outcome:
    """Call ``target()`` in a forked child under the limits above; ``target`` returns a short text on success."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read_fd)
        _child(target, expected, cpu_s, mem_bytes, write_fd)
    os.close(write_fd)
    try:
        report, finished = _read_until_eof(read_fd, time.monotonic() + wall_s)
    finally:
        os.close(read_fd)
    if not finished:
        os.kill(pid, signal.SIGKILL)
    _, status, usage = os.wait4(pid, 0)
    cpu = usage.ru_utime + usage.ru_stime
    baseline, _, rest = report.partition(b"\n")
    rss_mb = max(0.0, usage.ru_maxrss - int(baseline or 0)) / 1024  # KiB on Linux
    detail = rest.decode("utf-8", "replace")
    if not finished:
        return Outcome("hang", f"still running after {wall_s:g} s of wall-clock time", cpu, rss_mb)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= math.ceil(cpu_s)):
            return Outcome("hang", f"used more than {cpu_s:g} s of CPU time", cpu, rss_mb)
        return Outcome("crash", f"killed by {signal.Signals(sig).name}", cpu, rss_mb)
    code = os.WEXITSTATUS(status)
    kind = _EXIT_KIND.get(code)
    if kind is None:
        return Outcome("crash", f"exit code {code}: {detail}", cpu, rss_mb)
    return Outcome(kind, detail, cpu, rss_mb)
