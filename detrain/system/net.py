"""Opening a download URL and reading its body: no redirect from https down to http, and a cap on the bytes.

``urllib.request.urlopen`` follows redirects on its own, from ``https://`` to plain ``http://`` too: whoever
can answer that plain hop (a hostile network, a captive portal) then serves the bytes. :func:`open_url` is
``urlopen`` with :class:`SafeRedirects`, which refuses such a hop and any redirect to a scheme other than
http or https. :func:`copy_body` streams a response into a file while counting and hashing it, and stops
at a cap whatever the server declared, so a server cannot fill the disk by lying about the length.

Both weight downloads (:mod:`detrain.weights.hub`) and dataset downloads (:mod:`detrain.data.download`)
use them; each turns the errors below into its own one-line message.

Example:
    >>> redirect_allowed("https://github.com/a.zip", "https://objects.githubusercontent.com/a.zip")
    True
    >>> redirect_allowed("https://github.com/a.zip", "http://mirror.example/a.zip")
    False
"""

from __future__ import annotations

import hashlib
import os
import re
import tarfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable
from http.client import HTTPMessage
from typing import IO, Any

from detrain.system.input_file import open_input, reason_of

__all__ = [
    "BodyTooLarge",
    "RedirectRefused",
    "SafeRedirects",
    "content_length",
    "copy_body",
    "is_sha256",
    "local_archive_problem",
    "open_url",
    "redirect_allowed",
]

_CHUNK = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


def is_sha256(text: str) -> bool:
    """Whether ``text`` is a sha256 as ``sha256sum`` prints it: 64 lowercase hex digits (normalise case first).

    Example:
        >>> is_sha256("0" * 64), is_sha256("0" * 63), is_sha256("G" * 64)
        (True, False, False)
    """
    return _SHA256.fullmatch(text) is not None


class RedirectRefused(urllib.error.URLError):
    """A redirect that would leave https for http, or go to a scheme other than http(s)."""


class BodyTooLarge(Exception):
    """The response body went past the cap given to :func:`copy_body`."""


def redirect_allowed(old_url: str, new_url: str) -> bool:
    """Whether a download may follow a redirect from ``old_url`` to ``new_url``.

    Only http and https are followed, and a download that started on https stays on https.

    Example:
        >>> redirect_allowed("http://x.org/a", "https://y.org/a"), redirect_allowed("http://x.org/a", "file:///etc/x")
        (True, False)
    """
    old = urllib.parse.urlsplit(old_url).scheme.lower()
    new = urllib.parse.urlsplit(urllib.parse.urljoin(old_url, new_url)).scheme.lower()
    if new not in ("http", "https"):
        return False
    return not (old == "https" and new != "https")


class SafeRedirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirect handling, refusing what :func:`redirect_allowed` refuses."""

    def redirect_request(
        self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: HTTPMessage, newurl: str
    ) -> urllib.request.Request | None:
        target = urllib.parse.urljoin(req.full_url, newurl)
        if not redirect_allowed(req.full_url, target):
            fp.close()
            raise RedirectRefused(
                f"refused the redirect from {req.full_url} to {target}: "
                "an https download must not continue over plain http"
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(SafeRedirects)  # replaces urllib's own redirect handler


def open_url(url: str, timeout_s: float, headers: dict[str, str] | None = None) -> Any:
    """``urlopen(url)`` with :class:`SafeRedirects`; raises ``urllib.error.URLError`` (or a subclass) on failure.
    Every network read waits at most ``timeout_s``. A ``file://`` URL is opened here, not by urllib: only a regular
    file on this machine (a FIFO would block for ever, /dev/zero stream to the cap), refused as
    ``urllib.error.URLError`` naming what it is.

    Example (over the network): ``with open_url("https://example.com/a.zip", 30.0) as response: data =
    response.read()``.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() == "file":
        if parts.netloc not in ("", "localhost"):
            raise urllib.error.URLError(f"file:// names another host ({parts.netloc}); only local files are read")
        try:
            return _LocalFile(open_input(urllib.request.url2pathname(parts.path), 1 << 62))
        except OSError as e:
            reason = reason_of(e) if not isinstance(e, FileNotFoundError) else "no such file"
            raise urllib.error.URLError(reason) from None
    return _OPENER.open(urllib.request.Request(url, headers=headers or {}), timeout=timeout_s)


def local_archive_problem(url: str, folder: str | os.PathLike[str]) -> str | None:
    """Why the ``file://`` URL ``url`` (a dataset yaml's ``download:``) is not an archive inside ``folder`` (the
    yaml's own folder), or None when it is one or ``url`` is no file URL. The rule: a zip or tar file, regular,
    on this machine, lying in ``folder`` or below once links are resolved. Any other file would be copied into the
    dataset folder (a private key named by a yaml someone handed over), so it is refused before it is read.

    >>> local_archive_problem("file:///etc/passwd", "/data"), local_archive_problem("https://x.org/a.zip", "/data")
    ('it names /etc/passwd, outside /data', None)
    """
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme.lower() != "file":
        return None
    if parts.netloc not in ("", "localhost"):
        return f"it names another host ({parts.netloc})"
    path = urllib.request.url2pathname(parts.path)
    real, base = os.path.realpath(path), os.path.realpath(folder)
    if os.path.commonpath([real, base]) != base:
        return f"it names {path}, outside {os.fspath(folder)}"
    try:
        with open_input(real, 1 << 62) as f:
            archive = zipfile.is_zipfile(f) or _is_tar(f)
    except FileNotFoundError:
        return f"{path} does not exist"
    except OSError as e:
        return f"{path} cannot be read ({reason_of(e)})"
    return None if archive else f"{path} is no zip or tar archive"


def _is_tar(f: IO[bytes]) -> bool:
    """Whether the open file ``f`` holds a tar archive (plain or compressed), read from its start."""
    f.seek(0)
    try:
        with tarfile.open(fileobj=f, mode="r:*"):
            return True
    except (tarfile.TarError, OSError, EOFError, ValueError):
        return False


class _LocalFile:
    """A regular file read as a download's response: ``read``, ``headers["Content-Length"]``, a context manager."""

    def __init__(self, f: IO[bytes]):
        self._f = f
        self.headers = {"Content-Length": str(os.fstat(f.fileno()).st_size)}

    def read(self, n: int = -1) -> bytes:
        return self._f.read(n)

    def __enter__(self) -> _LocalFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


def content_length(response: Any) -> int | None:
    """The Content-Length the server declared, or None when absent or not a plain number.

    Example:
        >>> class R: headers = {"Content-Length": "12"}
        >>> content_length(R())
        12
    """
    value = (response.headers.get("Content-Length") or "").strip()
    return int(value) if value.isdigit() else None


def copy_body(
    response: Any, out: IO[bytes], limit: int, on_chunk: Callable[[int], None] | None = None
) -> tuple[int, str]:
    """Copy the body into ``out``; return (bytes copied, their sha256). Raises BodyTooLarge past ``limit`` bytes.

    Never reads more than ``limit + 1`` bytes, whatever the server declared.

    Example:
        >>> import io
        >>> copy_body(io.BytesIO(b"abc"), io.BytesIO(), limit=10)[0]
        3
    """
    digest = hashlib.sha256()
    received = 0
    while chunk := response.read(min(_CHUNK, limit + 1 - received)):
        received += len(chunk)
        if received > limit:
            raise BodyTooLarge(f"the body is larger than {limit} bytes")
        digest.update(chunk)
        out.write(chunk)
        if on_chunk is not None:
            on_chunk(len(chunk))
    return received, digest.hexdigest()
