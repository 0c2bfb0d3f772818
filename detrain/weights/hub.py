"""Bare weight names (``n.pt``, ``yolov8s.pt``, ``yolo11n.pt``, ``yolo26n.pt``) -> a local file: current folder,
cache, else one checked download.

``resolve_weights("yolov8n.pt")`` looks for ``./yolov8n.pt``, then ``$DETRAIN_WEIGHTS_DIR/yolov8n.pt``
(default ``~/.cache/detrain/weights``), and only then downloads the COCO-pretrained Ultralytics release file
once into that cache. A download is written to a temporary file beside its final place, checked against
the sha256 and size recorded in :data:`RELEASE_FILES`, and moved into place atomically, so an interrupted,
oversized or altered download never leaves a file that a later run would trust.

A name with no recorded sha256 is never downloaded unless the caller gives the hash (``weights_sha256=``
on the command line, ``Model(..., weights_sha256=...)`` in Python). A given hash also overrides the
recorded one, for a mirror (``DETRAIN_WEIGHTS_URL``) that serves another release, and is checked against
any weights file it comes with, local or downloaded.

The recorded YOLOv8 hashes are those of the ``v0.0.0`` release of ultralytics/assets, the files Ultralytics
itself mirrors on Hugging Face (``Ultralytics/YOLOv8``, whose Git LFS pointers carry the same sha256 and
sizes); later releases (v8.1.0 onwards) re-saved the files, so their bytes and hashes differ. YOLO11 files
come from the ``v8.3.0`` release that introduced them, YOLO26 ones from ``v8.4.0``.

Environment:
    DETRAIN_WEIGHTS_DIR   the cache folder (default ``~/.cache/detrain/weights``)
    DETRAIN_WEIGHTS_URL   the URL template, with ``{name}`` for the canonical file name and optionally
                          ``{release}`` for its release tag (a mirror, or a local server in tests);
                          default: :data:`DEFAULT_URL`.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import string
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from detrain.errors import CheckpointError
from detrain.system import net
from detrain.system.input_file import UnreadableFile, open_input
from detrain.system.tempfiles import temp_beside
from detrain.system.text import excerpt, shown

__all__ = [
    "DEFAULT_URL",
    "RELEASE_FILES",
    "ReleaseFile",
    "canonical_name",
    "file_sha256",
    "resolve_weights",
    "weights_dir",
    "weights_url",
]

DEFAULT_URL = "https://github.com/ultralytics/assets/releases/download/{release}/{name}"


@dataclass(frozen=True)
class ReleaseFile:
    """What a release file must be: its sha256, its size in bytes (0: not known), and the ultralytics/assets
    release that holds it."""

    sha256: str
    size: int
    release: str = "v0.0.0"


# The files behind DEFAULT_URL, by canonical name. A name missing here is downloaded only with a given hash.
RELEASE_FILES: dict[str, ReleaseFile] = {
    "yolov8n.pt": ReleaseFile("31e20dde3def09e2cf938c7be6fe23d9150bbbe503982af13345706515f2ef95", 6_534_387),
    "yolov8s.pt": ReleaseFile("268e5bb54c640c96c3510224833bc2eeacab4135c6deb41502156e39986b562d", 22_573_363),
    "yolov8m.pt": ReleaseFile("6c25b0b63b1a433843f06d821a9ac1deb8d5805f74f0f38772c7308c5adc55a5", 52_117_635),
    "yolov8l.pt": ReleaseFile("18218ea4798da042d9862e6029ca9531adbd40ace19b6c9a75e2e28f1adf30cc", 87_769_683),
    "yolov8x.pt": ReleaseFile("c4d5a3f000d771762f03fc8b57ebd0aae324aeaefdd6e68492a9c4470f2d1e8b", 136_867_539),
    "yolo11n.pt": ReleaseFile("0ebbc80d4a7680d14987a577cd21342b65ecfd94632bd9a8da63ae6417644ee1", 5_613_764, "v8.3.0"),
    "yolo11s.pt": ReleaseFile("85a76fe86dd8afe384648546b56a7a78580c7cb7b404fc595f97969322d502d5", 19_313_732, "v8.3.0"),
    "yolo26n.pt": ReleaseFile("9b09cc8bf347f0fc8a5f7657480587f25db09b34bf33b0652110fb03a8ad4fef", 5_544_453, "v8.4.0"),
}
# The release a canonical name without a record would come from (downloaded only with a given hash).
_FAMILY_RELEASE = {"yolov8": "v0.0.0", "yolo11": "v8.3.0", "yolo26": "v8.4.0"}

_SCALES = "nsmlx"
_MAX_UNRECORDED_BYTES = 2 << 30  # a download with a given hash but no recorded size (YOLOv8x is 137 MB)
_TIMEOUT_S = 30.0


def canonical_name(name: str) -> str | None:
    """The release file a bare name stands for (``"s.pt"`` -> ``"yolov8s.pt"``), or None if it is not one.

    Example:
        >>> canonical_name("n.pt"), canonical_name("YOLOv8x.pt"), canonical_name("runs/best.pt")
        ('yolov8n.pt', 'yolov8x.pt', None)
        >>> canonical_name("YOLO11s.pt"), canonical_name("yolo26n.pt")
        ('yolo11s.pt', 'yolo26n.pt')
    """
    if os.path.dirname(name):
        return None
    low = name.lower()
    for scale in _SCALES:
        if low == f"{scale}.pt":
            return f"yolov8{scale}.pt"
        for family in _FAMILY_RELEASE:
            if low == f"{family}{scale}.pt":
                return low
    return None


def weights_dir() -> Path:
    """The weights cache: ``$DETRAIN_WEIGHTS_DIR`` or ``~/.cache/detrain/weights``.

    Example:
        >>> weights_dir().relative_to(Path.home()).as_posix()    # without $DETRAIN_WEIGHTS_DIR
        '.cache/detrain/weights'
    """
    env = os.environ.get("DETRAIN_WEIGHTS_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "detrain" / "weights"


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file, as ``sha256sum`` prints it.

    Example:
        >>> with open("abc.txt", "wb") as f:
        ...     _ = f.write(b"abc")
        >>> file_sha256("abc.txt")
        'ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad'
    """
    digest = hashlib.sha256()
    try:
        with open_input(path, 1 << 40) as fh:  # a regular file: a FIFO or device is refused, never waited on
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
    except UnreadableFile as e:
        raise CheckpointError(f"{shown(str(path))}: cannot read it ({e})") from None
    return digest.hexdigest()


