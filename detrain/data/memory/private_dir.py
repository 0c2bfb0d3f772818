"""This user's private folders in a directory every user can write to (``/dev/shm``).

A file created straight in ``/dev/shm`` under a predictable name can be pre-created, read or swapped for a
symlink by any other user of the machine. Files made in a folder that belongs to this user, a real folder (not a
symlink) with mode 0700, can do none of that: nobody else can list, open, create or rename anything in it. The
folder is ``<base>/detrain-<uid>``. If that name is taken by something that is not such a folder (another user's
folder, a symlink, a folder open to group or others), it is left alone and a fallback is used instead:
``<base>/detrain-<uid>-<random>``, made by ``mkdtemp`` (a name that cannot be guessed in advance, so it cannot be
planted). Readers look in every private ``detrain-<uid>*`` folder, so they find files wherever the writer put them.

Every folder is checked on an open file descriptor (``O_NOFOLLOW | O_DIRECTORY``, then ``fstat``) and used
through that descriptor, so the folder that was checked is the folder that is used.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class PrivateFolder:
    """A checked folder: its path and an open descriptor to use it by (the caller closes it)."""

    path: str
    fd: int

    def close(self) -> None:
        """Close the descriptor."""
        os.close(self.fd)


def is_private(st: os.stat_result) -> bool:
    """Owned by this user (the effective uid) and closed to group and others."""
    return st.st_uid == os.geteuid() and not st.st_mode & 0o077


def open_private(path: str) -> PrivateFolder | None:
    """``path`` if it is a real folder private to this user (not a symlink to one), opened; else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # absent, a symlink (ELOOP), not a folder (ENOTDIR), not ours to open (EACCES)
        return None
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode) and is_private(st):
        return PrivateFolder(path, fd)
    os.close(fd)
    return None


def primary_path(base: str) -> str:
    """``<base>/detrain-<uid>``: where this user's files go when nobody took the name."""
    return os.path.join(base, f"detrain-{os.geteuid()}")


def private_folders(base: str) -> list[PrivateFolder]:
    """Every private folder of this user in ``base``, opened: the primary first, then the fallbacks."""
    prefix = f"detrain-{os.geteuid()}-"
    try:
        fallbacks = sorted(name for name in os.listdir(base) if name.startswith(prefix))
    except OSError:
        fallbacks = []
    found = [open_private(path) for path in (primary_path(base), *(os.path.join(base, n) for n in fallbacks))]
    return [folder for folder in found if folder is not None]


def writable_private_folder(base: str) -> tuple[PrivateFolder, str | None]:
    """The folder to create files in, opened, and a note saying why it is not the primary (None if it is).

    The primary is created (mode 0700) if absent. If the name is taken by anything else, the first existing
    private fallback is used, else a new one."""
    path = primary_path(base)
    try:
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        created = False
    folder = open_private(path)
    if folder is not None:
        if created:
            os.fchmod(folder.fd, 0o700)  # the umask may have taken bits the owner needs
        return folder, None
    note = f"{path} is not a private folder of this user (another user's, a symlink, or open to group/others)"
    keep: PrivateFolder | None = None
    for candidate in private_folders(base):
        if keep is None and candidate.path != path:
            keep = candidate
        else:
            candidate.close()
    if keep is not None:
        return keep, note
    fresh = open_private(tempfile.mkdtemp(prefix=f"detrain-{os.geteuid()}-", dir=base))
    if fresh is None:  # mkdtemp makes it ours and 0700, and nobody else can rename it in a sticky /dev/shm
        raise OSError(f"the new folder made in {base} is not private")
    return fresh, note
