"""``cache=ram`` against the other users of a machine and against its own leftovers: each test is one attack.

Tests cannot chown, so "another user's" folder or file is one whose ownership check fails
(``private_dir.is_private`` patched to say so for that inode); a folder open to group/others fails it for real.
Every cache here lives in ``tmp_path`` (the ``directory`` argument), never in the real ``/dev/shm``.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from detrain.data.memory import owned_files, private_dir
from detrain.data.memory.process_owner import Owner, start_ticks
from detrain.data.memory.ram_cache import RamCache, file_name, remove_stale
from detrain.data.memory.ram_cache_file import HEADER, Layout
from detrain.errors import DatasetError

SHAPES = [(5, 7), (3, 4), (8, 8)]
IMAGES = [np.random.default_rng(i).integers(0, 255, (*s, 3), dtype=np.uint8) for i, s in enumerate(SHAPES)]
ROOT = Path(__file__).resolve().parents[2]


def build(directory: Path, key: str = "k") -> RamCache:
    return RamCache.build(key, SHAPES, lambda i: IMAGES[i], local_rank=0, directory=str(directory))


def wait(directory: Path, key: str = "k", timeout_s: float = 0) -> RamCache:
    return RamCache.build(key, SHAPES, lambda i: None, local_rank=1, timeout_s=timeout_s, directory=str(directory))


def same_pixels(cache: RamCache) -> bool:
    return all(np.array_equal(cache.get(i), IMAGES[i]) for i in range(len(SHAPES)))


def mine(directory: Path) -> Path:
    return directory / f"detrain-{os.geteuid()}"


def owned_by_someone_else(monkeypatch: pytest.MonkeyPatch, *paths: Path) -> None:
    """Make the ownership check fail for these files or folders, as it would for another user's."""
    inodes = {os.lstat(p).st_ino for p in paths}
    real = private_dir.is_private
    monkeypatch.setattr(private_dir, "is_private", lambda st: st.st_ino not in inodes and real(st))


# ---------------------------------------------------------------- permissions


def test_file_is_0600_in_a_0700_folder_even_with_umask_0(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        cache = build(tmp_path)
    finally:
        os.umask(old)
    folder, file = os.lstat(mine(tmp_path)), os.lstat(cache.path)
    assert Path(cache.path).parent == mine(tmp_path)
    assert oct(folder.st_mode & 0o7777) == oct(0o700) and folder.st_uid == os.geteuid()
    assert oct(file.st_mode & 0o7777) == oct(0o600) and file.st_uid == os.geteuid()
    assert sorted(os.listdir(mine(tmp_path))) == [file_name("k")]  # no temporary left beside it


# ---------------------------------------------------------------- planted folders and files


def test_symlink_planted_at_the_folder_path_is_not_followed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)  # even a folder that would pass every check is not reached through a link
    mine(tmp_path).symlink_to(victim)
    cache = build(tmp_path)
    assert list(victim.iterdir()) == [] and mine(tmp_path).is_symlink()
    assert Path(cache.path).parent.name.startswith(f"detrain-{os.geteuid()}-")  # a fresh private folder
    assert "is not a private folder" in capsys.readouterr().out
    assert same_pixels(wait(tmp_path))  # the other ranks find it there


def test_symlink_planted_at_the_file_path_is_not_followed(tmp_path: Path) -> None:
    mine(tmp_path).mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (mine(tmp_path) / file_name("k")).symlink_to(victim)
    with pytest.raises(DatasetError, match=r"refused: .*(symbolic link|Too many levels)"):
        wait(tmp_path)  # a reader does not open it
    cache = build(tmp_path)  # the writer replaces the name, not the file it points to
    assert victim.read_bytes() == b"precious"
    assert not Path(cache.path).is_symlink() and same_pixels(wait(tmp_path))


