"""The digest's model calls: one streamed chat completion against any OpenAI-compatible endpoint,
with bounded retries, and the timings and token counts the run records.

Every call streams (with `include_usage`) so that the time to the first token is measured the same
way on our server and on a cloud one. Failures a retry can fix (connect errors, timeouts, 408/409/
429/5xx, a stream that breaks off) are retried with capped exponential backoff; other 4xx are not.
A server that rejects `response_format` is remembered, and the call is repeated without it."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import httpx

from digest.clean_text import xml_safe
from digest.endpoint_pool import EndpointPool

log = logging.getLogger(__name__)

_RETRY_STATUSES = frozenset({408, 409, 429})
# httpx errors after which a new attempt may succeed; an incomplete chunked read or a reset
# connection mid-stream arrives as RemoteProtocolError / ReadError.
_TRANSIENT_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)


@dataclass(slots=True)
class ChatClientConfig:
    base_url: str  # like "http://127.0.0.1:8000/v1", as the openai client takes it
    model: str
    # Several endpoints used as one (endpoint_pool.py); empty: base_url alone.
    base_urls: tuple[str, ...] = ()
    api_key: str | None = None
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 300.0  # the longest gap between two received bytes
    max_retries: int = 3  # attempts = 1 + max_retries
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0


@dataclass(slots=True)
class ChatResult:
    text: str
    finish_reason: str | None
    prompt_tokens: int | None  # the usage fields are None when the server does not send them
    completion_tokens: int | None
    cached_tokens: int | None
    ttft_s: float | None  # None when no content arrived
    latency_s: float  # of the successful attempt
    started_at: datetime  # UTC, when the successful attempt began
    attempts: int
    endpoint: str = ""  # the base URL that answered (one of several, with an endpoint pool)


class ChatCallError(Exception):
    """A call that failed for good: retries ran out, or the server refused the request.

    `started_at` is the first attempt's start and `latency_s` the time until giving up."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None,
        attempts: int,
        started_at: datetime,
        latency_s: float,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.attempts = attempts
        self.started_at = started_at
        self.latency_s = latency_s


