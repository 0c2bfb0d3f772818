"""``cache=ram``: every image decoded and resized once per node, in one file in ``/dev/shm`` that all ranks and
all dataloader workers of the node map read-only (one copy of the pixels per node, not per process).

Files, for a cache key ``K`` (a hash of the image list, their shapes, imgsz and the run):

- ``detrain-ram-K.bin``: the pixels, image after image (uint8 BGR, load size: long side = imgsz);
- ``detrain-ram-K.idx.npy``: the index, one row per image ``(offset, h, w, ok)``, written last and atomically,
  so its presence means the cache is complete;
- ``detrain-ram-K.json``: the owner's pid, so a later run can remove caches left behind by a crashed one.

Local rank 0 fills the cache (threads: cv2 releases the GIL while decoding) while the other local ranks wait for
the index, with a timeout that names what they waited for. Before filling, one line reports the memory needed
against ``MemAvailable``; a cache that would not fit is refused with a :class:`DatasetError` instead of letting
the kernel kill the run. The owner unlinks the files at exit (mapped copies in other processes stay valid until
they close).

>>> cache = RamCache.build("doc", [(2, 2)], lambda i: np.full((2, 2, 3), 7, np.uint8))  # doctest: +SKIP
>>> cache.get(0)[0, 0].tolist()  # doctest: +SKIP
[7, 7, 7]
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from detrain.errors import DatasetError

SHM_DIR = "/dev/shm"
SAFETY = 1.25  # keep a quarter of what the cache takes free for everything else the run needs
DEFAULT_TIMEOUT_S = float(os.environ.get("DETRAIN_CACHE_TIMEOUT", 3600))


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


def run_tag() -> str:
    """What makes a cache belong to this run: ``DETRAIN_RUN_ID`` if set; under a launcher (``LOCAL_RANK`` set) the
    launcher's pid, which all local ranks share as their parent; else this process's pid."""
    if os.environ.get("DETRAIN_RUN_ID"):
        return os.environ["DETRAIN_RUN_ID"]
    return str(os.getppid()) if "LOCAL_RANK" in os.environ else str(os.getpid())


def cache_key(im_files: Sequence[str], shapes_hw: Sequence[tuple[int, int]], imgsz: int, tag: str) -> str:
    """A short hash naming the cache of these images at this size for this run."""
    h = hashlib.sha1(f"{imgsz}|{tag}|{len(im_files)}".encode())
    for f, s in zip(im_files, shapes_hw):
        h.update(f"{f}|{s[0]}x{s[1]}\n".encode())
    return h.hexdigest()[:16]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(directory: str = SHM_DIR) -> None:
    """Delete the caches whose owner process is gone (a crashed run cannot unlink its own)."""
    for meta in Path(directory).glob("detrain-ram-*.json"):
        try:
            pid = int(json.loads(meta.read_text())["owner_pid"])
        except (OSError, ValueError, KeyError):
            continue
        if not _alive(pid):
            stem = meta.name[: -len(".json")]
            for suffix in (".bin", ".idx.npy", ".json"):
                (meta.parent / f"{stem}{suffix}").unlink(missing_ok=True)


class RamCache:
    """Read-only view of a filled cache; pickles as its paths, so dataloader workers map the same file."""

    def __init__(self, stem: str, owner_pid: int | None = None):
        self.stem = stem
        self.owner_pid = owner_pid  # the process that unlinks the files at exit
        self._index: np.ndarray | None = None
        self._data: np.ndarray | None = None

    @property
    def paths(self) -> tuple[Path, Path, Path]:
        """(pixels, index, owner) files."""
        return Path(f"{self.stem}.bin"), Path(f"{self.stem}.idx.npy"), Path(f"{self.stem}.json")

    def __getstate__(self) -> dict:
        return {"stem": self.stem, "owner_pid": self.owner_pid}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["stem"], state["owner_pid"])

    def _open(self) -> None:
        data_path, index_path, _ = self.paths
        self._index = np.load(index_path, allow_pickle=False)
        size = data_path.stat().st_size
        self._data = np.memmap(data_path, dtype=np.uint8, mode="r", shape=(size,)) if size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        if self._index is None:
            self._open()
        return len(self._index)

    def get(self, i: int) -> np.ndarray | None:
        """Image ``i`` (h, w, 3) uint8 BGR at load size, a read-only view of the shared pages; None if unreadable."""
        if self._index is None:
            self._open()
        offset, h, w, ok = (int(v) for v in self._index[i])
        if not ok:
            return None
        return self._data[offset: offset + h * w * 3].reshape(h, w, 3)

    def unlink(self) -> None:
        """Remove the files (the owner does this at exit)."""
        for p in self.paths:
            p.unlink(missing_ok=True)

    @classmethod
    def build(
        cls,
        key: str,
        shapes_hw: Sequence[tuple[int, int]],
        load: Callable[[int], np.ndarray | None],
        local_rank: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        directory: str = SHM_DIR,
        threads: int | None = None,
    ) -> RamCache:
        """Fill (local rank 0) or wait for (other local ranks) the cache ``key`` of images with load sizes
        ``shapes_hw``; ``load(i)`` returns image ``i`` at exactly that size (or None if unreadable)."""
        local_rank = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
        stem = os.path.join(directory, f"detrain-ram-{key}")
        if local_rank != 0:
            return cls._wait(stem, timeout_s)
        return cls._fill(stem, shapes_hw, load, threads)

    @classmethod
    def _wait(cls, stem: str, timeout_s: float) -> RamCache:
        cache = cls(stem)
        index_path = cache.paths[1]
        deadline = time.monotonic() + timeout_s
        while not index_path.exists():
            if time.monotonic() > deadline:
                raise DatasetError(f"timed out after {timeout_s:.0f} s waiting for local rank 0 to fill the RAM image "
                                   f"cache {index_path}; is local rank 0 alive? (DETRAIN_CACHE_TIMEOUT sets the wait)")
            time.sleep(0.2)
        cache._open()
        return cache

    @classmethod
    def _fill(cls, stem: str, shapes_hw: Sequence[tuple[int, int]], load: Callable[[int], np.ndarray | None],
              threads: int | None) -> RamCache:
        directory = os.path.dirname(stem)
        remove_stale(directory)
        sizes = np.array([h * w * 3 for h, w in shapes_hw], dtype=np.int64)
        needed = int(sizes.sum())
        available = min(available_memory_bytes(), _free_bytes(directory))
        print(f"RAM cache: {needed / 1e9:.2f} GB needed for {len(sizes)} images, "
              f"{available / 1e9:.2f} GB available", flush=True)
        if needed * SAFETY > available:
            raise DatasetError(f"cache=ram needs {needed / 1e9:.2f} GB (+{SAFETY - 1:.0%} headroom) for "
                               f"{len(sizes)} images but only {available / 1e9:.2f} GB of RAM is available; "
                               f"use cache=disk, cache=False or a smaller imgsz")
        cache = cls(stem, owner_pid=os.getpid())
        data_path, index_path, meta_path = cache.paths
        cache.unlink()  # a complete index left by an earlier run of the same tag must not be taken as ours
        meta_path.write_text(json.dumps({"owner_pid": os.getpid()}))
        _unlink_at_exit(cache)
        index = np.zeros((len(sizes), 4), dtype=np.int64)
        index[:, 0] = np.concatenate(([0], np.cumsum(sizes)[:-1])) if len(sizes) else 0
        index[:, 1:3] = np.asarray(shapes_hw, dtype=np.int64).reshape(-1, 2)
        with open(data_path, "wb") as f:
            f.truncate(needed)
        if needed:
            data = np.memmap(data_path, dtype=np.uint8, mode="r+", shape=(needed,))

            def fill_one(i: int) -> None:
                img = load(i)
                h, w = shapes_hw[i]
                if img is None or img.shape != (h, w, 3):
                    return  # unreadable (or not the promised size): the dataset reports it when it meets it
                data[index[i, 0]: index[i, 0] + sizes[i]] = img.reshape(-1)
                index[i, 3] = 1

            with ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1)) as pool:
                list(pool.map(fill_one, range(len(sizes))))
            data.flush()
            del data
        tmp = f"{stem}.idx.tmp.npy"
        np.save(tmp, index, allow_pickle=False)
        os.replace(tmp, index_path)  # last: its presence tells the waiting ranks the pixels are complete
        cache._open()
        return cache


def _free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _unlink_at_exit(cache: RamCache) -> None:
    """The owner removes its files when the cache is dropped or the run ends (``weakref.finalize`` also runs at
    interpreter exit); forked dataloader workers inherit the finalizer but are not the owner, so they keep them."""
    weakref.finalize(cache, _unlink_if_owner, cache.stem, cache.owner_pid)


def _unlink_if_owner(stem: str, owner_pid: int | None) -> None:
    if owner_pid == os.getpid():
        for suffix in (".bin", ".idx.npy", ".json"):
            Path(f"{stem}{suffix}").unlink(missing_ok=True)