@pytest.mark.parametrize("how", ["another user's", "open to others"])
def test_a_folder_taken_by_another_user_does_not_stop_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    planted = mine(tmp_path)
    planted.mkdir(mode=0o700)
    (planted / file_name("k")).write_bytes(b"planted")
    if how == "open to others":
        planted.chmod(0o755)
    else:
        owned_by_someone_else(monkeypatch, planted)
    cache = build(tmp_path)
    assert Path(cache.path).parent != planted and same_pixels(wait(tmp_path))
    assert os.listdir(planted) == [file_name("k")] and (planted / file_name("k")).read_bytes() == b"planted"
    cache2 = build(tmp_path, "k2")  # the next cache reuses the private fallback instead of making another
    assert Path(cache2.path).parent == Path(cache.path).parent


def test_a_file_of_another_user_with_the_same_name_does_not_stop_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What used to end the run with PermissionError: a file named like ours that we may not use."""
    first = build(tmp_path)
    planted, valid_looking = Path(first.path), Path(first.path).read_bytes()
    del first
    gc.collect()
    planted.write_bytes(valid_looking)  # complete, the right header, an owner that runs (this process)
    planted.chmod(0o600)
    legacy = tmp_path / "detrain-ram-k.bin"  # where the cache used to be, straight in /dev/shm
    legacy.write_bytes(b"legacy")
    owned_by_someone_else(monkeypatch, planted)
    with pytest.raises(DatasetError, match="refused: it is not private to this user"):
        wait(tmp_path)  # a complete, valid-looking file, but not ours: never read
    cache = build(tmp_path)
    assert same_pixels(cache) and same_pixels(wait(tmp_path)) and legacy.read_bytes() == b"legacy"


# ---------------------------------------------------------------- the owner's end


# The child's main thread never blocks long in one call: Python runs a signal handler when the main thread is back
# in the interpreter, and a signal that lands just before a blocking call is only seen once that call returns.
CHILD = textwrap.dedent("""
    import signal, sys, time
    import numpy as np
    from detrain.data.memory.ram_cache import RamCache
    directory, key, when = sys.argv[1:4]
    # Python's own SIGINT handler, as in a shell's foreground: a parent started in the background (a CI runner's
    # job) passes SIGINT on ignored, and an ignored signal stays ignored with a cache too
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if when == "own-handler":
        signal.signal(signal.SIGTERM, lambda s, f: sys.exit(3))  # a caller's handler: must still run
    def load(i):
        if when == "filling":  # thousands of slow images: still filling when the signal comes
            if i == 1:
                print("filling", flush=True)
            time.sleep(0.05)
        return np.zeros((1, 1, 3), np.uint8)
    n = 20000 if when == "filling" else 3
    cache = RamCache.build(key, [(1, 1)] * n, load, local_rank=0, directory=directory, threads=1)
    print("ready", cache.path, flush=True)
    while True:
        time.sleep(0.05)