def local_weights(name_or_path: str | os.PathLike[str]) -> Path | None:
    """The file a path or a bare release name means on this machine, found as :func:`resolve_weights` finds it
    (the path itself; for a release name, the current folder, then the weights cache), never downloaded or
    checked; None when there is none.

    Example:
        >>> local_weights("missing.pt") is None
        True
    """
    given = Path(name_or_path).expanduser()
    if given.exists():
        return given
    canonical = canonical_name(str(name_or_path))
    if canonical is None:
        return None
    return next((p for p in (Path.cwd() / canonical, weights_dir() / canonical) if p.is_file()), None)


def resolve_weights(name_or_path: str | os.PathLike[str], progress: bool = True, sha256: str | None = None) -> Path:
    """A weights file on disk for a path or a bare release name, downloading the release file if needed.

    An existing path is returned as it is. ``n.pt s.pt m.pt l.pt x.pt`` and ``yolov8n.pt`` ...
    ``yolov8x.pt`` mean the COCO-pretrained YOLOv8 weights of that scale, ``yolo11n.pt`` ... ``yolo11x.pt``
    the YOLO11 ones, ``yolo26n.pt`` ... ``yolo26x.pt`` the YOLO26 ones. Anything
    else that does not exist raises ``CheckpointError("weights file not found: <path>")``. ``sha256`` (64 hex
    digits), when given, is the hash the file must have, wherever it is found, and the one a download is
    checked against.

    ``resolve_weights("n.pt")`` is ``~/.cache/detrain/weights/yolov8n.pt``, downloaded the first time.

    Example:
        >>> resolve_weights("missing.pt")
        Traceback (most recent call last):
        ...
        detrain.errors.CheckpointError: weights file not found: missing.pt
    """
    expected = _checked_sha256(sha256)
    canonical = canonical_name(str(name_or_path))
    release = RELEASE_FILES.get(canonical) if canonical is not None else None
    found = local_weights(name_or_path)
    if found is not None:
        return _verified(found, expected, release)
    if canonical is None:
        raise CheckpointError(f"weights file not found: {name_or_path}")
    cached = weights_dir() / canonical
    if expected is not None and (release is None or release.sha256 != expected):
        tag = _FAMILY_RELEASE.get(canonical[: -len("n.pt")], "v0.0.0")
        release = ReleaseFile(expected, size=0, release=tag)  # the caller's file: its size is not known
    if release is None:
        raise CheckpointError(
            f"no sha256 recorded for {canonical}: not downloading it unchecked; pass weights_sha256=<its sha256> "
            f"or put the file at {cached}"
        )
    url = weights_url(canonical, release.release)
    _download(url, cached, release, progress)
    return cached


