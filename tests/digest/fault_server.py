"""A fault-injecting OpenAI-compatible stub: a real HTTP server on 127.0.0.1 in a background thread.

It answers `POST /v1/chat/completions` (streamed in our server's chunk format, or whole),
`GET /v1/models` and `GET /health`. Faults, queued with `add_fault`, hit the matching requests:

    with FaultServer(faults=[Fault("status", status=503)]) as server:
        ...  # point a client at server.base_url; the first request gets a 503, the next succeeds
        assert len(server.requests) == 2

It is built on http.server rather than uvicorn so that each fault is exact bytes on the wire: a
dropped stream is a chunked body that stops without its last chunk, as a dying server leaves it.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal

# status: an HTTP error (OpenAI's body, Retry-After when given); hang: sleep delay_s, then answer;
# drop: close the connection mid-body; end_early: end the body cleanly before finish and [DONE];
# bad_json: a stream chunk (or whole body) that is not JSON; reject_response_format: a 400 naming
# response_format, only for requests that carry it; invalid_review: unrepairable prose;
# text: reply with `text`.
FaultKind = Literal[
    "status",
    "hang",
    "drop",
    "end_early",
    "bad_json",
    "reject_response_format",
    "invalid_review",
    "text",
]
Responder = Callable[[dict], str]  # request body -> reply text

INVALID_REVIEW = "I am sorry, but I cannot produce a structured review of this paper."


@dataclass(slots=True)
class Fault:
    kind: FaultKind
    times: int = 1  # matching requests it hits; -1: all of them
    match: str | None = None  # a substring of the request's messages; None: any request
    status: int = 503  # for "status"
    retry_after: float | None = None  # for "status": sent as the Retry-After header
    delay_s: float = 1.0  # for "hang"
    text: str = ""  # for "text"
    message: str | None = None  # for "status": the error message (a default names the status)


def default_responder(body: dict) -> str:
    """A Review JSON when JSON is asked for (response_format, or the last user turn says JSON),
    else a three-sentence summary; both derived from the paper title, so they are repeatable."""
    title = _title(body)
    wants_json = "response_format" in body or "json" in _last_user(body).lower()
    return json.dumps(review_for(title)) if wants_json else summary_for(title)


def review_for(title: str) -> dict:
    h = zlib.crc32(title.encode())
    return {
        "summary": f"The paper '{title}' proposes a method and evaluates it.",
        "strengths": [f"Clear motivation for {title}.", "Solid experiments."],
        "weaknesses": ["Limited baselines."],
        "questions": ["How does it scale?"],
        "limitations": ["Evaluated on few datasets."],
        "soundness": 1 + h % 4,
        "presentation": 1 + (h >> 2) % 4,
        "contribution": 1 + (h >> 4) % 4,
        "overall": 1 + (h >> 6) % 10,
        "confidence": 1 + (h >> 10) % 5,
        "decision": "Accept" if (h >> 6) % 10 >= 5 else "Reject",
        "input_basis": "abstract",
    }


def summary_for(title: str) -> str:
    return (
        f"This paper, {title}, studies a focused problem. "
        "It introduces a method and compares it with prior work. "
        "The results suggest the approach is useful in practice."
    )


class FaultServer:
    """The stub; a context manager. `requests` holds the JSON bodies received, in order."""

    def __init__(
        self,
        responder: Responder | None = None,
        faults: Iterable[Fault] = (),
        *,
        model: str = "stub",
        cached_tokens: int | None = 0,  # None: no prompt_tokens_details, as some clouds send
        api_key: str | None = None,
        max_model_len: int | None = None,  # listed under /v1/models, as our server and vLLM do
    ) -> None:
        self.responder = responder or default_responder
        self.max_model_len = max_model_len
        self.model = model
        self.cached_tokens = cached_tokens
        self.api_key = api_key
        self._faults = list(faults)
        self._requests: list[dict] = []
        self._lock = threading.Lock()
        self._http = _Server(("127.0.0.1", 0), _Handler)
        self._http.stub = self
        self._thread = threading.Thread(target=self._http.serve_forever, args=(0.05,), daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}/v1"

    @property
    def requests(self) -> list[dict]:
        with self._lock:
            return list(self._requests)

    def add_fault(self, kind: FaultKind, **fields) -> Fault:
        fault = Fault(kind, **fields)
        with self._lock:
            self._faults.append(fault)
        return fault

    def __enter__(self) -> FaultServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(5)

    def receive(self, body: dict) -> Fault | None:
        """Records a request and takes the first fault that hits it, counting it down."""
        text = " ".join(_content(m) for m in body.get("messages", []))
        with self._lock:
            self._requests.append(body)
            for fault in self._faults:
                if fault.times == 0 or (fault.match is not None and fault.match not in text):
                    continue
                if fault.kind == "reject_response_format" and "response_format" not in body:
                    continue
                if fault.times > 0:
                    fault.times -= 1
                return fault
        return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a hanging handler must not hold up shutdown
    stub: FaultServer

    def handle_error(self, request, client_address) -> None:
        # A client that timed out or gave up leaves a broken pipe behind; that is expected here.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and chunked bodies, as real servers do
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # quiet in tests
        pass

    def do_GET(self) -> None:
        stub = self.server.stub
        if self.path == "/health":
            self._send_json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            card = {"id": stub.model, "object": "model", "created": 0, "owned_by": "stub"}
            if stub.max_model_len is not None:
                card["max_model_len"] = stub.max_model_len
            self._send_json(200, {"object": "list", "data": [card]})
        else:
            self._send_error(404, f"no route {self.path}")

    def do_POST(self) -> None:
        stub = self.server.stub
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path != "/v1/chat/completions":
            return self._send_error(404, f"no route {self.path}")
        if stub.api_key and self.headers.get("Authorization") != f"Bearer {stub.api_key}":
            return self._send_error(401, "invalid or missing API key")
        try:
            body = json.loads(raw)
        except ValueError:
            return self._send_error(400, "the body is not JSON")
        fault = stub.receive(body)
        if fault is not None and fault.kind == "hang":
            time.sleep(fault.delay_s)
        if fault is not None and fault.kind in ("status", "reject_response_format"):
            return self._send_fault_status(fault)
        reply = self._reply_text(body, fault)
        if body.get("stream"):
            self._stream(body, reply, fault)
        else:
            self._whole(body, reply, fault)

    def _reply_text(self, body: dict, fault: Fault | None) -> str:
        if fault is not None and fault.kind == "invalid_review":
            return INVALID_REVIEW
        if fault is not None and fault.kind == "text":
            return fault.text
        return self.server.stub.responder(body)

    def _send_fault_status(self, fault: Fault) -> None:
        if fault.kind == "reject_response_format":
            message = "response_format of type json_schema is not supported by this model"
            return self._send_error(400, message)
        headers = {"Retry-After": f"{fault.retry_after:g}"} if fault.retry_after is not None else {}
        self._send_error(fault.status, fault.message or f"injected HTTP {fault.status}", headers)

    def _stream(self, body: dict, reply: str, fault: Fault | None) -> None:
        text, finish = _cut(reply, body.get("max_tokens"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        usage = self._usage(body, text) if include_usage else None
        events = _chat_events(body, text, finish, usage)
        for n, event in enumerate(events):
            if fault is not None and fault.kind == "drop" and n == 2:
                return self._drop()
            if fault is not None and fault.kind == "end_early" and n == 2:
                break
            if fault is not None and fault.kind == "bad_json" and n == 2:
                event = 'data: {"id": "chatcmpl-stub", "choices": [{"delta": \n\n'
            self._chunk(event.encode())
        self._chunk(b"")  # the last chunk: the body is complete

    def _whole(self, body: dict, reply: str, fault: Fault | None) -> None:
        text, finish = _cut(reply, body.get("max_tokens"))
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        data = {
            "id": "chatcmpl-stub",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": [choice],
            "usage": self._usage(body, text),
        }
        payload = json.dumps(data).encode()
        if fault is not None and fault.kind == "bad_json":
            payload = payload[: len(payload) // 2]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if fault is not None and fault.kind == "drop":
            self.wfile.write(payload[: len(payload) // 2])
            return self._drop()
        self.wfile.write(payload)

    def _usage(self, body: dict, text: str) -> dict:
        prompt = sum(len(_content(m).split()) for m in body.get("messages", []))
        completion = len(text.split())
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if self.server.stub.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.server.stub.cached_tokens}
        return usage

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _drop(self) -> None:
        """Closes the connection mid-body, as a crashed server would."""
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

    def _send_json(self, status: int, data: dict, headers: dict | None = None) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)

    def _send_error(self, status: int, message: str, headers: dict | None = None) -> None:
        kind = "rate_limit_exceeded" if status == 429 else "invalid_request_error"
        error = {"message": message, "type": kind, "param": None, "code": None}
        self._send_json(status, {"error": error}, headers)


def _chat_events(body: dict, text: str, finish: str, usage: dict | None) -> list[str]:
    """Our server's chunk sequence: role, content pieces, finish, usage (when asked), [DONE]."""
    created = int(time.time())

    def event(choices: list[dict], extra: dict | None = None) -> str:
        data = {
            "id": "chatcmpl-stub",
            "object": "chat.completion.chunk",
            "created": created,
            "model": body.get("model"),
            "choices": choices,
            **(extra or {}),
        }
        return f"data: {json.dumps(data)}\n\n"

    def choice(delta: dict, finish_reason: str | None = None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    events = [event([choice({"role": "assistant", "content": ""})])]
    events += [event([choice({"content": piece})]) for piece in _pieces(text, 3)]
    events.append(event([choice({}, finish)]))
    if usage is not None:
        events.append(event([], {"usage": usage}))
    events.append("data: [DONE]\n\n")
    return events


def _pieces(text: str, n: int) -> list[str]:
    size = max(1, -(-len(text) // n))
    return [text[i : i + size] for i in range(0, len(text), size)]


def _cut(reply: str, max_tokens: int | None) -> tuple[str, str]:
    """The reply cut to max_tokens words (a word stands for a token here), and why it ended."""
    words = list(re.finditer(r"\S+", reply))
    if max_tokens is None or len(words) <= max_tokens:
        return reply, "stop"
    if max_tokens < 1:
        return "", "length"
    return reply[: words[max_tokens - 1].end()], "length"


def _content(message: dict) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _last_user(body: dict) -> str:
    users = [m for m in body.get("messages", []) if m.get("role") == "user"]
    return _content(users[-1]) if users else ""


def _title(body: dict) -> str:
    """The paper title: a "Title: ..." line in the messages, else the last user turn's first
    line (the digest's prompts open with the title, without a label)."""
    text = "\n".join(_content(m) for m in body.get("messages", []))
    found = re.search(r"^\s*Title:\s*(.+)$", text, re.MULTILINE | re.IGNORECASE)
    if found:
        return found.group(1).strip()
    return _last_user(body).strip().split("\n", 1)[0].strip()