""")


def start_child(directory: Path, key: str, when: str) -> subprocess.Popen:
    """A process holding a cache (or filling one) when it prints its line; the test then signals it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory), key, when], stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith(("ready", "filling")):
            return child
    child.wait()
    raise AssertionError(f"the child ended with {child.returncode} before holding a cache")


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("detrain-*/*"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_sigint_removes_the_files_and_the_process_still_dies_of_it(tmp_path: Path, sig: int) -> None:
    child = start_child(tmp_path, "term", "ready")
    assert files(tmp_path) == [file_name("term")]
    child.send_signal(sig)
    assert child.wait(60) == -sig  # the status its parent and shell expect
    assert files(tmp_path) == []


def test_sigterm_goes_to_the_handler_the_process_had_and_the_files_still_go(tmp_path: Path) -> None:
    child = start_child(tmp_path, "own", "own-handler")
    child.send_signal(signal.SIGTERM)
    assert child.wait(60) == 3  # its own handler ended it (sys.exit(3)); the exit removed the files
    assert files(tmp_path) == []


def test_sigterm_while_filling_removes_the_partial_file(tmp_path: Path) -> None:
    child = start_child(tmp_path, "partial", "filling")
    assert len(files(tmp_path)) == 1 and files(tmp_path)[0].endswith(".tmp")
    child.send_signal(signal.SIGTERM)
    assert child.wait(60) == -signal.SIGTERM and files(tmp_path) == []


def test_handlers_chain_in_process_and_are_put_back(tmp_path: Path) -> None:
    seen: list[int] = []

    def handler(signum: int, frame: object) -> None:
        seen.append(signum)

    gc.collect()
    assert not owned_files._live  # no cache of an earlier test holds the handlers
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        cache = build(tmp_path)
        assert signal.getsignal(signal.SIGTERM) is owned_files._on_signal
        signal.raise_signal(signal.SIGTERM)
        assert seen == [signal.SIGTERM] and Path(cache.path).exists()  # the process went on: its file stays
        path = cache.path
        del cache
        gc.collect()
        assert not Path(path).exists() and signal.getsignal(signal.SIGTERM) is handler
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _alive = build(tmp_path)  # an ignored signal stays ignored (while a cache is alive)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigkill_leaves_files_that_the_next_build_reclaims(tmp_path: Path) -> None:
    done, filling = start_child(tmp_path, "done", "ready"), start_child(tmp_path, "half", "filling")
    for child in (done, filling):
        child.kill()
        assert child.wait(60) == -signal.SIGKILL
    left = files(tmp_path)
    assert file_name("done") in left and any(f.startswith("detrain-ram-half.") for f in left) and len(left) == 2
    with pytest.raises(DatasetError, match=r"refused: it was left by process .* which has ended"):
        RamCache.build("done", [(1, 1)] * 3, lambda i: None, local_rank=1, timeout_s=0, directory=str(tmp_path))
    cache = build(tmp_path, "next")
    assert files(tmp_path) == [file_name("next")] and same_pixels(cache)


def test_a_reused_pid_is_not_taken_for_the_owner(tmp_path: Path) -> None:
    """A leftover whose recorded pid now belongs to a live process (here: this one) that started at another time."""
    ours = build(tmp_path)
    me = Owner.current()
    assert me.start_ticks == start_ticks(os.getpid())
    layout = Layout.of(SHAPES)
    forged = mine(tmp_path) / file_name("reused")
    forged.write_bytes(layout.head("reused", Owner(me.pid, me.start_ticks - 1, me.pid_ns)).ljust(layout.size, b"\0"))
    forged.chmod(0o600)
    with pytest.raises(DatasetError, match=f"left by process {me.pid}, which has ended"):
        wait(tmp_path, "reused")
    remove_stale(str(tmp_path))
    assert not forged.exists() and Path(ours.path).exists()  # the file of the live owner stays


# ---------------------------------------------------------------- files that lie


def _pwrite(path: str, data: bytes, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def _replace_with_fifo(path: str) -> None:
    os.unlink(path)
    os.mkfifo(path, 0o600)


N_AT, SHAPES_AT = 32, HEADER.size  # where the header keeps the image count and the shapes start
FORGERIES: dict[str, tuple[Callable[[str], None], str]] = {
    "truncated": (lambda p: os.truncate(p, os.path.getsize(p) - 1), "its size is"),
    "grown": (lambda p: os.truncate(p, os.path.getsize(p) + 4096), "its size is"),
    "bad magic": (lambda p: _pwrite(p, b"NOTRAM00", 0), "does not start like"),
    "more images": (lambda p: _pwrite(p, (10**9).to_bytes(8, "little"), N_AT), "header says"),
    "larger image": (lambda p: _pwrite(p, (10**6).to_bytes(4, "little"), SHAPES_AT), "image sizes"),
    "another key": (lambda p: _pwrite(p, b"zz", 56), "another cache key"),
    "bad flags": (lambda p: _pwrite(p, b"\x07", SHAPES_AT + 8 * len(SHAPES)), "flags"),
    "a fifo": (_replace_with_fifo, "not a regular file"),
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_truncated_or_forged_file_is_refused_never_read_out_of_bounds(tmp_path: Path, forgery: str) -> None:
    cache = build(tmp_path)
    forge, reason = FORGERIES[forgery]
    forge(cache.path)
    with pytest.raises(DatasetError, match=f"refused: .*{reason}"):
        wait(tmp_path)
    worker_copy = pickle.loads(pickle.dumps(cache))  # a spawned loader worker opens the file anew
    with pytest.raises(DatasetError, match=f"cannot use the RAM image cache .*{reason}"):
        worker_copy.get(0)
    assert same_pixels(build(tmp_path)) and same_pixels(wait(tmp_path))  # the owner rebuilds it
