"""AsyncEngine: an LLMEngine stepped on its own thread, with an asyncio face for servers.

The engine loop never runs on the event loop: one dedicated thread owns the LLMEngine (its
tokenizer, scheduler, model and detokenizers) and steps while any request is unfinished. Callers
on an event loop submit requests through a thread-safe inbox and receive each request's outputs
on an asyncio.Queue of its own, fed with call_soon_threadsafe. Detokenization happens on the
engine thread; callers tokenize before submitting (a long prompt must not stall the steps).

Admission is atomic: submit() counts a request's samples as waiting at once, on the caller's
thread, so a burst cannot overshoot a waiting limit before the engine thread has seen any of it.
A request the engine fails (FINISHED_ERROR) ends its stream with RequestFailedError; the rest go on.

What other threads may read: `info` (an EngineInfo, fixed once the engine is built), `stats()`
(an EngineStats snapshot the engine thread publishes after every step), and the tokenizing calls
encode_prompt / encode_chat (the tokenizer only, never the engine's moving parts).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.errors import (
    STRUCTURED_OUTPUT_FAILED,
    EngineShutdownError,
    ExecutorFailedError,
    RequestFailedError,
    StructuredOutputFailedError,
)
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams
from engine.spec.stats import SpecDecodeStats

logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    """submit() refused a request: admitting it would put more samples in the waiting queue than
    the limit allows."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the waiting queue is full ({limit} requests); retry later")
        self.limit = limit


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What a server needs to know about the engine; fixed once it is built."""

    model: str  # as configured: a folder or a model name
    model_dir: str  # the folder it was loaded from
    max_model_len: int
    # The longest request (prompt + output) the KV cache can hold: max_model_len or less.
    max_request_tokens: int
    num_kv_blocks: int
    block_size: int
    kv_cache_dtype: str  # auto (the model's dtype), fp8 or int8
    vocab_size: int
    hidden_size: int  # the width of the model's hidden states (and of its embeddings)
    speculative: bool  # a proposer drafts tokens (usage reports accepted/rejected predictions)
    tokenizer: object | None  # a transformers tokenizer; None for token-id-only models


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's counters after a step (published by the engine thread, read by anyone)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks held by requests
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, found
    num_preemptions: int = 0
    spec_decode: SpecDecodeStats | None = None  # a copy; None without speculation


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    stream: _Stream
    prompt_text: str | None = None
    pooling: PoolingParams | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _FailAll:
    message: str


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        _call_soon(self.loop, self.queue.put_nowait, item)


class RequestStream:
    """The outputs of one submitted request, as an async iterator (cumulative outputs; the last
    has finished=True). Invalid input raises its ValueError at the first iteration, an engine
    failure RequestFailedError. Leaving early (aclose, a cancelled task) aborts the request."""

    def __init__(
        self, engine: AsyncEngine, request_id: str, stream: _Stream, num_samples: int = 1
    ) -> None:
        self._engine, self.request_id, self._stream = engine, request_id, stream
        self.num_samples = num_samples  # params.n: the engine requests it stands for
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._stream.queue.get()
        except BaseException:
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.error is not None:
            self._done = True
            kind = (
                StructuredOutputFailedError
                if item.error.startswith(STRUCTURED_OUTPUT_FAILED)
                else RequestFailedError
            )
            raise kind(f"request {self.request_id} failed: {item.error}")
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        """Builds the LLMEngine on the engine thread and returns once it is ready; a failure to
        build (bad model folder, bad option) is raised here."""
        self._inbox: queue.SimpleQueue[_Add | _Abort | _FailAll | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        # Samples submitted whose add the engine thread has not finished: with the scheduler's
        # waiting list they make the waiting count admission checks against.
        self._lock = threading.Lock()
        self._unadded_samples = 0
        self._stopping = False
        # Why the engine died (a tensor-parallel worker exited): it computes nothing any more.
        self.failure: str | None = None
        # Called (on any thread) with that reason once the engine has died; a server stops.
        self.on_failure: list[Callable[[str], None]] = []
        # Called on the engine thread after each step with its wall time (seconds) and the
        # outputs it produced (metrics: step time, inter-token latency). Keep them cheap.
        self.step_observers: list[Callable[[float, list[RequestOutput]], None]] = []
        self.engine: LLMEngine
        self.info: EngineInfo
        self._stats = EngineStats()
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(config,), name="nightshift-engine", daemon=True
        )
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error

    def stats(self) -> EngineStats:
        return self._stats

    def encode_prompt(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        """(token ids, text) of a prompt; safe on any thread (a server's worker threads)."""
        text, ids = self.engine.encode_prompt(prompt)
        return ids, text

    def encode_chat(self, messages: list[dict], **template_options) -> list[int]:
        """A conversation rendered by the model's chat template, as token ids; any thread."""
        return self.engine.encode_chat(messages, **template_options)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def is_unfinished(self, request_id: str) -> bool:
        """Whether a request is still served: neither finished nor aborted. Exact on the engine
        thread (step observers forget aborted requests by it), a moment late elsewhere."""
        return request_id in self._streams

    @property
    def num_waiting(self) -> int:
        """Samples not yet running: submitted and not added yet, or in the waiting queue. Counted
        high for a moment while the engine thread adds one, never low."""
        with self._lock:
            return self._unadded_samples + len(self.engine.core.scheduler.waiting)

    def submit(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        *,
        prompt_text: str | None = None,
        max_waiting: int | None = None,
    ) -> RequestStream:
        """Queue a request now (call it on the event loop's thread). prompt_text: the text of a
        prompt given as token ids, reported back as RequestOutput.prompt. max_waiting: refuse
        with QueueFullError when this request's samples would make more than that many wait."""
        return self.submit_many([(request_id, prompt, prompt_text)], params, priority, max_waiting)[
            0
        ]

    def submit_many(
        self,
        prompts: list[tuple[str, str | list[int], str | None]],
        params: SamplingParams,
        priority: int = 0,
        max_waiting: int | None = None,
        *,
        pooling: PoolingParams | None = None,
    ) -> list[RequestStream]:
        """Several requests (request_id, prompt, prompt_text) admitted together or not at all.
        pooling: embedding requests (params with max_tokens=0 and n=1); each final output has
        the prompt's pooled hidden state in RequestOutput.embedding."""
        if not self.is_alive:
            raise RuntimeError("the engine loop is not running")
        samples = params.n * len(prompts)
        with self._lock:
            waiting = self._unadded_samples + len(self.engine.core.scheduler.waiting)
            if max_waiting is not None and waiting + samples > max_waiting:
                raise QueueFullError(max_waiting)
            self._unadded_samples += samples
        loop = asyncio.get_running_loop()
        streams = []
        for request_id, prompt, text in prompts:
            stream = _Stream(loop, asyncio.Queue())
            self._inbox.put(_Add(request_id, prompt, params, priority, stream, text, pooling))
            streams.append(RequestStream(self, request_id, stream, params.n))
        return streams

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """submit(), as an async generator."""
        stream = self.submit(request_id, prompt, params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def fail_all(self, message: str) -> None:
        """End every unfinished request with EngineShutdownError(message); thread-safe (the
        server calls it from a timer when its grace period after SIGTERM runs out)."""
        self._inbox.put(_FailAll(message))

    def shutdown(self, timeout: float | None = 10.0) -> bool:
        """Stop the loop thread (requests still running are aborted); whether it has stopped
        within timeout seconds."""
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- the engine thread ------------------------------------------------------------------

    def _run(self, config: EngineConfig) -> None:
        # The engine is built on this thread, not the caller's: torch's OpenMP pool belongs to
        # the thread that first runs a parallel region, and when another thread (loading the
        # weights, say) made one first, this thread's small matmuls ran about 30% slower on a
        # 2-core machine (measured: a 32 x 576 x 1536 linear, 400 vs 520 us; the serving
        # benchmark's steps 28% slower than offline).
        try:
            self.engine = LLMEngine(config)
            self.info = _info(config, self.engine)
            self._publish_stats()
            executor_failures = getattr(self.engine.core.executor, "on_failure", None)
            if executor_failures is not None:  # noticed even while idle, on its monitor thread
                executor_failures.append(self._die)
        except BaseException as e:  # noqa: BLE001 - handed to the constructor's caller
            self._build_error = e
            return
        finally:
            self._built.set()
        try:
            self._loop()
        finally:
            self.engine.core.shutdown()

    def _die(self, reason: str) -> None:
        """The executor can compute no more: end every request and the loop; tell the server."""
        if self.failure is not None:
            return
        self.failure = reason
        self._stopping = True
        self._inbox.put(None)
        # Told now, not when the engine thread gets there: it may be waiting in a collective
        # with a rank that stopped answering. (The loop tells them again as it ends; a stream
        # ends at its first error, so nobody hears it twice.)
        for stream in list(self._streams.values()):
            stream.put(RequestFailedError(f"the engine failed: {reason}"))
        for callback in list(self.on_failure):
            callback(reason)

    def _loop(self) -> None:
        while True:
            block = not self.engine.has_unfinished()
            if not self._drain_inbox(block):
                break
            if self.engine.has_unfinished():
                self._step()
            else:
                self._publish_stats()  # aborts emptied it: nothing runs any more
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            if self.failure is not None:
                stream.put(RequestFailedError(f"the engine failed: {self.failure}"))
            else:
                stream.put(EngineShutdownError("the engine is shutting down"))
        self._streams.clear()

    def _drain_inbox(self, block: bool) -> bool:
        """Apply pending adds and aborts; wait for one when idle. False once shutdown is asked."""
        while True:
            try:
                command = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command is None:
                return False
            if isinstance(command, _Abort):
                if self._streams.pop(command.request_id, None) is not None:
                    self.engine.abort(command.request_id)
                continue
            if isinstance(command, _FailAll):
                for request_id, stream in list(self._streams.items()):
                    self.engine.abort(request_id)
                    stream.put(EngineShutdownError(command.message))
                self._streams.clear()
                continue
            try:
                self.engine.add_request(
                    command.request_id,
                    command.prompt,
                    command.params,
                    priority=command.priority,
                    prompt_text=command.prompt_text,
                    pooling=command.pooling,
                )
            except ValueError as e:
                command.stream.put(e)
                continue
            except Exception as e:  # noqa: BLE001 - the engine's fault, not the caller's
                logger.exception("request %s: adding it failed", command.request_id)
                command.stream.put(RequestFailedError(f"adding the request failed: {e}"))
                continue
            finally:
                with self._lock:
                    self._unadded_samples -= command.params.n
            self._streams[command.request_id] = command.stream

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except ExecutorFailedError as e:
            self._die(str(e))
            return
        except Exception as e:  # noqa: BLE001 - one failed step must not stop the server
            # Failures a request can be blamed for end that request inside step(); one that
            # escapes it cannot be pinned on anybody, so every request ends with a clean error.
            logger.exception("engine step failed; failing every unfinished request")
            for request_id, stream in list(self._streams.items()):
                self.engine.abort(request_id)
                stream.put(RequestFailedError(f"engine step failed: {e}"))
            self._streams.clear()
            return
        elapsed = time.perf_counter() - start
        self._publish_stats()
        for observe in self.step_observers:
            observe(elapsed, outputs)
        # One wake-up of each event loop per step, not one per request.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted while the step ran
            if out.finished:
                del self._streams[out.request_id]
            batches.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in batches.items():
            _call_soon(loop, _deliver, items)

    def _publish_stats(self) -> None:
        core = self.engine.core
        sched, kv = core.scheduler, core.kv
        spec = None
        if core.proposer is not None:
            s = core.spec_stats
            spec = SpecDecodeStats(
                s.num_drafts,
                s.num_draft_tokens,
                s.num_accepted_tokens,
                list(s.accepted_per_position),
            )
        # One assignment: a reader sees the whole old snapshot or the whole new one.
        self._stats = EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            kv_cache_usage=kv.usage(),
            prefix_cache_queries=kv.prefix_stats.queried_tokens,
            prefix_cache_hits=kv.prefix_stats.hit_tokens,
            num_preemptions=sched.num_preemptions,
            spec_decode=spec,
        )


def _info(config: EngineConfig, engine: LLMEngine) -> EngineInfo:
    core = engine.core
    return EngineInfo(
        model=str(config.model),
        model_dir=str(engine.model_dir),
        max_model_len=core.max_model_len,
        max_request_tokens=core.max_request_tokens,
        num_kv_blocks=core.num_blocks,
        block_size=config.block_size,
        kv_cache_dtype=config.kv_cache_dtype,
        vocab_size=core.vocab_size,
        hidden_size=core.hidden_size,
        speculative=core.proposer is not None,
        tokenizer=engine.tokenizer,
    )


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable, *args: object) -> None:
    """call_soon_threadsafe, except that a loop already closed (its server has shut down while
    a step ran) is skipped: nobody is left to read what would go there."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
