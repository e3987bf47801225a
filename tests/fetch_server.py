"""A loopback HTTP server for the download tests: serves bytes the test wrote, honours Range requests (or,
for the files named in ``ignore_range``, answers them with the whole file, status 200, as servers without
range support do), and can cut a response short (an interrupted transfer) or refuse a path (404)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from fedmerge.data.catalog import CATALOG


@dataclass
class Files:
    content: dict[str, bytes] = field(default_factory=dict)
    cut_after: dict[str, int] = field(default_factory=dict)  # next response of that file stops after N bytes
    requests: list[tuple[str, str | None]] = field(default_factory=list)  # (path, Range header)
    delay: float = 0.0  # seconds before each response's body (to make two fetches overlap)
    content_type: dict[str, str] = field(default_factory=dict)  # a path served as e.g. text/html (a login page)
    ignore_range: set[str] = field(default_factory=set)  # files served whole (200) even when a Range is asked


def make_handler(files: Files) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            name = self.path.lstrip("/")
            asked = self.headers.get("Range")
            files.requests.append((name, asked))
            rng = None if name in files.ignore_range else asked
            data = files.content.get(name)
            if data is None:
                self.send_error(404)
                return
            start = int(rng.removeprefix("bytes=").split("-")[0]) if rng else 0
            if start >= len(data) and rng:
                self.send_response(416)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = data[start:]
            self.send_response(206 if rng else 200)
            self.send_header("Content-Type", files.content_type.get(name, "application/octet-stream"))
            self.send_header("Content-Length", str(len(body)))
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if files.delay:
                time.sleep(files.delay)
            cut = files.cut_after.pop(name, None)
            self.wfile.write(body if cut is None else body[:cut])
            if cut is not None:
                self.wfile.flush()
                self.close_connection = True

    return Handler


@contextmanager
def serve(content: dict[str, bytes]) -> Iterator[tuple[str, Files]]:
    files = Files(dict(content))
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(files))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", files
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@contextmanager
def served_dataset(name: str, content: dict[str, bytes]) -> Iterator[Files]:
    """The catalog entry ``name`` pointed at a loopback server holding ``content`` (its checksums)."""
    with serve(content) as (base, files):
        entry = CATALOG.get(name).relocated(base, {n: sha256(b) for n, b in content.items()})
        with CATALOG.override(entry):
            yield files
