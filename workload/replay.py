"""Replaying a trace against an OpenAI-compatible server: arrival schedules and the request loop.

Modes (the schedule of send times, as offsets from the replay's start):
- batch: everything at once, at most `concurrency` in flight (the nightly job's shape);
- trace: the recorded timestamps divided by `time_scale` (the first record at 0);
- poisson: gamma inter-arrivals with mean 1/rate and shape `burstiness` (1 = Poisson), as
  `vllm bench serve` draws them; the first request at 0;
- concurrency: a closed loop that keeps `concurrency` requests in flight.
In every mode `concurrency`, when given, caps the requests in flight: a request whose time has
come waits for a free slot, and its send time is when it is really sent.

Each request streams from `/v1/completions` (token ids or text), with max_tokens = min_tokens =
the recorded output length and ignore_eos, so that the server does the recorded work; usage comes
in the last chunk (stream_options.include_usage). The client times it with time.perf_counter().
Only `base_url` is contacted: GET {base_url}/models once (for max_model_len), then the requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import httpx
import numpy as np

from workload.metrics import RequestRecord, summarize
from workload.trace import TraceRecord

log = logging.getLogger(__name__)

Mode = Literal["batch", "trace", "poisson", "concurrency"]
MODES: tuple[str, ...] = ("batch", "trace", "poisson", "concurrency")
Prompt = str | list[int]
PromptFn = Callable[[int, TraceRecord], Prompt]


@dataclass(slots=True)
class ReplayConfig:
    base_url: str  # like "http://127.0.0.1:8000/v1", as the openai client takes it
    model: str
    mode: Mode = "batch"
    rate: float = math.inf  # poisson: requests per second
    burstiness: float = 1.0  # poisson: gamma shape
    concurrency: int | None = None  # cap on requests in flight; required for "concurrency"
    time_scale: float = 1.0  # trace: >1 replays faster
    max_requests: int | None = None
    max_duration_s: float | None = None  # stop sending after this; in-flight ones get grace_s
    grace_s: float = 30.0
    request_timeout_s: float = 3600.0  # queueing included: a big batch waits long
    slo_ms: dict[str, float] | None = None
    api_key: str | None = field(default=None, repr=False)
    seed: int = 0
    temperature: float = 0.0

    def check(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.mode == "concurrency" and not self.concurrency:
            raise ValueError("mode 'concurrency' needs --concurrency C")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.mode == "poisson" and not self.rate > 0:
            raise ValueError("mode 'poisson' needs a positive --rate")
        if not self.rate > 0:  # inf is "all at once"; NaN is refused here too
            raise ValueError(f"--rate must be positive, not {self.rate:g}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError("--max-requests must be at least 1")
        if self.seed < 0:  # numpy's generators take only non-negative seeds
            raise ValueError(f"--seed must be a non-negative integer, not {self.seed}")
        # Typer takes "nan" and "inf" as floats: each of these must be a finite positive number.
        for option, value in (
            ("--burstiness", self.burstiness),
            ("--time-scale", self.time_scale),
            ("--max-duration", self.max_duration_s),
            ("--request-timeout", self.request_timeout_s),
        ):
            if value is not None and not 0 < value < math.inf:
                raise ValueError(f"{option} must be a positive finite number, not {value:g}")
        if not 0 <= self.grace_s < math.inf:
            raise ValueError(f"--grace must be finite seconds >= 0, not {self.grace_s:g}")

    def to_json(self) -> dict:
        data = asdict(self)
        data.pop("api_key")
        data["rate"] = None if math.isinf(self.rate) else self.rate
        return data


# --- arrival schedules ---------------------------------------------------------------------------


def trace_offsets(records: Sequence[TraceRecord], time_scale: float = 1.0) -> list[float]:
    """Recorded timestamps (ms) as seconds from the first record, divided by time_scale."""
    if not records:
        return []
    first = min(r.timestamp for r in records)
    return [(r.timestamp - first) / 1000.0 / time_scale for r in records]


def poisson_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """n send times: the first at 0, then gamma gaps of mean 1/rate and shape burstiness
    (coefficient of variation 1/sqrt(burstiness)); an infinite rate sends all at 0."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def arrival_offsets(records: Sequence[TraceRecord], config: ReplayConfig) -> list[float]:
    if config.mode == "trace":
        return trace_offsets(records, config.time_scale)
    if config.mode == "poisson":
        return poisson_offsets(len(records), config.rate, config.burstiness, config.seed)
    return [0.0] * len(records)  # batch, concurrency: as fast as the slots allow


def request_order(records: Sequence[TraceRecord], config: ReplayConfig) -> list[int]:
    """Trace mode sends in timestamp order; the others in file order."""
    if config.mode == "trace":
        return sorted(range(len(records)), key=lambda i: records[i].timestamp)
    return list(range(len(records)))


