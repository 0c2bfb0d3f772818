"""Bare weight names (``n.pt``, ``yolov8s.pt``) -> a local file: current folder, cache, else one download.

``resolve_weights("yolov8n.pt")`` looks for ``./yolov8n.pt``, then ``$DETRAIN_WEIGHTS_DIR/yolov8n.pt``
(default ``~/.cache/detrain/weights``), and only then downloads the COCO-pretrained YOLOv8 release file
once into that cache. A download is written to a temporary file beside its final place, checked against
the sha256 recorded in :data:`KNOWN_SHA256`, and moved into place atomically, so an interrupted or
corrupted download never leaves a file that a later run would trust.

Scales whose sha256 we have not recorded yet (every scale but ``n`` today) are accepted with a warning:
the file is still read by the restricted unpickler in :mod:`detrain.weights.safe_pickle`, so an altered
file can give wrong weights but cannot run code.

Environment:
    DETRAIN_WEIGHTS_DIR   the cache folder (default ``~/.cache/detrain/weights``)
    DETRAIN_WEIGHTS_URL   the URL template, with ``{name}`` for the canonical file name (a mirror, or a
                          local server in tests); default: the YOLOv8 release assets.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.error
import urllib.request
import warnings
from pathlib import Path

from detrain.errors import CheckpointError

__all__ = ["DEFAULT_URL", "KNOWN_SHA256", "canonical_name", "resolve_weights", "weights_dir"]

DEFAULT_URL = "https://github.com/ultralytics/assets/releases/download/v8.3.0/{name}"

# sha256 of the official release files, by canonical name. None: not recorded yet -> warn and accept.
KNOWN_SHA256: dict[str, str | None] = {
    "yolov8n.pt": "31e20dde3def09e2cf938c7be6fe23d9150bbbe503982af13345706515f2ef95",
    "yolov8s.pt": None,
    "yolov8m.pt": None,
    "yolov8l.pt": None,
    "yolov8x.pt": None,
}

_SCALES = "nsmlx"
_CHUNK = 1 << 20
_TIMEOUT_S = 30.0


def canonical_name(name: str) -> str | None:
    """The release file a bare name stands for (``"s.pt"`` -> ``"yolov8s.pt"``), or None if it is not one.

    Example:
        >>> canonical_name("n.pt"), canonical_name("YOLOv8x.pt"), canonical_name("runs/best.pt")
        ('yolov8n.pt', 'yolov8x.pt', None)
    """
    if os.path.dirname(name):
        return None
    low = name.lower()
    for scale in _SCALES:
        if low in (f"{scale}.pt", f"yolov8{scale}.pt"):
            return f"yolov8{scale}.pt"
    return None


def weights_dir() -> Path:
    """The weights cache: ``$DETRAIN_WEIGHTS_DIR`` or ``~/.cache/detrain/weights``.

    Example:
        >>> weights_dir().name                                   # doctest: +SKIP
        'weights'
    """
    env = os.environ.get("DETRAIN_WEIGHTS_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "detrain" / "weights"


def resolve_weights(name_or_path: str | os.PathLike[str], progress: bool = True) -> Path:
    """A weights file on disk for a path or a bare YOLOv8 name, downloading the release file if needed.

    An existing path is returned as it is. ``n.pt s.pt m.pt l.pt x.pt`` and ``yolov8n.pt`` ...
    ``yolov8x.pt`` mean the COCO-pretrained YOLOv8 weights of that scale. Anything else that does not
    exist raises ``CheckpointError("weights file not found: <path>")``.

    Example:
        >>> resolve_weights("n.pt")                              # doctest: +SKIP
        PosixPath('/home/me/.cache/detrain/weights/yolov8n.pt')
    """
    given = Path(name_or_path).expanduser()
    if given.exists():
        return given
    canonical = canonical_name(str(name_or_path))
    if canonical is None:
        raise CheckpointError(f"weights file not found: {name_or_path}")
    local = Path.cwd() / canonical
    if local.is_file():
        return local
    cache = weights_dir()
    cached = cache / canonical
    if cached.is_file():
        return cached
    url = os.environ.get("DETRAIN_WEIGHTS_URL", DEFAULT_URL).format(name=canonical)
    _download(url, cached, KNOWN_SHA256.get(canonical), progress)
    return cached


def _download(url: str, dest: Path, sha256: str | None, progress: bool) -> None:
    """Fetch ``url`` to ``dest`` through a temporary file; on any failure nothing is left behind."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the weights cache {dest.parent}: {e.strerror}") from None
    # In the destination folder, so the final os.replace is a rename on one filesystem (atomic).
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            try:
                response = urllib.request.urlopen(url, timeout=_TIMEOUT_S)
            except (urllib.error.URLError, OSError, ValueError) as e:
                reason = getattr(e, "reason", None) or e
                raise CheckpointError(
                    f"cannot download {dest.name} from {url} ({reason}); put the file at {dest} "
                    f"or in the current folder"
                ) from None
            with response:
                total = int(response.headers.get("Content-Length") or 0) or None
                try:
                    for chunk in _chunks(response, dest.name, total, progress):
                        digest.update(chunk)
                        out.write(chunk)
                except (urllib.error.URLError, OSError) as e:
                    raise CheckpointError(
                        f"download of {dest.name} from {url} broke off ({e}); put the file at {dest} "
                        f"or in the current folder"
                    ) from None
        got = digest.hexdigest()
        if sha256 is None:
            warnings.warn(
                f"no sha256 recorded for {dest.name}: accepting the download from {url} (sha256 {got})",
                stacklevel=3,
            )
        elif got != sha256:
            raise CheckpointError(
                f"download of {dest.name} from {url} has sha256 {got}, expected {sha256}: deleted it"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)  # after a successful replace the temporary name is already gone


def _chunks(response, label: str, total: int | None, progress: bool):  # type: ignore[no-untyped-def]
    """The response body in chunks, with a rich progress bar when asked for."""
    if not progress:
        while chunk := response.read(_CHUNK):
            yield chunk
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    columns = (TextColumn("downloading {task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task(label, total=total)
        while chunk := response.read(_CHUNK):
            bar.update(task, advance=len(chunk))
            yield chunk
