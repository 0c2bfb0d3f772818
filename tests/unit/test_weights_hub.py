"""Bare weight names resolve to the current folder, the cache, or one checked download (local server only)."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from _http_server import Server

from detrain.errors import CheckpointError
from detrain.system import net
from detrain.weights import hub
from detrain.weights.hub import ReleaseFile, canonical_name, resolve_weights

SHARED_PT = Path(__file__).resolve().parents[3] / "shared" / "weights" / "yolov8n.pt"
UNRECORDED = b"bytes that are not the release's yolov8s.pt"


def _use(server: Server, monkeypatch: pytest.MonkeyPatch, prefix: str) -> None:
    """Point DETRAIN_WEIGHTS_URL at ``/<prefix>/<name>`` of ``server``."""
    monkeypatch.setenv("DETRAIN_WEIGHTS_URL", f"http://127.0.0.1:{server.port}/{prefix}/{{name}}")


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Server, bytes]]:
    """Serve yolov8n.pt (the real one when shared/ has it, else a small fake with its sha recorded)."""
    root = tmp_path / "served"
    root.mkdir()
    if SHARED_PT.is_file():
        shutil.copyfile(SHARED_PT, root / "yolov8n.pt")
    else:
        fake = b"not really weights" * 1000
        (root / "yolov8n.pt").write_bytes(fake)
        monkeypatch.setitem(hub.RELEASE_FILES, "yolov8n.pt", ReleaseFile(_sha(fake), len(fake)))
    (root / "yolov8s.pt").write_bytes(UNRECORDED)
    server = Server(root)
    monkeypatch.setenv("DETRAIN_WEIGHTS_URL", f"http://127.0.0.1:{server.port}/{{name}}")
    monkeypatch.setenv("DETRAIN_WEIGHTS_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    try:
        yield server, (root / "yolov8n.pt").read_bytes()
    finally:
        server.close()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _left_in(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_canonical_names() -> None:
    assert canonical_name("n.pt") == "yolov8n.pt"
    assert canonical_name("yolov8m.pt") == "yolov8m.pt"
    assert canonical_name("X.PT") == "yolov8x.pt"
    assert canonical_name("yolov8q.pt") is None
    assert canonical_name("weights/n.pt") is None
    assert canonical_name("YOLO11s.pt") == "yolo11s.pt" and canonical_name("yolo11x.pt") == "yolo11x.pt"
    assert canonical_name("yolo26n.pt") == "yolo26n.pt"
    assert canonical_name("yolov11n.pt") is None and canonical_name("yolo12n.pt") is None


def test_a_yolo11_name_downloads_from_its_own_release(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The URL template's {release} is the record's tag: YOLO11 files are not in the v0.0.0 release."""
    payload = b"stands in for yolo11n.pt" * 100
    root = tmp_path / "served" / "v8.3.0"
    root.mkdir(parents=True)
    (root / "yolo11n.pt").write_bytes(payload)
    monkeypatch.setitem(hub.RELEASE_FILES, "yolo11n.pt", ReleaseFile(_sha(payload), len(payload), "v8.3.0"))
    server = Server(tmp_path / "served")
    monkeypatch.setenv("DETRAIN_WEIGHTS_URL", f"http://127.0.0.1:{server.port}/{{release}}/{{name}}")
    monkeypatch.setenv("DETRAIN_WEIGHTS_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    try:
        assert resolve_weights("YOLO11n.pt", progress=False).read_bytes() == payload
    finally:
        server.close()
    assert server.hits == ["/v8.3.0/yolo11n.pt"]


def test_existing_path_is_returned(tmp_path: Path) -> None:
    f = tmp_path / "best.pt"
    f.write_bytes(b"x")
    assert resolve_weights(str(f)) == f


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"^weights file not found: .*nope\.pt$"):
        resolve_weights(str(tmp_path / "nope.pt"))


def test_downloads_once_then_uses_the_cache(served: tuple[Server, bytes], tmp_path: Path) -> None:
    server, payload = served
    first = resolve_weights("n.pt", progress=True)
    assert first == tmp_path / "cache" / "yolov8n.pt"
    assert first.read_bytes() == payload
    assert server.hits == ["/yolov8n.pt"]
    assert resolve_weights("yolov8n.pt", progress=False) == first
    assert server.hits == ["/yolov8n.pt"]  # the second call made no request
    assert [p.name for p in first.parent.iterdir()] == ["yolov8n.pt"]  # no temporary file left


