"""Linux's ``/proc`` without psutil: the fields of a process's ``stat`` and the values of its ``status``, None
wherever they cannot be read or make no sense (no /proc, the process ended, a malformed file).

>>> fields = stat_fields("self")
>>> fields is None or fields[0] in "RSDTtZIXxKWP"  # the state letter comes first after the command name
True
>>> v = status_value("self", "Umask")
>>> v is None or int(v, 8) >= 0
True
"""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")


def stat_fields(pid: int | str, proc: Path = PROC) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name, so index 0 is field 3 of proc(5) (the state).

    The command name (field 2) may hold spaces and parentheses: the fields are counted after its last ``)``.
    """
    try:
        raw = (proc / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    _, paren, rest = raw.rpartition(b")")
    return rest.decode("ascii", "replace").split() if paren else None


def status_value(pid: int | str, key: str, proc: Path = PROC, name: str = "status") -> str | None:
    """The first word after ``<key>:`` in ``/proc/<pid>/status`` (``"VmRSS"`` -> ``"1234"``, in kB), or in another
    file of the same ``Key: value`` form (``name="smaps_rollup"``: ``"Pss"``)."""
    try:
        text = (proc / str(pid) / name).read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(f"{key}:"):
            parts = line.split()
            return parts[1] if len(parts) >= 2 else None
    return None
