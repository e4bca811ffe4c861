"""AsyncEngine: an LLMEngine stepped on its own thread, with an asyncio face for servers.

The engine loop never runs on the event loop: one dedicated thread owns the LLMEngine (its
tokenizer, scheduler, model and detokenizers) and steps while any request is unfinished. Callers
on an event loop submit requests through a thread-safe inbox and receive each request's outputs
on an asyncio.Queue of its own, fed with call_soon_threadsafe. Tokenization and detokenization
happen on the engine thread too, so neither blocks the event loop.
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
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    stream: _Stream


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        """Builds the LLMEngine on the engine thread and returns once it is ready; a failure to
        build (bad model folder, bad option) is raised here."""
        self._inbox: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
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

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it progresses (cumulative; the last has finished=True).
        Invalid input raises its ValueError at the first iteration. Leaving the iteration early
        (a client gone, a cancelled task) aborts the request and frees its KV blocks."""
        if not self.is_alive:
            raise RuntimeError("the engine loop is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._inbox.put(_Add(request_id, prompt, params, priority, stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

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
            stream.put(RuntimeError("the engine is shutting down"))
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
            try:
                self.engine.add_request(
                    command.request_id, command.prompt, command.params, priority=command.priority
                )
            except ValueError as e:
                command.stream.put(e)
                continue
            self._streams[command.request_id] = command.stream

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - one failed step must not stop the server
            logger.exception("engine step failed; aborting its requests")
            for request_id, stream in list(self._streams.items()):
                self.engine.abort(request_id)
                stream.put(RuntimeError(f"engine step failed: {e}"))
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
            loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
