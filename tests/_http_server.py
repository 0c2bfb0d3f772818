"""A local HTTP server for the download tests: serves a folder on 127.0.0.1, counts requests, and misbehaves on
purpose under special paths."""

from __future__ import annotations

import collections
import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest


class Server:
    """Serves `root` on 127.0.0.1, counting requests; special paths misbehave on purpose.

    ``/cut/<f>``: announces the whole file, sends half, hangs up. ``/moved/<f>``: a 302 to ``/<f>``.
    ``/huge``: announces 60 GB and sends nothing. ``/nolength/<f>``: the file without a Content-Length.
    ``/more/<f>``: no length, the file and then a megabyte more.
    """

    def __init__(self, root: Path) -> None:
        self.hits: list[str] = []
        hits = self.hits

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's naming
                hits.append(self.path)
                kind, _, name = self.path.lstrip("/").partition("/")
                if kind == "moved":
                    self.send_response(302)
                    self.send_header("Location", f"/{name}")
                    self.end_headers()
                elif kind == "huge":
                    self.send_response(200)
                    self.send_header("Content-Length", str(60 * 10**9))
                    self.end_headers()
                    self.close_connection = True
                elif kind in ("cut", "nolength", "more"):
                    body = (root / name).read_bytes()
                    self.send_response(200)
                    if kind == "cut":
                        self.send_header("Content-Length", str(len(body)))
                        body = body[: len(body) // 2]
                    elif kind == "more":
                        body += b"\0" * (1 << 20)
                    self.end_headers()
                    self.wfile.write(body)
                    self.close_connection = True
                else:
                    super().do_GET()

            def log_message(self, *args: object) -> None:
                pass

        class Quiet(http.server.ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a client that refuses a download hangs up mid-body: expected here

        self.httpd = Quiet(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{name}"

    def counts(self) -> dict[str, int]:
        """Requests per path."""
        return dict(collections.Counter(self.hits))

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    """A server of ``tmp_path/www`` (empty at first) and that folder."""
    root = tmp_path / "www"
    root.mkdir()
    server = Server(root)
    yield server, root
    server.close()