# --- one request ---------------------------------------------------------------------------------


def request_body(config: ReplayConfig, prompt: Prompt, output_length: int) -> dict:
    n = max(1, output_length)
    return {
        "model": config.model,
        "prompt": prompt,
        "max_tokens": n,
        "min_tokens": n,
        "ignore_eos": True,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _chunk_text(chunk: dict) -> str:
    text = ""
    for choice in chunk.get("choices") or ():
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def _error_message(body: bytes) -> str:
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
        return str(message or body[:200].decode(errors="replace"))
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace").strip()


class _Failed(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _parse_chunk(data: str) -> dict:
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        raise _Failed("bad_response", f"a stream chunk is not JSON: {data[:80]!r}") from None
    if not isinstance(chunk, dict):
        raise _Failed("bad_response", f"a stream chunk is not an object: {data[:80]!r}")
    if chunk.get("error"):
        raise _Failed("stream_error", f"error in the stream: {_error_message(data.encode())}")
    return chunk


async def _stream(
    client: httpx.AsyncClient, url: str, body: bytes, rec: RequestRecord, t0: float
) -> None:
    usage: dict | None = None
    done = False
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    async with client.stream("POST", url, content=body, headers=headers) as response:
        if response.status_code != 200:
            message = _error_message(await response.aread())
            raise _Failed(f"http_{response.status_code}", f"HTTP {response.status_code}: {message}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            now = time.perf_counter()
            chunk = _parse_chunk(data)
            if _chunk_text(chunk):
                rec.chunk_times.append(now - t0)
            if chunk.get("usage"):
                usage = chunk["usage"]
    rec.end_s = time.perf_counter() - t0
    if not done:
        raise _Failed("disconnect", "the stream ended before [DONE]")
    if usage:
        rec.output_received = usage.get("completion_tokens")
        rec.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = details.get("cached_tokens")
    if rec.output_received is None:
        rec.output_received = len(rec.chunk_times)
    if not rec.chunk_times:
        raise _Failed("no_output", "the response carried no content")


async def send_one(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    rec: RequestRecord,
    t0: float,
    timeout_s: float,
) -> None:
    """Send one request and fill `rec`; failures land in rec.error_kind / rec.error."""
    rec.start_s = time.perf_counter() - t0
    try:
        async with asyncio.timeout(timeout_s):
            await _stream(client, url, body, rec, t0)
    except _Failed as exc:
        rec.error_kind, rec.error = exc.kind, str(exc)
    except TimeoutError:
        rec.error_kind, rec.error = "timeout", f"no complete response within {timeout_s:g} s"
    except httpx.TimeoutException as exc:
        rec.error_kind, rec.error = "timeout", f"{type(exc).__name__}: {exc}"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        rec.error_kind, rec.error = "disconnect", f"{type(exc).__name__}: {exc}"
    except httpx.HTTPError as exc:
        rec.error_kind, rec.error = "connection", f"{type(exc).__name__}: {exc}"
    except (ValueError, TypeError, AttributeError) as exc:  # a malformed response; keep going
        log.debug("request %d: malformed response", rec.index, exc_info=True)
        rec.error_kind, rec.error = "bad_response", f"{type(exc).__name__}: {exc}"
    if rec.end_s is None or rec.error_kind is not None:
        rec.end_s = time.perf_counter() - t0


# --- the loop ------------------------------------------------------------------------------------


@dataclass(slots=True)
class ReplayRun:
    records: list[RequestRecord]  # sent or refused ones, in trace order
    not_sent: int  # left when --max-duration stopped the sending
    max_model_len: int | None


async def fetch_max_model_len(client: httpx.AsyncClient, config: ReplayConfig) -> int | None:
    """The served model's max_model_len from GET /models (ours lists it), or None."""
    try:
        response = await client.get(f"{config.base_url.rstrip('/')}/models", timeout=10)
        response.raise_for_status()
        cards = response.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        log.info("GET /models failed (%s); not checking lengths", exc)
        return None
    for card in cards:
        if isinstance(card, dict) and card.get("id") == config.model:
            value = card.get("max_model_len")
            return value if isinstance(value, int) else None
    names = [c.get("id") for c in cards if isinstance(c, dict)]
    log.warning("model %r is not in the server's list %s", config.model, names)
    return None


async def run_replay(
    trace: Sequence[TraceRecord],
    config: ReplayConfig,
    prompt_fn: PromptFn,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> ReplayRun:
    """Replay `trace` (already cut to max_requests) and return the per-request records."""
    config.check()
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.request_timeout_s, connect=min(30.0, config.request_timeout_s))
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        max_len = await fetch_max_model_len(client, config)
        loop = _Loop(client, config, prompt_fn, on_done, max_len)
        records, not_sent = await loop.run(trace)
    return ReplayRun(records, not_sent, max_len)


class _Loop:
    def __init__(
        self,
        client: httpx.AsyncClient,
        config: ReplayConfig,
        prompt_fn: PromptFn,
        on_done: Callable[[RequestRecord], None] | None,
        max_model_len: int | None,
    ) -> None:
        self.client, self.config, self.prompt_fn = client, config, prompt_fn
        self.on_done, self.max_model_len = on_done, max_model_len
        self.url = f"{config.base_url.rstrip('/')}/completions"
        self.slots = asyncio.Semaphore(config.concurrency) if config.concurrency else None

    async def run(self, trace: Sequence[TraceRecord]) -> tuple[list[RequestRecord], int]:
        cfg = self.config
        offsets = arrival_offsets(trace, cfg)
        order = request_order(trace, cfg)
        t0 = time.perf_counter()
        deadline = t0 + cfg.max_duration_s if cfg.max_duration_s is not None else math.inf
        records: dict[int, RequestRecord] = {}
        tasks: dict[asyncio.Task, RequestRecord] = {}
        sent = 0
        for i in order:
            record = trace[i]
            rec = RequestRecord(i, record.input_length, max(1, record.output_length))
            if self._too_long(rec):
                records[i] = rec
                self._finished(rec)
                sent += 1
                continue
            # Build the body while waiting for the send time, not after it.
            body = json.dumps(request_body(cfg, self.prompt_fn(i, record), rec.output_expected))
            if not await self._wait_turn(t0 + offsets[i], deadline):
                break
            records[i] = rec
            task = asyncio.create_task(self._send(body.encode(), rec, t0))
            tasks[task] = rec
            sent += 1
            await asyncio.sleep(0)  # let it start before building the next body
        stopped = sent < len(order)
        if stopped:
            log.info("max duration reached: %d requests not sent", len(order) - sent)
        await self._drain(tasks, deadline + cfg.grace_s, t0)
        return [records[i] for i in sorted(records)], len(order) - sent

    def _too_long(self, rec: RequestRecord) -> bool:
        limit = self.max_model_len
        if limit is None or rec.input_length + rec.output_expected <= limit:
            return False
        rec.error_kind = "too_long"
        rec.error = (
            f"input {rec.input_length} + output {rec.output_expected} tokens exceed the "
            f"server's max_model_len {limit}; not sent"
        )
        return True

    async def _wait_turn(self, when: float, deadline: float) -> bool:
        """Sleep until `when` and take a slot; False when the deadline comes first."""
        if when >= deadline:
            return False
        delay = when - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if self.slots is None:
            return time.perf_counter() < deadline
        wait = deadline - time.perf_counter()
        if wait <= 0:
            return False
        try:
            async with asyncio.timeout(None if math.isinf(wait) else wait):
                await self.slots.acquire()
        except TimeoutError:
            return False
        return True

    async def _send(self, body: bytes, rec: RequestRecord, t0: float) -> None:
        try:
            await send_one(self.client, self.url, body, rec, t0, self.config.request_timeout_s)
        finally:
            if self.slots is not None:
                self.slots.release()
        self._finished(rec)

    def _finished(self, rec: RequestRecord) -> None:
        if rec.error_kind:
            log.debug("request %d failed: %s", rec.index, rec.error)
        if self.on_done is not None:
            self.on_done(rec)

    async def _drain(
        self, tasks: dict[asyncio.Task, RequestRecord], until: float, t0: float
    ) -> None:
        """Wait for in-flight requests; past `until` (max duration + grace) cancel the rest."""
        if not tasks:
            return
        wait = None if math.isinf(until) else max(0.0, until - time.perf_counter())
        _, pending = await asyncio.wait(tasks, timeout=wait)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await task
            rec = tasks[task]
            rec.end_s = time.perf_counter() - t0
            rec.error_kind = "cancelled"
            rec.error = "still running at the end of --max-duration and its grace period"
            if self.on_done is not None:
                self.on_done(rec)


def replay(
    trace: Sequence[TraceRecord],
    config: ReplayConfig,
    prompt_fn: PromptFn,
    on_done: Callable[[RequestRecord], None] | None = None,
    extra_config: dict | None = None,
) -> dict:
    """Run a replay and return the result JSON: {"config", "summary", "requests"}."""
    if config.max_requests is not None:
        trace = list(trace)[: config.max_requests]
    run = asyncio.run(run_replay(trace, config, prompt_fn, on_done))
    summary = summarize(run.records, slo_ms=config.slo_ms, not_sent=run.not_sent)
    return {
        "config": {
            **config.to_json(),
            **(extra_config or {}),
            "server_max_model_len": run.max_model_len,
        },
        "summary": summary,
        "requests": [r.to_json() for r in run.records],
    }