def weights_url(name: str, release: str) -> str:
    """``$DETRAIN_WEIGHTS_URL`` (default :data:`DEFAULT_URL`) filled in for ``name`` and ``release``; a template
    that is not an http(s) URL with at most the fields ``{name}`` and ``{release}`` is one CheckpointError line.

    Example:
        >>> weights_url("yolov8n.pt", "v0.0.0")
        'https://github.com/ultralytics/assets/releases/download/v0.0.0/yolov8n.pt'
    """
    template = os.environ.get("DETRAIN_WEIGHTS_URL", DEFAULT_URL)
    problem = _url_template_problem(template)
    if problem is not None:
        raise CheckpointError(
            f"DETRAIN_WEIGHTS_URL={excerpt(template, 80)} is not usable: {problem}; give an http(s) URL where "
            "{name} stands for the file name and {release} for its release tag"
        )
    return template.format(name=name, release=release)


def _url_template_problem(template: str) -> str | None:
    """What is wrong with a weights URL template, or None."""
    if not template.lower().startswith(("https://", "http://")):
        return "it is not an http:// or https:// URL"
    try:
        fields = list(string.Formatter().parse(template))
    except ValueError as e:
        return f"its braces do not pair ({e})"
    for _, field, spec, conversion in fields:
        if field is None:
            continue
        if field not in ("name", "release") or spec or conversion:
            return f"{{{excerpt(field, 30, quote=False)}}} is not {{name}} or {{release}}"
    return None


def _checked_sha256(sha256: str | None) -> str | None:
    if sha256 is None or not str(sha256).strip():
        return None
    value = str(sha256).strip().lower()
    if not net.is_sha256(value):
        raise CheckpointError(
            f"weights_sha256: {excerpt(sha256)} is not a sha256; give the 64 hex digits sha256sum prints"
        )
    return value


def _verified(path: Path, expected: str | None, release: ReleaseFile | None = None) -> Path:
    """``path`` when its hash matches the one given (``expected``), else the pinned one of the release file a bare
    name stands for (``release``: ``./yolov8n.pt`` and the cache's copy are checked like a download); with
    neither, as it is. Never deletes a file it did not write."""
    if expected is not None:
        got = file_sha256(path)
        if got != expected:
            raise CheckpointError(f"{path} has sha256 {got}, expected {expected} (weights_sha256): not loading it")
    elif release is not None:
        size = path.stat().st_size
        got = file_sha256(path) if not release.size or size == release.size else f"another size ({size} bytes)"
        if got != release.sha256:
            raise CheckpointError(
                f"{shown(str(path))} is not the pinned release file (sha256 {got}, pinned {release.sha256}): not "
                f"loading it; to load your own file of that name give its path (./{shown(path.name)}) or "
                "weights_sha256="
            )
    return path


def _download(url: str, dest: Path, release: ReleaseFile, progress: bool) -> None:
    """Fetch ``url`` to ``dest`` through a temporary file; on any failure nothing is left behind."""
    by_hand = f"put the file at {dest} or in the current folder"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the weights cache {dest.parent}: {e.strerror}") from None
    limit = release.size or _MAX_UNRECORDED_BYTES
    # In the destination folder, so the final os.replace is a rename on one filesystem (atomic).
    fd, tmp_name = temp_beside(dest, ".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                response = net.open_url(url, _TIMEOUT_S)
            except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
                reason = getattr(e, "reason", None) or e
                raise CheckpointError(f"cannot download {dest.name} from {url} ({reason}); {by_hand}") from None
            with response:
                declared = net.content_length(response)
                if declared is not None and declared > limit:
                    raise CheckpointError(
                        f"refusing the download of {dest.name} from {url}: the server announces {declared} bytes, "
                        f"{'the file has' if release.size else 'the cap is'} {limit}"
                    )
                try:
                    received, got = _copy(response, out, dest.name, declared, limit, progress)
                except net.BodyTooLarge:
                    raise CheckpointError(
                        f"refusing the download of {dest.name} from {url}: the server sent more than {limit} bytes"
                    ) from None
                except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
                    raise CheckpointError(f"download of {dest.name} from {url} broke off ({e}); {by_hand}") from None
        if declared is not None and received != declared:
            raise CheckpointError(
                f"download of {dest.name} from {url} broke off after {received} of {declared} bytes; {by_hand}"
            )
        if got != release.sha256:
            raise CheckpointError(
                f"download of {dest.name} from {url} has sha256 {got}, expected {release.sha256}: deleted it"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)  # after a successful replace the temporary name is already gone


def _copy(response: Any, out: IO[bytes], label: str, total: int | None, limit: int, progress: bool) -> tuple[int, str]:
    """The body into ``out`` (with a rich progress bar when asked for): (bytes, sha256)."""
    if not progress:
        return net.copy_body(response, out, limit)
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    columns = (TextColumn("downloading {task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task(label, total=total)
        return net.copy_body(response, out, limit, lambda n: bar.update(task, advance=n))