class _Retryable(Exception):
    def __init__(
        self, message: str, status_code: int | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.retry_after = retry_after


class _Refused(Exception):
    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


class _SchemaRejected(Exception):
    """The server does not take `response_format`; the caller repeats the call without it."""


def endpoint_label(base_url: str) -> str:
    """A printable name for an endpoint, host:port/path, without credentials or query."""
    url = httpx.URL(base_url)
    host = f"{url.host}:{url.port}" if url.port else url.host
    return f"{host}{url.path.rstrip('/')}"


class ChatClient:
    """Streams chat completions; an async context manager owning one connection pool."""

    def __init__(self, config: ChatClientConfig, concurrency: int = 4) -> None:
        self.config = config
        # None: not known yet; True: the server took it once; False: it rejected it.
        self.json_schema_supported: bool | None = None
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        timeout = httpx.Timeout(
            connect=config.connect_timeout_s,
            read=config.read_timeout_s,
            write=config.read_timeout_s,
            pool=None,  # the semaphore below bounds the calls; none times out waiting for a socket
        )
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self._http = httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits)
        urls = config.base_urls or (config.base_url,)
        self._pool = EndpointPool([u.rstrip("/") for u in urls])
        # Held only while an attempt runs, so queueing and backoff never count towards ttft.
        self._slots = asyncio.Semaphore(concurrency)

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def chat(
        self,
        messages: list[dict],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        response_format: dict | None = None,
        frequency_penalty: float | None = None,
        label: str = "model call",
    ) -> ChatResult:
        """One completion, retried on transient failures; raises ChatCallError when it gives up.
        `label` names the call in log lines (which paper, which request)."""
        started_at, t0 = datetime.now(UTC), time.monotonic()
        attempts = 0
        while True:
            send_format = response_format if self.json_schema_supported is not False else None
            body = self._body(messages, max_tokens, temperature, seed, send_format)
            if frequency_penalty is not None:
                body["frequency_penalty"] = frequency_penalty
            attempts += 1
            try:
                async with self._slots:
                    result = await self._attempt_somewhere(body, attempts)
                if send_format is not None:
                    self.json_schema_supported = True
                return result
            except _SchemaRejected as e:
                log.warning(
                    "%s: server rejected response_format (%s); continuing without it", label, e
                )
                self.json_schema_supported = False
                attempts -= 1  # the server is fine, only the request shape changes
            except _Refused as e:
                raise self._give_up(str(e), e.status_code, attempts, started_at, t0) from e
            except _Retryable as e:
                if attempts > self.config.max_retries:
                    raise self._give_up(str(e), e.status_code, attempts, started_at, t0) from e
                delay = self._backoff(attempts, e.retry_after)
                log.warning(
                    "%s: attempt %d failed (%s); retrying in %.2fs", label, attempts, e, delay
                )
                await asyncio.sleep(delay)

    def _body(
        self,
        messages: list[dict],
        max_tokens: int,
        temperature: float,
        seed: int | None,
        response_format: dict | None,
    ) -> dict:
        body: dict = {
            "model": self.config.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if seed is not None:
            body["seed"] = seed
        if response_format is not None:
            body["response_format"] = response_format
        return body

    async def _attempt_somewhere(self, body: dict, attempt: int) -> ChatResult:
        """One attempt at the endpoint the pool picks; one that fails transiently sits out."""
        endpoint = self._pool.acquire(body["messages"])
        try:
            result = await self._attempt(body, attempt, endpoint.url)
        except _Retryable as e:
            self._pool.failed(endpoint, str(e))
            raise
        finally:
            self._pool.release(endpoint)
        result.endpoint = endpoint.url
        return result

    async def _attempt(self, body: dict, attempt: int, base_url: str) -> ChatResult:
        started_at, t0 = datetime.now(UTC), time.monotonic()
        try:
            url = f"{base_url}/chat/completions"
            async with self._http.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise _status_error(resp, "response_format" in body)
                reply = await _read_reply(resp, t0)
        except _TRANSIENT_ERRORS as e:
            raise _Retryable(f"{type(e).__name__}: {str(e) or 'no detail'}") from e
        return reply.result(started_at, time.monotonic() - t0, attempt)

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        cap = self.config.max_backoff_s
        if retry_after is not None:  # the server said when; no jitter
            return min(max(retry_after, 0.0), cap)
        delay = min(self.config.backoff_s * 2 ** (attempt - 1), cap)
        return delay * random.uniform(0.5, 1.0)  # spreads out concurrent callers

    def _give_up(
        self, error: str, status: int | None, attempts: int, started_at: datetime, t0: float
    ) -> ChatCallError:
        plural = "attempt" if attempts == 1 else "attempts"
        return ChatCallError(
            xml_safe(f"{error} (gave up after {attempts} {plural})"),  # it quotes the server
            status_code=status,
            attempts=attempts,
            started_at=started_at,
            latency_s=time.monotonic() - t0,
        )


@dataclass(slots=True)
class _Reply:
    """What one attempt's stream delivered."""

    text: str
    finish_reason: str | None
    usage: dict | None
    ttft_s: float | None

    def result(self, started_at: datetime, latency_s: float, attempts: int) -> ChatResult:
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        return ChatResult(
            text=xml_safe(self.text),  # a model may emit any character; the store cannot
            finish_reason=self.finish_reason,
            prompt_tokens=_int_or_none(usage.get("prompt_tokens")),
            completion_tokens=_int_or_none(usage.get("completion_tokens")),
            cached_tokens=_int_or_none(details.get("cached_tokens")),
            ttft_s=self.ttft_s,
            latency_s=latency_s,
            started_at=started_at,
            attempts=attempts,
        )


async def _read_reply(resp: httpx.Response, t0: float) -> _Reply:
    # A server that ignores `stream` answers with one JSON body; take that too.
    if resp.headers.get("content-type", "").startswith("application/json"):
        return _whole_reply(await resp.aread(), time.monotonic() - t0)
    parts: list[str] = []
    reply = _Reply("", None, None, None)
    done = False
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, ": keep-alive" comments, "event:" lines
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        chunk = _load_chunk(data)
        reply.usage = chunk.get("usage") or reply.usage
        for choice in chunk.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                if reply.ttft_s is None:
                    reply.ttft_s = time.monotonic() - t0
                parts.append(content)
            reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
    # Without [DONE] the text still counts once it finished (only the usage chunk may be lost).
    if not done and reply.finish_reason is None:
        raise _Retryable("the stream ended before [DONE]")
    reply.text = "".join(parts)
    return reply


def _load_chunk(data: str) -> dict:
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError as e:
        raise _Retryable(f"malformed stream chunk: {data[:80]!r}") from e
    if not isinstance(chunk, dict):
        raise _Retryable(f"malformed stream chunk: {data[:80]!r}")
    if "error" in chunk:  # a server that fails mid-stream says so in a chunk (vLLM does)
        raise _Retryable(f"error mid-stream: {_message_of(chunk)}")
    return chunk


def _whole_reply(raw: bytes, elapsed: float) -> _Reply:
    try:
        body = json.loads(raw)
        choice = body["choices"][0]
        text = (choice.get("message") or {}).get("content") or ""
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise _Retryable(f"malformed response body: {raw[:80]!r}") from e
    return _Reply(text, choice.get("finish_reason"), body.get("usage"), elapsed if text else None)


def _status_error(resp: httpx.Response, sent_format: bool) -> Exception:
    status = resp.status_code
    message = _error_message(resp)
    lowered = message.lower()
    if (
        sent_format
        and status in (400, 422)
        and ("response_format" in lowered or "json_schema" in lowered)
    ):
        return _SchemaRejected(message)
    if status in _RETRY_STATUSES or status >= 500:
        return _Retryable(f"HTTP {status}: {message}", status, _retry_after(resp))
    return _Refused(f"HTTP {status}: {message}", status)


def _error_message(resp: httpx.Response) -> str:
    """The server's own words: OpenAI's {"error": {"message"}}, FastAPI's "detail", or the text."""
    try:
        return _message_of(resp.json())
    except ValueError:
        return resp.text.strip()[:500] or resp.reason_phrase


def _message_of(body: object) -> str:
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            found = error.get("message") or error.get("detail")
            if found:
                return str(found)[:500]
        elif isinstance(error, str):
            return error[:500]
    return json.dumps(body)[:500]


def _retry_after(resp: httpx.Response) -> float | None:
    """Retry-After in seconds; the header is either a number of seconds or an HTTP date."""
    value = resp.headers.get("retry-after")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return (parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds()
    except (TypeError, ValueError):
        return None


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
