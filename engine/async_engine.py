"""AsyncEngine: an LLMEngine stepped on its own thread, with an asyncio face for servers.

The engine loop never runs on the event loop: one dedicated thread owns the LLMEngine (its
tokenizer, scheduler, model and detokenizers) and steps while any request is unfinished. Callers
on an event loop submit requests through a thread-safe inbox and receive each request's outputs
on an asyncio.Queue of its own, fed with call_soon_threadsafe. Detokenization happens on the
engine thread; callers tokenize before submitting (a long prompt must not stall the steps).

Admission is atomic: submit() counts a request's samples as waiting at once, on the caller's
thread, so a burst cannot overshoot a waiting limit before the engine thread has seen any of it.
A request the engine fails (FINISHED_ERROR) ends its stream with RequestFailedError; the rest go on.
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
    RequestFailedError,
    StructuredOutputFailedError,
)
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    """submit() refused a request: admitting it would put more samples in the waiting queue than
    the limit allows."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the waiting queue is full ({limit} requests); retry later")
        self.limit = limit


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    stream: _Stream
    prompt_text: str | None = None


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

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream) -> None:
        self._engine, self.request_id, self._stream = engine, request_id, stream
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
        # Called on the engine thread with each step's wall time (seconds), e.g. by metrics.
        self.step_observers: list[Callable[[float], None]] = []
        self.engine: LLMEngine
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

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

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
    ) -> list[RequestStream]:
        """Several requests (request_id, prompt, prompt_text) admitted together or not at all."""
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
            self._inbox.put(_Add(request_id, prompt, params, priority, stream, text))
            streams.append(RequestStream(self, request_id, stream))
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

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the loop thread (requests still running are aborted)."""
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout)

    # ---- the engine thread ------------------------------------------------------------------

    def _run(self, config: EngineConfig) -> None:
        # The engine is built on this thread, not the caller's: torch's OpenMP pool belongs to
        # the thread that first runs a parallel region, and when another thread (loading the
        # weights, say) made one first, this thread's small matmuls ran about 30% slower on a
        # 2-core machine (measured: a 32 x 576 x 1536 linear, 400 vs 520 us; the serving
        # benchmark's steps 28% slower than offline).
        try:
            self.engine = LLMEngine(config)
        except BaseException as e:  # noqa: BLE001 - handed to the constructor's caller
            self._build_error = e
            return
        finally:
            self._built.set()
        while True:
            block = not self.engine.has_unfinished()
            if not self._drain_inbox(block):
                break
            if self.engine.has_unfinished():
                self._step()
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
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
        for observe in self.step_observers:
            observe(elapsed)
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
