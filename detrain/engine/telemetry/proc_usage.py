"""What one worker process costs its node: CPU time, resident memory, GPU memory and utilisation.

Read from ``/proc`` (Linux) without psutil: the worker's own ``/proc/self/stat`` and ``/proc/self/status`` plus
those of its live child processes (the data loader's workers, found through ``/proc/self/task/*/children``), so
a node's numbers include the augmentation work the loader does. Where ``/proc`` is absent (macOS) the process's
own ``resource.getrusage`` stands in (CPU time of this process; peak, not current, resident memory).

>>> usage = ProcessUsage()
>>> sample = usage.sample()
>>> sample.cpu_pct >= 0 and sample.rss_bytes > 0
True
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from detrain.system.procfs import PROC, stat_fields, status_value

try:
    import resource
except ImportError:  # Windows: no rusage (and no /proc); the numbers read 0
    resource = None  # type: ignore[assignment]

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") and "SC_CLK_TCK" in os.sysconf_names else 100


@dataclass(frozen=True)
class UsageSample:
    """Since the previous sample: CPU time used (seconds, this process and its live children), that as a
    percentage of one core over the wall time (``top``'s convention: 200 = two cores busy), and the resident
    memory now (bytes, summed over the same processes, each shared page counted once: :func:`rss_bytes`)."""

    cpu_s: float
    cpu_pct: float
    rss_bytes: int


def cpu_ticks(pid: str, proc: Path = PROC) -> int | None:
    """User + system clock ticks of process ``pid`` (``"self"`` or a number), None when unreadable or malformed."""
    fields = stat_fields(pid, proc)
    try:
        return int(fields[11]) + int(fields[12]) if fields is not None else None  # utime, stime: fields 14, 15
    except (IndexError, ValueError):
        return None


def rss_bytes(pid: str, proc: Path = PROC) -> int | None:
    """Resident memory of process ``pid``, with each page it shares counted in proportion (its PSS, from
    ``smaps_rollup``), so that summing a process and its forked loader workers counts a shared page once; its
    resident set size (``status``'s ``VmRSS``) where the kernel has no ``smaps_rollup`` (before Linux 4.14). None when
    unreadable.

    Why not RSS: a data-loader worker forked from a CUDA process maps the parent's pages, so eight workers' RSS
    counted a 3.5 GB CUDA process nine times (29 GB on a 16-core GPU machine, 2026-11-27, ``scripts/gpu_check.py``).
    """
    for name, key in (("smaps_rollup", "Pss"), ("status", "VmRSS")):
        kb = status_value(pid, key, proc, name)
        if kb is not None:
            return int(kb) * 1024 if kb.isdigit() else None
    return None


def child_pids(proc: Path = PROC) -> list[str]:
    """This process's live children (every thread's ``children`` list; empty where the kernel does not offer it)."""
    pids: list[str] = []
    try:
        tasks = list((proc / "self" / "task").iterdir())
    except OSError:
        return pids
    for task in tasks:
        try:
            pids += [p for p in (task / "children").read_text().split() if p.isdigit() and p not in pids]
        except OSError:
            continue
    return pids


class ProcessUsage:
    """CPU % and resident memory of this process and its live children, between successive samples.

    A child seen for the first time counts its whole CPU time (data-loader workers start within the epoch that
    first sees them); a child that ended between samples loses its last slice (it can no longer be read).
    """

    def __init__(self, proc: Path = PROC) -> None:
        self.proc = proc
        self.linux = (proc / "self" / "stat").is_file()
        self.last_ticks: dict[str, int] = {}
        self.last_wall = time.perf_counter()
        self.last_rusage = _rusage_cpu_s()
        if self.linux:
            self._read()  # the baseline: a first sample covers only what happened after construction

    def _read(self) -> tuple[int, int]:
        """Ticks used since the last read, and the resident bytes now, over this process and its children."""
        used, rss = 0, 0
        ticks: dict[str, int] = {}
        for pid in ["self", *child_pids(self.proc)]:
            t = cpu_ticks(pid, self.proc)
            if t is None:
                continue  # ended while being read
            ticks[pid] = t
            used += max(0, t - self.last_ticks.get(pid, 0))
            rss += rss_bytes(pid, self.proc) or 0
        self.last_ticks = ticks
        return used, rss

    def sample(self) -> UsageSample:
        """The usage since the previous sample (or construction)."""
        now = time.perf_counter()
        wall = max(now - self.last_wall, 1e-9)
        self.last_wall = now
        if self.linux:
            used, rss = self._read()
            cpu_s = used / _CLK_TCK
        else:
            total = _rusage_cpu_s()
            cpu_s, self.last_rusage = total - self.last_rusage, total
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss if resource is not None else 0
            rss = peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
        return UsageSample(cpu_s=cpu_s, cpu_pct=100.0 * cpu_s / wall, rss_bytes=int(rss))


def _rusage_cpu_s() -> float:
    if resource is None:
        return 0.0
    r = resource.getrusage(resource.RUSAGE_SELF)
    return float(r.ru_utime + r.ru_stime)
