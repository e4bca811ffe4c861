"""A scripted replica on a raw socket, for what a real one does only by accident: close the
connection before answering, break a stream after its first event, answer 503 or 429, stall,
or stream until the client leaves. /health answers 200 while `healthy` is set."""

from __future__ import annotations

import json
import socketserver
import threading
import time


def _response(status: int, body: dict, extra: str = "") -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\nconnection: close\r\n{extra}\r\n"
    )
    return head.encode() + data


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
)


class FakeReplica:
    def __init__(self, mode: str = "ok") -> None:
        self.mode, self.healthy = mode, True
        self.requests: list[dict] = []  # path, headers, body of each /v1 request
        self.disconnected = threading.Event()  # "forever": the client left
        fake = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                fake._serve(self.request)

        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, conn) -> None:
        raw = b""
        while b"\r\n\r\n" not in raw:
            chunk = conn.recv(65536)
            if not chunk:
                return
            raw += chunk
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        path = lines[0].split()[1]
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        while len(body) < int(headers.get("content-length", 0)):
            body += conn.recv(65536)
        if path == "/health":
            conn.sendall(_response(200 if self.healthy else 503, {"status": "fake"}))
            return
        if path == "/metrics":
            conn.sendall(_response(200, {}))
            return
        self.requests.append({"path": path, "headers": headers, "body": body})
        getattr(self, f"_{self.mode}")(conn, headers, body)

    def _ok(self, conn, headers, body) -> None:
        answer = {"replica": self.url, "authorization": headers.get("authorization")}
        conn.sendall(_response(200, {**answer, "body_bytes": len(body)}))

    def _close(self, conn, headers, body) -> None:
        pass  # the connection closes with nothing sent

    def _status503(self, conn, headers, body) -> None:
        error = {"message": "shutting down", "type": "service_unavailable", "code": "x"}
        conn.sendall(_response(503, {"error": error}))

    def _status429(self, conn, headers, body) -> None:
        error = {"message": "queue full", "type": "rate_limit_exceeded", "code": "queue_full"}
        conn.sendall(_response(429, {"error": error}, "retry-after: 1\r\n"))

    def _slow(self, conn, headers, body) -> None:
        time.sleep(3)
        self._ok(conn, headers, body)

    def _break(self, conn, headers, body) -> None:
        conn.sendall(_SSE_HEAD + _chunk(b'data: {"n": 1}\n\n') + _chunk(b'data: {"n": 2'))

    def _forever(self, conn, headers, body) -> None:
        conn.sendall(_SSE_HEAD)
        try:
            for n in range(2000):
                conn.sendall(_chunk(f'data: {{"n": {n}}}\n\n'.encode()))
                time.sleep(0.01)
        except OSError:
            self.disconnected.set()
