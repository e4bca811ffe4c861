"""A real HTTP server on 127.0.0.1 that answers GETs with scripted replies, in order.

    with ScriptedServer() as server:
        server.script(Reply(status=503), Reply(body=ATOM))
        ...  # point a client at server.url("/api/query")
        assert [r.path for r in server.received] == ["/api/query", "/api/query"]

Each request is logged with its path, query, headers and arrival time (time.monotonic()), so tests
can check offsets, headers and the spacing of requests. A request with no reply left gets a 500."""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Self
from urllib.parse import parse_qs, urlsplit


@dataclass(slots=True)
class Reply:
    body: bytes | str = b""
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/atom+xml; charset=utf-8"
    delay_s: float = 0.0  # wait before answering, to make the client time out


@dataclass(slots=True)
class Received:
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    at: float


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: ScriptedServer

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that timed out and left is part of the script, not an error


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        arrived = time.monotonic()
        parts = urlsplit(self.path)
        owner = self.server.owner
        with owner.lock:
            owner.received.append(
                Received(parts.path, parse_qs(parts.query), dict(self.headers.items()), arrived)
            )
            reply = owner.replies.popleft() if owner.replies else Reply(b"no reply scripted", 500)
        if reply.delay_s:
            time.sleep(reply.delay_s)
        body = reply.body.encode("utf-8") if isinstance(reply.body, str) else reply.body
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in reply.headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class LoopbackServer:
    """An HTTP server on a free 127.0.0.1 port, in a thread, for the length of a `with`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self._server = _Server(("127.0.0.1", 0), handler)
        self._server.owner = self  # type: ignore[assignment]
        # A short poll interval: shutdown() waits for the next poll, 0.5 s by default.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()

    def url(self, path: str = "") -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}{path}"


class ScriptedServer(LoopbackServer):
    def __init__(self) -> None:
        self.replies: deque[Reply] = deque()
        self.received: list[Received] = []
        self.lock = threading.Lock()
        super().__init__(_Handler)

    def script(self, *replies: Reply) -> None:
        with self.lock:
            self.replies.extend(replies)

    def gaps(self) -> list[float]:
        """Seconds between the arrivals of consecutive requests."""
        times = [request.at for request in self.received]
        return [later - earlier for earlier, later in zip(times, times[1:])]


def refused_url() -> str:
    """A URL on 127.0.0.1 where nothing listens: a port just bound, then released."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/api/query"
