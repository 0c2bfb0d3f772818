"""``cache=ram``: every image decoded and resized once per node, in one file in ``/dev/shm`` that all ranks and
all dataloader workers of the node map read-only (one copy of the pixels per node, not per process).

The file is ``<base>/detrain-<uid>/detrain-ram-K.bin`` for a cache key ``K`` (a hash of the image list, their
shapes, imgsz and the run); its layout and the checks a reader makes are in :mod:`detrain.data.memory.ram_cache_file`.
Other users of the machine can neither read it nor plant anything in its place: the folder is this user's and
private (:mod:`detrain.data.memory.private_dir`; a name taken by someone else is avoided, not fought over), the file is
created exclusively with mode 0600 under a temporary name and renamed into place when complete, and no path is
ever followed through a symlink.

Local rank 0 (the owner) fills the cache (threads: cv2 releases the GIL while decoding) while the other local
ranks wait for the complete file, with a timeout that names what they waited for. Before filling, one line
reports the memory needed against ``MemAvailable``; a cache that would not fit is refused with a
:class:`DatasetError` instead of letting the kernel kill the run. The owner removes the file when the cache is
dropped, at exit and on SIGINT/SIGTERM (:mod:`detrain.data.memory.owned_files`); mapped copies in other processes stay
valid until they close. The file records its owner (pid and start time, :mod:`detrain.data.memory.process_owner`): a run
killed with SIGKILL leaves its file behind, and the next run's owner removes every file whose owner is gone.

>>> cache = RamCache.build("doc", [(2, 2)], lambda i: np.full((2, 2, 3), 7, np.uint8))
RAM cache: 0.00 GB needed for 1 images, ... GB available
>>> cache.get(0)[0, 0].tolist()
[7, 7, 7]
>>> del cache  # its file goes with it
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import re
import secrets
import stat
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from detrain.config.keys import PREPARE_TIMEOUT_S
from detrain.data.memory import owned_files, private_dir
from detrain.data.memory.process_owner import Owner
from detrain.data.memory.ram_cache_file import HEADER, MAGIC, BadCacheFile, Layout
from detrain.errors import DatasetError

SHM_DIR = "/dev/shm"
SAFETY = 1.25  # keep a quarter of what the cache takes free for everything else the run needs
PREFIX = "detrain-ram-"
# a file being filled: detrain-ram-KEY.PID-STARTTICKS.RANDOM.tmp (its owner is readable before its header is)
_TMP_NAME = re.compile(rf"{PREFIX}[0-9a-zA-Z_-]+\.(\d+)-(\d+)\.[0-9a-f]+\.tmp")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.ENOMEM)  # /dev/shm can be capped below the RAM
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a planted fifo cannot hang us


def available_memory_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo, in bytes (what can be allocated without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def run_tag(launched: bool = False) -> str:
    """What makes a cache belong to this run: for a process that a launcher started (``launched``: its ``World``
    says so) the launcher's pid, which all local ranks share as their parent; else this process's pid. (No
    environment variable: a worker learns what it is from its World, read once.)"""
    return str(os.getppid()) if launched else str(os.getpid())


def cache_key(im_files: Sequence[str], shapes_hw: Sequence[tuple[int, int]], imgsz: int, tag: str) -> str:
    """A short hash naming the cache of these images at this size for this run."""
    h = hashlib.sha1(f"{imgsz}|{tag}|{len(im_files)}".encode())
    for f, s in zip(im_files, shapes_hw):
        h.update(f"{f}|{s[0]}x{s[1]}\n".encode())
    return h.hexdigest()[:16]


def file_name(key: str) -> str:
    """The name of the complete cache ``key`` in its folder."""
    if not re.fullmatch(r"[0-9a-zA-Z_-]{1,16}", key):
        raise ValueError(f"cache key {key!r} must be 1-16 letters, digits, '_' or '-'")
    return f"{PREFIX}{key}.bin"


def remove_stale(directory: str = SHM_DIR) -> None:
    """Delete the cache files in this user's private folders under ``directory`` whose owner process is gone
    (a run killed with SIGKILL cannot remove its own), and complete files without a cache header."""
    for folder in private_dir.private_folders(directory):
        try:
            for name in os.listdir(folder.fd):
                _remove_if_stale(folder.fd, name)
        finally:
            folder.close()


def _remove_if_stale(folder_fd: int, name: str) -> None:
    """Unlink ``name`` if it is a cache file of this user whose owner has ended, or a complete file without a
    cache header. Anything else (a symlink, another user's file) is left alone: it is never used either."""
    tmp = _TMP_NAME.fullmatch(name)
    if not tmp and not (name.startswith(PREFIX) and name.endswith(".bin")):
        return
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=folder_fd)
    except OSError:
        return  # vanished, or a symlink (ELOOP)
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) and private_dir.is_private(st)):
            return
        owner = _owner_of(fd)
        if owner is None and tmp:  # created, header not written yet: the name says whose it is
            owner = Owner(int(tmp[1]), int(tmp[2]), 0)
        if owner is not None and owner.alive():
            return
        now = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):  # still the file that was judged
            os.unlink(name, dir_fd=folder_fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _owner_of(fd: int) -> Owner | None:
    """The owner recorded in a file's header; None if it has no cache header."""
    head = os.pread(fd, HEADER.size, 0)
    if len(head) != HEADER.size:
        return None
    magic, pid, ticks, ns = HEADER.unpack(head)[:4]
    return Owner(pid, ticks, ns) if magic == MAGIC else None


class RamCache:
    """Read-only view of a filled cache; pickles as its path and expected shapes, so dataloader workers map the
    same file (and check it as any reader does)."""

    def __init__(self, stem: str, shapes_hw: Sequence[tuple[int, int]], owner_pid: int | None = None):
        self.stem = stem  # <folder>/detrain-ram-KEY; the file is stem + ".bin"
        self.shapes_hw = [(int(h), int(w)) for h, w in shapes_hw]
        self.owner_pid = owner_pid  # the process that removes the file (None: another process does)
        self._layout = Layout.of(self.shapes_hw)
        self._ok: np.ndarray | None = None
        self._data: np.ndarray | None = None

    @property
    def path(self) -> str:
        """The cache file."""
        return f"{self.stem}.bin"

    @property
    def key(self) -> str:
        """The cache key."""
        return os.path.basename(self.stem)[len(PREFIX) :]

    def __getstate__(self) -> dict:
        return {"stem": self.stem, "shapes_hw": self.shapes_hw, "owner_pid": self.owner_pid}

    def __setstate__(self, state: dict) -> None:
        RamCache.__init__(self, state["stem"], state["shapes_hw"], state["owner_pid"])

    def _open(self) -> None:
        folder = private_dir.open_private(os.path.dirname(self.stem))
        if folder is None:
            raise DatasetError(f"the RAM image cache folder {os.path.dirname(self.stem)} is gone or no longer private")
        try:
            self._ok, self._data = _map_checked(folder.fd, os.path.basename(self.path), self._layout, self.key)
        except (OSError, BadCacheFile) as e:
            raise DatasetError(f"cannot use the RAM image cache {self.path}: {_reason(e)}") from None
        finally:
            folder.close()

    def __len__(self) -> int:
        return self._layout.n

    def get(self, i: int) -> np.ndarray | None:
        """Image ``i`` (h, w, 3) uint8 BGR at load size, a read-only view of the shared pages; None if unreadable."""
        if self._data is None:
            self._open()
        assert self._ok is not None and self._data is not None
        if not self._ok[i]:
            return None
        h, w = self.shapes_hw[i]
        at = int(self._layout.offsets[i])
        return self._data[at : at + h * w * 3].reshape(h, w, 3)

    @classmethod
    def build(
        cls,
        key: str,
        shapes_hw: Sequence[tuple[int, int]],
        load: Callable[[int], np.ndarray | None],
        local_rank: int = 0,
        timeout_s: float = PREPARE_TIMEOUT_S,
        directory: str = SHM_DIR,
        threads: int | None = None,
    ) -> RamCache:
        """Fill (``local_rank`` 0, this process's on its node as its ``World`` says) or wait for (other local ranks)
        the cache ``key`` of images with load sizes ``shapes_hw`` in this user's private folder under ``directory``;
        ``load(i)`` returns image ``i`` at exactly that size (or None if unreadable)."""
        name = file_name(key)
        layout = Layout.of(shapes_hw)
        if local_rank != 0:
            return cls._wait(directory, name, key, shapes_hw, layout, timeout_s)
        return cls._fill(directory, name, key, shapes_hw, layout, load, threads)

    @classmethod
    def _wait(
        cls, directory: str, name: str, key: str, shapes_hw: Sequence[tuple[int, int]], layout: Layout, timeout_s: float
    ) -> RamCache:
        deadline = time.monotonic() + timeout_s
        refused = ""
        while True:
            folders = private_dir.private_folders(directory)
            try:
                for folder in folders:
                    try:
                        ok, data = _map_checked(folder.fd, name, layout, key)
                    except FileNotFoundError:
                        continue
                    except (OSError, BadCacheFile) as e:  # a leftover, a symlink, not the cache: never used
                        refused = f"; {folder.path}/{name} was refused: {_reason(e)}"
                        continue
                    cache = cls(os.path.join(folder.path, name[: -len(".bin")]), shapes_hw)
                    cache._ok, cache._data = ok, data
                    return cache
            finally:
                for folder in folders:
                    folder.close()
            if time.monotonic() > deadline:
                raise DatasetError(
                    f"timed out after {timeout_s:.0f} s waiting for local rank 0 to fill the RAM image "
                    f"cache {private_dir.primary_path(directory)}/{name}{refused}; is local rank 0 "
                    f"alive? (prepare_timeout= sets the wait)"
                )
            time.sleep(0.2)

    @classmethod
    def _fill(
        cls,
        directory: str,
        name: str,
        key: str,
        shapes_hw: Sequence[tuple[int, int]],
        layout: Layout,
        load: Callable[[int], np.ndarray | None],
        threads: int | None,
    ) -> RamCache:
        needed = int(layout.sizes.sum())
        available = min(available_memory_bytes(), _free_bytes(directory))
        print(
            f"RAM cache: {needed / 1e9:.2f} GB needed for {layout.n} images, {available / 1e9:.2f} GB available",
            flush=True,
        )
        if needed * SAFETY > available:
            raise DatasetError(
                f"cache=ram needs {needed / 1e9:.2f} GB (+{SAFETY - 1:.0%} headroom) for "
                f"{layout.n} images but only {available / 1e9:.2f} GB of RAM is available; "
                f"use cache=disk, cache=False or a smaller imgsz"
            )
        remove_stale(directory)
        try:
            folder, note = private_dir.writable_private_folder(directory)
        except OSError as e:
            raise DatasetError(
                f"cache=ram cannot make a private folder in {directory}: {_reason(e)}; use cache=disk or cache=False"
            ) from None
        if note:
            print(f"RAM cache: {note}; using {folder.path}", flush=True)
        try:
            owner = Owner.current()
            tmp = f"{name[: -len('.bin')]}.{owner.pid}-{owner.start_ticks}.{secrets.token_hex(4)}.tmp"
            entry = owned_files.own(owned_files.OwnedFile(folder.fd, tmp))
            try:
                try:
                    _write(folder.fd, entry, layout, key, owner, shapes_hw, load, threads)
                except OSError as e:
                    if e.errno not in _NO_SPACE:
                        raise
                    raise DatasetError(
                        f"cache=ram could not write {folder.path}/{tmp}: {_reason(e)}; use cache=disk or cache=False"
                    ) from None
                # complete: publish it under its name in one step (POSIX rename replaces atomically)
                os.rename(tmp, name, src_dir_fd=folder.fd, dst_dir_fd=folder.fd)
                entry.name = name
                ok, data = _map_checked(folder.fd, name, layout, key)
            except BaseException:
                owned_files.release(entry)
                raise
        finally:
            folder.close()
        cache = cls(os.path.join(folder.path, name[: -len(".bin")]), shapes_hw, owner_pid=owner.pid)
        cache._ok, cache._data = ok, data
        weakref.finalize(cache, owned_files.release, entry)  # dropped or interpreter exit: the owner removes it
        return cache


def _write(
    folder_fd: int,
    entry: owned_files.OwnedFile,
    layout: Layout,
    key: str,
    owner: Owner,
    shapes_hw: Sequence[tuple[int, int]],
    load: Callable[[int], np.ndarray | None],
    threads: int | None,
) -> None:
    """Create ``entry.name`` exclusively (mode 0600, no symlink followed) and fill it: header, pixels, then the
    per-image ok flags."""
    fd = os.open(entry.name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder_fd)
    try:
        entry.made(os.fstat(fd))
        os.fchmod(fd, 0o600)  # the umask can only take bits away, but say it outright
        os.ftruncate(fd, layout.size)
        _pwrite_all(fd, layout.head(key, owner), 0)
        ok = np.zeros(layout.n, dtype=np.uint8)

        def fill_one(i: int) -> None:
            img = load(i)
            if img is None or img.shape != (*shapes_hw[i], 3) or img.dtype != np.uint8:
                return  # unreadable (or not the promised size): the dataset reports it when it meets it
            _pwrite_all(fd, np.ascontiguousarray(img).reshape(-1), layout.pixels_at + int(layout.offsets[i]))
            ok[i] = 1

        pool = ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1))
        try:
            list(pool.map(fill_one, range(layout.n)))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # Ctrl-C: stop at the images being read
        _pwrite_all(fd, ok.tobytes(), layout.ok_at)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: bytes | np.ndarray, at: int) -> None:
    view = (data.data if isinstance(data, np.ndarray) else memoryview(data)).cast("B")
    while view:
        written = os.pwrite(fd, view, at)
        view, at = view[written:], at + written


def _map_checked(folder_fd: int, name: str, layout: Layout, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(ok flags, pixels) of the file ``name``, mapped read-only after checking that it is a regular file private
    to this user, that it is the cache ``key`` with ``layout`` and that its owner runs. FileNotFoundError if absent,
    BadCacheFile or OSError (a symlink: ELOOP) if not usable."""
    fd = os.open(name, _OPEN_FLAGS, dir_fd=folder_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadCacheFile("it is not a regular file")
        if not private_dir.is_private(st):
            raise BadCacheFile("it is not private to this user")
        if st.st_size != layout.size:
            raise BadCacheFile(f"its size is {st.st_size} bytes, not {layout.size}")
        buf = mmap.mmap(fd, layout.size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    owner, ok = layout.check(buf, key)
    if not owner.alive():
        raise BadCacheFile(f"it was left by process {owner.pid}, which has ended")
    return ok, layout.pixels(buf)


def _reason(e: BaseException) -> str:
    return e.strerror or str(e) if isinstance(e, OSError) else str(e)


def _free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize
