"""Bare weight names resolve to the current folder, the cache, or one checked download (local server only)."""

from __future__ import annotations

import functools
import hashlib
import http.server
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from detrain.errors import CheckpointError
from detrain.weights import hub
from detrain.weights.hub import canonical_name, resolve_weights

SHARED_PT = Path(__file__).resolve().parents[2] / "shared" / "weights" / "yolov8n.pt"


class _Server:
    """A file server on 127.0.0.1 that counts the requests it answers."""

    def __init__(self, root: Path) -> None:
        self.requests: list[str] = []
        log = self.requests

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                log.append(self.path)
                super().do_GET()

            def log_message(self, *args: object) -> None:  # keep pytest output clean
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        if not self.thread.is_alive():
            return
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture()
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[_Server, bytes]]:
    """Serve yolov8n.pt (the real one when shared/ has it, else a small fake with its sha recorded)."""
    root = tmp_path / "served"
    root.mkdir()
    if SHARED_PT.is_file():
        shutil.copyfile(SHARED_PT, root / "yolov8n.pt")
    else:
        (root / "yolov8n.pt").write_bytes(b"not really weights" * 1000)
        fake_sha = hashlib.sha256((root / "yolov8n.pt").read_bytes()).hexdigest()
        monkeypatch.setitem(hub.KNOWN_SHA256, "yolov8n.pt", fake_sha)
    (root / "yolov8s.pt").write_bytes(b"a file we hold no sha256 for")
    server = _Server(root)
    monkeypatch.setenv("DETRAIN_WEIGHTS_URL", f"http://127.0.0.1:{server.port}/{{name}}")
    monkeypatch.setenv("DETRAIN_WEIGHTS_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    try:
        yield server, (root / "yolov8n.pt").read_bytes()
    finally:
        server.close()


def test_canonical_names() -> None:
    assert canonical_name("n.pt") == "yolov8n.pt"
    assert canonical_name("yolov8m.pt") == "yolov8m.pt"
    assert canonical_name("X.PT") == "yolov8x.pt"
    assert canonical_name("yolov8q.pt") is None
    assert canonical_name("weights/n.pt") is None


def test_existing_path_is_returned(tmp_path: Path) -> None:
    f = tmp_path / "best.pt"
    f.write_bytes(b"x")
    assert resolve_weights(str(f)) == f


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"^weights file not found: .*nope\.pt$"):
        resolve_weights(str(tmp_path / "nope.pt"))


def test_downloads_once_then_uses_the_cache(served: tuple[_Server, bytes], tmp_path: Path) -> None:
    server, payload = served
    first = resolve_weights("n.pt", progress=True)
    assert first == tmp_path / "cache" / "yolov8n.pt"
    assert first.read_bytes() == payload
    assert server.requests == ["/yolov8n.pt"]
    assert resolve_weights("yolov8n.pt", progress=False) == first
    assert server.requests == ["/yolov8n.pt"]  # the second call made no request
    assert [p.name for p in first.parent.iterdir()] == ["yolov8n.pt"]  # no temporary file left


def test_current_folder_is_preferred(served: tuple[_Server, bytes], tmp_path: Path) -> None:
    server, _ = served
    (tmp_path / "yolov8n.pt").write_bytes(b"mine")
    assert resolve_weights("n.pt") == tmp_path / "yolov8n.pt"
    assert server.requests == []


def test_sha_mismatch_is_refused_and_nothing_is_left(
    served: tuple[_Server, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(hub.KNOWN_SHA256, "yolov8n.pt", "0" * 64)
    with pytest.raises(CheckpointError, match="has sha256 .*expected 0000"):
        resolve_weights("n.pt", progress=False)
    cache = tmp_path / "cache"
    assert not cache.exists() or list(cache.iterdir()) == []


def test_unknown_sha_warns_and_accepts(served: tuple[_Server, bytes], tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="no sha256 recorded for yolov8s.pt"):
        path = resolve_weights("s.pt", progress=False)
    assert path.read_bytes() == b"a file we hold no sha256 for"


def test_missing_on_server_is_a_clear_error(
    served: tuple[_Server, bytes], tmp_path: Path
) -> None:
    with pytest.raises(CheckpointError, match=r"cannot download yolov8m.pt .*put the file at"):
        resolve_weights("m.pt", progress=False)
    assert list((tmp_path / "cache").iterdir()) == []


def test_server_down_is_a_clear_error(served: tuple[_Server, bytes], tmp_path: Path) -> None:
    server, _ = served
    server.close()
    with pytest.raises(CheckpointError) as err:
        resolve_weights("n.pt", progress=False)
    message = str(err.value)
    assert "\n" not in message
    assert "cannot download yolov8n.pt" in message
    assert str(tmp_path / "cache" / "yolov8n.pt") in message
    assert list((tmp_path / "cache").iterdir()) == []
