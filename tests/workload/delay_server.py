"""An OpenAI-compatible stub with known artificial delays, for measuring the replay client.

A real HTTP server on 127.0.0.1 in a background thread. `POST /v1/completions` (and
`/v1/chat/completions`) streams max_tokens content chunks: the first after `ttft_s`, the next
ones `itl_s` apart, then a usage chunk (when asked) and [DONE]. So a client should measure
TTFT = ttft_s, ITL = TPOT = itl_s and E2E = ttft_s + itl_s * (n - 1).

    with DelayServer(ttft_s=0.2, itl_s=0.05, fail={7: 500}) as server:
        ...  # requests with max_tokens 7 get a 500; server.arrivals holds (time, body)

Built on http.server so that every byte and delay is exactly what the test says."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class DelayServer:
    ttft_s: float = 0.2
    itl_s: float = 0.05
    fail: dict[int, int] = field(default_factory=dict)  # max_tokens -> HTTP status to answer
    short: dict[int, int] = field(default_factory=dict)  # max_tokens -> tokens really sent
    usage: bool = True  # send the usage chunk when stream_options.include_usage asks
    model: str = "stub"
    max_model_len: int | None = None  # listed by /v1/models when given
    api_key: str | None = None
    arrivals: list[tuple[float, dict]] = field(default_factory=list)  # (perf_counter, body)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def __enter__(self) -> DelayServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    def record(self, body: dict) -> None:
        with self._lock:
            self.arrivals.append((time.perf_counter(), body))


def _handler(server: DelayServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def setup(self) -> None:
            super().setup()
            # Small SSE writes go out at once, not after Nagle's wait for an ACK.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, *args: object) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            if self.path.rstrip("/") != "/v1/models":
                return self._json(404, {"error": {"message": "not found"}})
            card = {"id": server.model, "object": "model"}
            if server.max_model_len is not None:
                card["max_model_len"] = server.max_model_len
            self._json(200, {"object": "list", "data": [card]})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(length))
            server.record(body)
            if server.api_key and self.headers.get("Authorization") != f"Bearer {server.api_key}":
                return self._json(401, {"error": {"message": "invalid API key"}})
            chat = self.path.endswith("/chat/completions")
            n = body.get("max_tokens") or 16
            if n in server.fail:
                status = server.fail[n]
                return self._json(status, {"error": {"message": f"injected failure {status}"}})
            try:
                self._stream(body, server.short.get(n, n), chat)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (a cancelled request)

        def _stream(self, body: dict, n: int, chat: bool) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            time.sleep(server.ttft_s)
            for k in range(n):
                if k:
                    time.sleep(server.itl_s)
                finish = "length" if k == n - 1 else None
                if chat:
                    choice = {"index": 0, "delta": {"content": f" t{k}"}, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": f" t{k}", "finish_reason": finish}
                self._event({"object": "chunk", "choices": [choice]})
            if server.usage and (body.get("stream_options") or {}).get("include_usage"):
                prompt = body.get("prompt")
                p = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
                usage = {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
                self._event({"object": "chunk", "choices": [], "usage": usage})
            self.wfile.write(b"data: [DONE]\n\n")

        def _event(self, data: dict) -> None:
            self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())

        def _json(self, status: int, data: dict) -> None:
            raw = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    return Handler
