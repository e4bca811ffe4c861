"""Forwarding one request: choose a replica, send the request as it came (method, path, query,
headers, body), relay the answer. The promise is that a request which had not started is never
lost to a failed replica:

- a connection that fails before any byte of the answer (refused, reset, the replica killed
  mid-request), a 429 (its queue is full) or a 503 (it is shutting down) sends the request to
  another replica, each replica at most once; the caller sees nothing of it;
- a non-streaming answer is read whole before any of it is sent on, so it retries the same way;
- a stream is answered only once its first event has arrived; after that it is relayed event by
  event and never retried (the caller has text already). A replica that fails mid-stream ends
  the caller's stream with an error event and `data: [DONE]`, as the engine ends a failed stream;
- a read timeout is a 504, not a retry: a replica that is slow is not a replica that is down,
  and the request would only run twice.

The caller leaving cancels the request upstream (the replica sees the disconnect and aborts it)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from engine.router.prefix_key import body_block_hashes
from engine.router.replica import Replica
from engine.router.replica_set import ReplicaSet
from engine.router.router_config import RouterConfig
from engine.router.router_metrics import RouterMetrics
from engine.server.error_body import error_body, error_response

log = logging.getLogger(__name__)

# Headers of one connection, not of the request (RFC 9110 7.6.1), and those httpx and Starlette
# set themselves from the body they send.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_RETRY_STATUSES = frozenset({429, 503})
# Failures of the connection itself; a timeout is left out on purpose (see above).
_CONNECTION_ERRORS = (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ConnectTimeout)
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
REPLICA_HEADER = "x-nightshift-replica"


class _NotStarted(Exception):
    """The attempt failed before the caller got anything: another replica may take it."""


@dataclass(slots=True)
class _Outgoing:
    method: str
    path: str  # raw path and query, as the caller sent them
    headers: list[tuple[str, str]]
    body: bytes
    blocks: list[bytes]

    def __str__(self) -> str:
        return f"{self.method} {self.path.split('?', 1)[0]}"


class Proxy:
    def __init__(
        self,
        config: RouterConfig,
        replicas: ReplicaSet,
        metrics: RouterMetrics,
        client: httpx.AsyncClient,
    ) -> None:
        self.config, self.replicas, self.metrics, self.client = config, replicas, metrics, client

    async def forward(self, request: Request, body: bytes) -> Response:
        """`body`: the request's, already read (the caller watches for a disconnect next)."""
        outgoing = _Outgoing(
            request.method,
            _raw_path(request),
            [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP],
            body,
            body_block_hashes(body, self.config.prefix_block_chars) if body else [],
        )
        tried: list[Replica] = []
        last: _NotStarted | None = None
        while (choice := self.replicas.choose(outgoing.blocks, tried)) is not None:
            replica = choice.replica
            tried.append(replica)
            self.metrics.decisions.labels(choice.reason).inc()
            try:
                return await self._attempt(replica, outgoing, last_chance=not self._others(tried))
            except _NotStarted as e:
                log.info("%s on %s: %s; trying another replica", outgoing, replica.url, e)
                self.metrics.retries.labels(replica.url).inc()
                last = e
            except httpx.TimeoutException as e:
                self.metrics.errors.labels("timeout").inc()
                return error_response(
                    504,
                    f"replica {replica.url} did not answer in time ({type(e).__name__})",
                    code="timeout",
                )
        return self._unavailable(tried, last)

    def _others(self, tried: list[Replica]) -> bool:
        return any(r not in tried for r in self.replicas.healthy())

    async def _attempt(self, replica: Replica, out: _Outgoing, last_chance: bool) -> Response:
        replica.outstanding += 1
        handed_over = False  # to the streaming relay, which then owns the count and the stream
        upstream: httpx.Response | None = None
        try:
            request = self.client.build_request(
                out.method, replica.url + out.path, headers=out.headers, content=out.body
            )
            upstream = await self.client.send(request, stream=True)
            if upstream.status_code in _RETRY_STATUSES and not last_chance:
                raise _NotStarted(f"it answered {upstream.status_code}")
            headers = _answer_headers(upstream, replica)
            if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
                content = b"".join([chunk async for chunk in upstream.aiter_raw()])
                self.metrics.requests.labels(replica.url).inc()
                return Response(content, upstream.status_code, headers)
            events = _sse_events(upstream)
            first = await anext(events, b"")
            self.metrics.requests.labels(replica.url).inc()
            handed_over = True
            lease = _StreamLease(replica, upstream)
            return _RelayedStream(
                self._relay(lease, first, events), upstream.status_code, headers, lease
            )
        except _CONNECTION_ERRORS as e:
            self.replicas.connection_failed(replica, e)
            raise _NotStarted(f"{type(e).__name__}: {e or 'no detail'}") from e
        finally:
            if not handed_over:
                replica.outstanding -= 1
                if upstream is not None:
                    await _close(upstream)

    async def _relay(
        self, lease: _StreamLease, first: bytes, events: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        replica = lease.replica
        try:
            if first:
                yield first
            try:
                async for event in events:
                    yield event
            except (*_CONNECTION_ERRORS, httpx.TimeoutException) as e:
                self.replicas.connection_failed(replica, e)
                self.metrics.errors.labels("stream_broken").inc()
                log.warning("replica %s failed mid-stream: %s", replica.url, e)
                message = f"replica {replica.url} failed mid-stream ({type(e).__name__})"
                yield _sse(error_body(message, "internal_server_error", None, "stream_broken"))
                yield b"data: [DONE]\n\n"
        finally:
            await lease.release()

    def _unavailable(self, tried: list[Replica], last: _NotStarted | None) -> Response:
        total = len(self.replicas.replicas)
        if not tried:
            self.metrics.errors.labels("no_replica").inc()
            reasons = "; ".join(
                f"{r.url}: {r.last_error or 'not checked yet'}" for r in self.replicas.replicas
            )
            message = f"no replica is in rotation ({total} known"
            message += f": {reasons})" if reasons else ")"
            code = "no_replica"
        else:
            self.metrics.errors.labels("replicas_failed").inc()
            message = (
                f"every replica tried ({len(tried)} of {total}) failed before answering; "
                f"the last: {last}"
            )
            code = "replicas_failed"
        response = error_response(503, message, code=code)
        response.headers["Retry-After"] = "1"
        return response


def _raw_path(request: Request) -> str:
    path = request.scope.get("raw_path") or request.url.path.encode()
    query = request.scope.get("query_string") or b""
    return path.decode("latin-1") + (f"?{query.decode('latin-1')}" if query else "")


def _answer_headers(upstream: httpx.Response, replica: Replica) -> dict[str, str]:
    # The router's server writes its own Date and Server headers.
    drop = _HOP_BY_HOP | {"date", "server"}
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in drop}
    headers[REPLICA_HEADER] = replica.url
    return headers


