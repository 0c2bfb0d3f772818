"""Who owns a file that a process leaves in shared memory, and whether that process still runs.

A pid alone cannot say so: pids are reused, so a crashed run's pid may belong to an unrelated process by the
time the next run looks. An :class:`Owner` also records the process's start time (field 22 of
``/proc/<pid>/stat``, in clock ticks since boot), which a reused pid does not share, and the pid namespace it
was recorded in: a process of another namespace (another container sharing ``/dev/shm``) cannot be looked up
from here, so it is never taken for gone.

>>> me = Owner.current()
>>> me.alive(), Owner(me.pid, me.start_ticks + 1, me.pid_ns).alive()
(True, False)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from detrain.system.procfs import stat_fields


def start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot; None if there is no such process (or no /proc)."""
    fields = stat_fields(pid)
    try:
        return int(fields[19]) if fields is not None else None  # starttime: field 22 of proc(5)
    except (IndexError, ValueError):
        return None


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not say)."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
        return int(link[link.index("[") + 1 : link.index("]")])
    except (OSError, ValueError):
        return 0


@dataclass(frozen=True)
class Owner:
    """A process, told apart from a later process with the same pid."""

    pid: int
    start_ticks: int
    pid_ns: int

    @classmethod
    def current(cls) -> Owner:
        """This process."""
        pid = os.getpid()
        return cls(pid, start_ticks(pid) or 0, pid_namespace())

    def alive(self) -> bool:
        """False only when this process has certainly ended: its pid is free, or taken by a process that started
        at another time. A process of another pid namespace, or a system without /proc, counts as alive unless
        the pid is free."""
        if self.pid <= 0:
            return False
        if self.pid_ns and self.pid_ns != pid_namespace():
            return True
        if start_ticks(os.getpid()) is None:  # no /proc here: the pid is all there is
            return _pid_exists(self.pid)
        return start_ticks(self.pid) == self.start_ticks


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