def test_current_folder_is_preferred(served: tuple[Server, bytes], tmp_path: Path) -> None:
    server, real = served
    (tmp_path / "yolov8n.pt").write_bytes(real)  # the release file (another one is refused: see below)
    assert resolve_weights("n.pt") == tmp_path / "yolov8n.pt"
    assert server.hits == []


def test_sha_mismatch_is_refused_and_nothing_is_left(
    served: tuple[Server, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, payload = served
    monkeypatch.setitem(hub.RELEASE_FILES, "yolov8n.pt", ReleaseFile("0" * 64, len(payload)))
    with pytest.raises(CheckpointError) as err:
        resolve_weights("n.pt", progress=False)
    message = str(err.value)
    assert "\n" not in message and "yolov8n.pt" in message
    assert f"has sha256 {_sha(payload)}, expected {'0' * 64}" in message
    assert _left_in(tmp_path / "cache") == []


def test_a_name_without_a_recorded_sha_is_not_downloaded(
    served: tuple[Server, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _ = served
    monkeypatch.delitem(hub.RELEASE_FILES, "yolov8s.pt")
    with pytest.raises(CheckpointError, match=r"^no sha256 recorded for yolov8s\.pt: .*pass weights_sha256="):
        resolve_weights("s.pt", progress=False)
    assert server.hits == [] and _left_in(tmp_path / "cache") == []


def test_a_given_sha_downloads_an_unrecorded_name(
    served: tuple[Server, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(hub.RELEASE_FILES, "yolov8s.pt")
    path = resolve_weights("s.pt", progress=False, sha256=_sha(UNRECORDED).upper())
    assert path == tmp_path / "cache" / "yolov8s.pt" and path.read_bytes() == UNRECORDED
    assert _left_in(tmp_path / "cache") == ["yolov8s.pt"]


def test_a_given_sha_overrides_the_recorded_one_for_another_release(
    served: tuple[Server, bytes], tmp_path: Path
) -> None:
    # The served yolov8s.pt is not the recorded release file: refused as it is, accepted with its own hash.
    recorded = hub.RELEASE_FILES["yolov8s.pt"].sha256
    with pytest.raises(CheckpointError, match=rf"yolov8s\.pt .* has sha256 {_sha(UNRECORDED)}, expected {recorded}"):
        resolve_weights("s.pt", progress=False)
    assert _left_in(tmp_path / "cache") == []
    assert resolve_weights("s.pt", progress=False, sha256=_sha(UNRECORDED)).read_bytes() == UNRECORDED


def test_a_given_sha_that_does_not_match_is_refused(served: tuple[Server, bytes], tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=rf"has sha256 {_sha(UNRECORDED)}, expected {'a' * 64}: deleted it"):
        resolve_weights("s.pt", progress=False, sha256="a" * 64)
    assert _left_in(tmp_path / "cache") == []


def test_a_given_sha_checks_a_local_file_and_never_deletes_it(tmp_path: Path) -> None:
    mine = tmp_path / "best.pt"
    mine.write_bytes(b"my weights")
    assert resolve_weights(mine, sha256=_sha(b"my weights")) == mine
    with pytest.raises(CheckpointError, match=rf"best\.pt has sha256 {_sha(b'my weights')}, expected {'b' * 64}"):
        resolve_weights(mine, sha256="b" * 64)
    assert mine.read_bytes() == b"my weights"


@pytest.mark.parametrize("bad", ["abc", "g" * 64, "0" * 63])
def test_a_malformed_sha_is_a_clear_error(tmp_path: Path, bad: str) -> None:
    with pytest.raises(CheckpointError, match=r"weights_sha256: .* is not a sha256; give the 64 hex digits"):
        resolve_weights(tmp_path / "x.pt", sha256=bad)


@pytest.mark.parametrize(
    ("prefix", "message"),
    [
        ("cut", "broke off after {half} of {size} bytes"),  # the server hangs up mid-body
        ("more", "the server sent more than {size} bytes"),  # a body longer than the release file is cut off
    ],
)
def test_a_broken_transfer_leaves_nothing(
    served: tuple[Server, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefix: str, message: str
) -> None:
    server, payload = served
    _use(server, monkeypatch, prefix)
    with pytest.raises(CheckpointError, match=message.format(half=len(payload) // 2, size=len(payload))):
        resolve_weights("n.pt", progress=False)
    assert _left_in(tmp_path / "cache") == []


def test_a_redirect_within_http_is_followed(
    served: tuple[Server, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, payload = served
    _use(server, monkeypatch, "moved")
    assert resolve_weights("n.pt", progress=False).read_bytes() == payload
    assert server.hits == ["/moved/yolov8n.pt", "/yolov8n.pt"]


def test_recorded_hashes_are_the_default_release_files() -> None:
    assert hub.DEFAULT_URL.startswith("https://")
    assert sorted(hub.RELEASE_FILES) == sorted(
        [f"yolov8{s}.pt" for s in "lmnsx"] + ["yolo11n.pt", "yolo11s.pt", "yolo26n.pt"]
    )
    for release in hub.RELEASE_FILES.values():
        assert len(release.sha256) == 64 and int(release.sha256, 16) >= 0 and release.size > 0
    # each family from the ultralytics/assets release that published it
    url = {name: hub.DEFAULT_URL.format(name=name, release=r.release) for name, r in hub.RELEASE_FILES.items()}
    assert url["yolov8n.pt"] == "https://github.com/ultralytics/assets/releases/download/v0.0.0/yolov8n.pt"
    assert url["yolo11s.pt"] == "https://github.com/ultralytics/assets/releases/download/v8.3.0/yolo11s.pt"
    assert url["yolo26n.pt"] == "https://github.com/ultralytics/assets/releases/download/v8.4.0/yolo26n.pt"
    assert hub.RELEASE_FILES["yolo11n.pt"] == hub.ReleaseFile(
        "0ebbc80d4a7680d14987a577cd21342b65ecfd94632bd9a8da63ae6417644ee1", 5_613_764, "v8.3.0"
    )
    if not SHARED_PT.is_file():
        pytest.skip("shared/weights/yolov8n.pt is absent")
    n = hub.RELEASE_FILES["yolov8n.pt"]
    assert (hub.file_sha256(SHARED_PT), SHARED_PT.stat().st_size) == (n.sha256, n.size)


def test_missing_on_server_is_a_clear_error(served: tuple[Server, bytes], tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"cannot download yolov8m.pt .*put the file at"):
        resolve_weights("m.pt", progress=False)
    assert list((tmp_path / "cache").iterdir()) == []


def test_server_down_is_a_clear_error(served: tuple[Server, bytes], tmp_path: Path) -> None:
    server, _ = served
    server.close()
    with pytest.raises(CheckpointError) as err:
        resolve_weights("n.pt", progress=False)
    message = str(err.value)
    assert "\n" not in message
    assert "cannot download yolov8n.pt" in message
    assert str(tmp_path / "cache" / "yolov8n.pt") in message
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_download_announcing_more_than_the_release_file_is_refused(
    served: tuple[Server, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, payload = served
    monkeypatch.setitem(hub.RELEASE_FILES, "yolov8n.pt", ReleaseFile(_sha(payload), len(payload) - 1))
    with pytest.raises(CheckpointError, match=rf"announces {len(payload)} bytes, the file has {len(payload) - 1}"):
        resolve_weights("n.pt", progress=False)
    assert _left_in(tmp_path / "cache") == []


def test_the_redirect_policy_keeps_https_on_https() -> None:
    assert net.redirect_allowed("https://github.com/a.pt", "https://objects.githubusercontent.com/a.pt")
    assert net.redirect_allowed("http://127.0.0.1/a.pt", "/b.pt")  # relative: same scheme
    assert net.redirect_allowed("http://x.org/a.pt", "https://x.org/a.pt")
    assert not net.redirect_allowed("https://github.com/a.pt", "http://mirror.example/a.pt")
    assert not net.redirect_allowed("https://github.com/a.pt", "ftp://mirror.example/a.pt")
    assert not net.redirect_allowed("http://x.org/a.pt", "file:///etc/passwd")
    handler = net.SafeRedirects()
    request = urllib.request.Request("https://github.com/a.pt")
    with pytest.raises(net.RedirectRefused, match=r"from https://github\.com/a\.pt to http://mirror\.example/a\.pt"):
        handler.redirect_request(request, io.BytesIO(), 302, "Found", {}, "http://mirror.example/a.pt")
    followed = handler.redirect_request(request, io.BytesIO(), 302, "Found", {}, "https://cdn.example/a.pt")
    assert followed.full_url == "https://cdn.example/a.pt"


def test_an_https_to_http_redirect_stops_the_download(
    served: tuple[Server, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No TLS on a test server: judge each hop as if the first URL had been https (the real policy decides).
    server, _ = served
    policy = net.redirect_allowed
    monkeypatch.setattr(net, "redirect_allowed", lambda old, new: policy(old.replace("http:", "https:", 1), new))
    _use(server, monkeypatch, "moved")
    with pytest.raises(CheckpointError, match=r"^cannot download yolov8n\.pt .*refused the redirect from .* to http:"):
        resolve_weights("n.pt", progress=False)
    assert server.hits == ["/moved/yolov8n.pt"] and _left_in(tmp_path / "cache") == []


# ---- issue 25, item 6: the pinned hash wherever a bare name is found; settings in one line ----------------------


@pytest.mark.parametrize("where", ["cwd", "cache"])
def test_a_bare_name_found_locally_is_checked_against_its_pinned_hash(
    served: tuple[Server, bytes], tmp_path: Path, where: str
) -> None:
    """``./yolov8n.pt`` or the cache's copy that is not the release file is refused like a bad download (it loaded
    unchecked before); the file is left as it is, and its path still loads it as the user's own."""
    server, real = served
    forged = b"planted weights" * 100
    place = tmp_path / "yolov8n.pt" if where == "cwd" else tmp_path / "cache" / "yolov8n.pt"
    place.parent.mkdir(exist_ok=True)
    place.write_bytes(forged)
    for name in ("yolov8n.pt", "n.pt"):
        with pytest.raises(CheckpointError, match=r"is not the pinned release file .* not loading it") as e:
            resolve_weights(name, progress=False)
        assert "\n" not in str(e.value)
    assert place.read_bytes() == forged and server.hits == []
    if where == "cwd":
        assert resolve_weights("./yolov8n.pt", progress=False) == Path("./yolov8n.pt")  # a path: the user's file
    found = resolve_weights("yolov8n.pt", progress=False, sha256=_sha(forged))  # or with its own hash
    assert found.resolve() == place
    place.write_bytes(real)
    assert resolve_weights("yolov8n.pt", progress=False).resolve() == place  # the real one: no download


def test_a_fifo_named_like_the_weights_is_refused_not_waited_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run in a thread: should the reader wait on the FIFO, the test opens its other end to free it and fails."""
    monkeypatch.chdir(tmp_path)
    os.mkfifo("mine.pt")
    outcome: list[BaseException] = []

    def resolve() -> None:
        try:
            resolve_weights("mine.pt", sha256="a" * 64)
        except BaseException as e:  # noqa: BLE001  (handed to the test's thread)
            outcome.append(e)

    reader = threading.Thread(target=resolve, daemon=True)
    reader.start()
    reader.join(20)
    if reader.is_alive():
        with open("mine.pt", "wb"):  # the writer's end: the waiting reader gets end-of-file
            pass
        reader.join(20)
        pytest.fail("resolve_weights waited on a FIFO")
    assert len(outcome) == 1 and isinstance(outcome[0], CheckpointError), outcome
    assert "a FIFO, not a regular file" in str(outcome[0])


@pytest.mark.parametrize(
    ("template", "said"),
    [
        ("{nm}", "not an http:// or https:// URL"),
        ("http://mirror/{nm}", "{nm} is not {name} or {release}"),
        ("http://mirror/{name", "braces do not pair"),
        ("http://mirror/{name.__class__}", "is not {name} or {release}"),
        ("http://mirror/{name!r}", "is not {name} or {release}"),
        ("http://mirror/{0}", "{0} is not"),
        ("ftp://mirror/{name}", "not an http:// or https:// URL"),
    ],
)
def test_a_malformed_weights_url_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, template: str, said: str
) -> None:
    monkeypatch.setenv("DETRAIN_WEIGHTS_URL", template)
    monkeypatch.setenv("DETRAIN_WEIGHTS_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"^DETRAIN_WEIGHTS_URL=") as e:
        resolve_weights("yolov8l.pt", progress=False)
    assert said in str(e.value) and "\n" not in str(e.value)
    assert _left_in(tmp_path / "cache") == []