async def _sse_events(upstream: httpx.Response) -> AsyncIterator[bytes]:
    """The stream's events, each whole (its data lines and the blank line ending it), so that a
    stream cut off by a failed replica never passes on half an event."""
    buffer = b""
    async for chunk in upstream.aiter_raw():
        buffer += chunk
        while match := _EVENT_END.search(buffer):
            yield buffer[: match.end()]
            buffer = buffer[match.end() :]
    if buffer:
        yield buffer


@dataclass(slots=True)
class _StreamLease:
    """A relayed stream's hold on its replica: one request in flight and the upstream
    connection, given back exactly once, whichever of the relay and the response ends first."""

    replica: Replica
    upstream: httpx.Response
    released: bool = False

    async def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.replica.outstanding -= 1
        await _close(self.upstream)


class _RelayedStream(StreamingResponse):
    """A StreamingResponse that gives its lease back even when its body never ran (the caller
    left before the first event was sent: Starlette then never starts the generator, whose own
    `finally` would not run)."""

    def __init__(self, content, status_code: int, headers: dict, lease: _StreamLease) -> None:
        super().__init__(content, status_code, headers)
        self.lease = lease

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self.lease.release()


def _sse(body: dict) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


async def _close(upstream: httpx.Response) -> None:
    # Shielded: when the caller left, this runs in a cancelled task, and the connection to the
    # replica must still be closed for the replica to see the disconnect.
    with anyio.CancelScope(shield=True):
        await upstream.aclose()
