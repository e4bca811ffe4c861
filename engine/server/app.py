"""The OpenAI-compatible API over AsyncEngine: chat and text completions (streaming or not),
models, health, version. Errors use OpenAI's body (engine/server/errors.py); bad input is a 400
and never stops the server; no request can fail another.

A request's path: limits checked (limits.py), prompts tokenized off the event loop and off the
engine thread (a length bound refuses a huge prompt before tokenizing), admitted atomically with
its samples counted against --max-waiting-requests, then streamed or awaited while watching for
the client's disconnect (disconnect.py), which aborts the request in the engine."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.async_engine import AsyncEngine, RequestStream
from engine.outputs import CompletionOutput, RequestOutput
from engine.server.auth import APIKeyCheck
from engine.server.disconnect import ClientDisconnected, until_disconnected
from engine.server.errors import APIError, as_api_error, install_error_handlers, sse_error
from engine.server.limits import (
    BodySizeLimit,
    RequestLimits,
    check_prompt_count,
    check_samples,
    check_sampling,
)
from engine.server.metrics import ServerMetrics
from engine.server.protocol import ChatCompletionRequest, CompletionRequest

VERSION = "0.1.0"
_DONE = "data: [DONE]\n\n"


def create_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_waiting_requests: int | None = None,
    limits: RequestLimits | None = None,
) -> FastAPI:
    limits = limits or RequestLimits()

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        # Stopped while the event loop still runs, so requests still open get their error.
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="Nightshift", version=VERSION, lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_bytes)
    if api_key:
        app.add_middleware(APIKeyCheck, api_key=api_key)  # outermost: before reading a body
    tokenizer = engine.engine.tokenizer
    max_model_len = engine.engine.core.max_model_len
    # No prompt longer than this can fit, whatever it says: no token covers more characters.
    max_prompt_chars = max_model_len * _max_token_chars(tokenizer)
    metrics = ServerMetrics(engine)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine.is_alive
        return JSONResponse(
            {"status": "ok" if ok else "engine loop stopped"}, status_code=200 if ok else 503
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "nightshift",
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {served_model_name!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def check_length(chars: int, field: str) -> None:
        if chars > max_prompt_chars:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"{field} has {chars} characters, more than {max_model_len} tokens can hold "
                f"(refused before tokenizing).",
                param=field,
                code="context_length_exceeded",
            )

    def submit(
        rid: str, prompts: list[tuple[list[int], str | None]], params
    ) -> list[RequestStream]:
        samples = params.n * len(prompts)
        if max_waiting_requests is not None and samples > max_waiting_requests:
            # Every admitted sample waits until the scheduler takes it: more than the limit
            # would overflow the queue even when it is empty.
            raise APIError(
                400,
                f"n x prompts = {samples} samples, over this server's waiting limit of "
                f"{max_waiting_requests} (set by --max-waiting-requests), so it is never admitted",
                param="n",
                code="limit_exceeded",
            )
        try:
            return engine.submit_many(
                [
                    (f"{rid}-{i}" if len(prompts) > 1 else rid, ids, text)
                    for i, (ids, text) in enumerate(prompts)
                ],
                params,
                max_waiting=max_waiting_requests,
            )
        except Exception as e:
            metrics.rejected.labels(as_api_error(e).code or "error").inc()
            raise

    async def respond(request: Request, work: Awaitable, streams: list[RequestStream]):
        """Await the response while the client is there; a client gone aborts the request.
        Unless a stream's response takes them over, the request streams end here."""
        result = None
        try:
            result = await until_disconnected(request, work)
            return result
        except ClientDisconnected:
            metrics.aborted.labels("client_disconnect").inc()
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        except Exception as e:
            metrics.count_failure(e)
            raise
        finally:
            if not isinstance(result, StreamingResponse):
                for s in streams:
                    await s.aclose()

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        check_sampling(body, limits)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        # Every message renders to at least one token, every token to at most so many chars.
        check_length(sum(len(m["content"]) for m in messages), "messages")
        if len(messages) > max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"messages are {len(messages)}, each at least one token.",
                param="messages",
                code="context_length_exceeded",
            )
        # Compiling a structured-output constraint can take a while: not on the event loop.
        params = await asyncio.to_thread(body.to_sampling_params)
        # Rendering and tokenizing run on a worker thread: neither the event loop nor the
        # engine's steps wait for them.
        prompt_ids = await asyncio.to_thread(engine.engine.encode_chat, messages)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = submit(rid, [(prompt_ids, None)], params)

        async def work():
            first = await _first(streams[0])
            if body.stream:
                return _sse(guarded(_chat_stream(rid, body, first, streams[0]), streams))
            final = await _last(first, streams[0])
            metrics.observe_finished(final)
            return _chat_response(rid, body, final)

        return await respond(request, work(), streams)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        check_sampling(body, limits)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt is empty", "invalid_request_error", "prompt")
        check_prompt_count(len(prompts), limits)
        check_samples(body.n * len(prompts), limits)
        for p in prompts:
            check_length(len(p), "prompt")
        params = await asyncio.to_thread(body.to_sampling_params)
        encoded = await asyncio.to_thread(_encode_all, engine, prompts)
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = submit(rid, encoded, params)

        async def work():
            firsts = [await _first(s) for s in streams]
            if body.stream:
                return _sse(guarded(_completion_stream(rid, body, firsts, streams), streams))
            finals = await asyncio.gather(*(_last(f, s) for f, s in zip(firsts, streams)))
            for final in finals:
                metrics.observe_finished(final)
            return _completion_response(rid, body, finals)

        return await respond(request, work(), streams)

    async def guarded(events: AsyncIterator[str], streams: list[RequestStream]):
        """Every stream ends with `data: [DONE]`: after its last chunk, or after an error event
        when the engine fails it (or shuts down) mid-way. A client gone aborts the request."""
        ended = False
        try:
            async for event in events:
                yield event
            ended = True
        except Exception as e:  # noqa: BLE001 - reported to the client, in OpenAI's shape
            metrics.count_failure(e)
            ended = True
            yield sse_error(e)
            yield _DONE
        finally:
            if not ended:
                metrics.aborted.labels("client_disconnect").inc()
            for s in streams:
                await s.aclose()

    def prompt_text(out: RequestOutput) -> str:
        """What echo repeats: the prompt's text, decoded when it came as token ids."""
        if out.prompt is not None:
            return out.prompt
        return tokenizer.decode(out.prompt_token_ids) if tokenizer is not None else ""

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)

    def chat_logprobs(out: CompletionOutput, start: int, k: int) -> dict | None:
        """OpenAI's chat logprobs for tokens start.. of one choice (top k alternatives each)."""
        if out.logprobs is None:
            return None
        content = []
        for token_id, lp in zip(out.token_ids[start:], out.logprobs[start:]):
            top = sorted(lp.items(), key=lambda item: -item[1])[:k]
            text = token_text(token_id)
            content.append(
                {
                    "token": text,
                    "logprob": lp[token_id],
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": token_text(t),
                            "logprob": v,
                            "bytes": list(token_text(t).encode()),
                        }
                        for t, v in top
                    ],
                }
            )
        return {"content": content}

    def usage(finals: list[RequestOutput]) -> dict:
        prompt = sum(len(f.prompt_token_ids) for f in finals)
        completion = sum(len(o.token_ids) for f in finals for o in f.outputs)
        cached = sum(f.metrics.num_cached_tokens for f in finals)
        out = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if engine.engine.core.proposer is not None:
            # OpenAI reports predicted-output tokens here; speculation's drafts are the same idea.
            accepted = sum(f.metrics.num_accepted_tokens for f in finals)
            proposed = sum(f.metrics.num_draft_tokens for f in finals)
            out["completion_tokens_details"] = {
                "accepted_prediction_tokens": accepted,
                "rejected_prediction_tokens": proposed - accepted,
            }
        return out

    def _chat_response(rid: str, body: ChatCompletionRequest, final: RequestOutput) -> dict:
        choices = [
            {
                "index": o.index,
                "message": {"role": "assistant", "content": o.text},
                "logprobs": chat_logprobs(o, 0, body.top_logprobs or 0),
                "finish_reason": o.finish_reason,
            }
            for o in final.outputs
        ]
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": choices,
            "usage": usage([final]),
        }

    async def _chat_stream(
        rid: str,
        body: ChatCompletionRequest,
        first: RequestOutput,
        outputs: AsyncIterator[RequestOutput],
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[dict], extra: dict | None = None) -> str:
            data = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.model,
                "choices": choices,
                **(extra or {}),
            }
            return f"data: {json.dumps(data)}\n\n"

        sent_text = [""] * len(first.outputs)
        sent_tokens = [0] * len(first.outputs)
        yield chunk(
            [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(len(first.outputs))
            ]
        )
        final = first
        async for out in _chain(first, outputs):
            final = out
            choices = []
            for o in out.outputs:
                delta = o.text[len(sent_text[o.index]) :]
                if not delta and o.finish_reason is None:
                    continue
                choices.append(
                    {
                        "index": o.index,
                        "delta": {"content": delta} if delta else {},
                        "logprobs": chat_logprobs(o, sent_tokens[o.index], body.top_logprobs or 0),
                        "finish_reason": o.finish_reason,
                    }
                )
                sent_text[o.index], sent_tokens[o.index] = o.text, len(o.token_ids)
            if choices:
                yield chunk(choices)
        if final.finished:
            metrics.observe_finished(final)
        if body.include_usage:
            yield chunk([], {"usage": usage([final])})
        yield _DONE

    def _completion_choice(
        index: int, body: CompletionRequest, final: RequestOutput, o: CompletionOutput
    ) -> dict:
        text = (prompt_text(final) if body.echo else "") + o.text
        logprobs = None
        if o.logprobs is not None:
            logprobs = {
                "tokens": [token_text(t) for t in o.token_ids],
                "token_logprobs": [lp.get(t) for t, lp in zip(o.token_ids, o.logprobs)],
                "top_logprobs": [{token_text(t): v for t, v in lp.items()} for lp in o.logprobs],
                "text_offset": [],
            }
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": o.finish_reason,
        }

    def _completion_response(
        rid: str, body: CompletionRequest, finals: list[RequestOutput]
    ) -> dict:
        n = body.n
        choices = [
            _completion_choice(i * n + o.index, body, f, o)
            for i, f in enumerate(finals)
            for o in f.outputs
        ]
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": choices,
            "usage": usage(finals),
        }

    async def _completion_stream(
        rid: str,
        body: CompletionRequest,
        firsts: list[RequestOutput],
        streams: list[AsyncIterator[RequestOutput]],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for out in _chain(firsts[i], streams[i]):
                    await queue.put((i, out))
            except Exception as e:  # noqa: BLE001 - re-raised by the reader below
                await queue.put((i, e))
                return
            await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
        sent = {}
        finals: dict[int, RequestOutput] = {}
        try:
            running = len(tasks)
            while running:
                i, out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                if out is None:
                    running -= 1
                    continue
                finals[i] = out
                choices = []
                for o in out.outputs:
                    key = (i, o.index)
                    prev = sent.get(key, "")
                    delta = o.text[len(prev) :]
                    if body.echo and key not in sent:
                        delta = prompt_text(out) + delta
                    if not delta and o.finish_reason is None:
                        continue
                    sent[key] = o.text
                    choices.append(
                        {
                            "index": i * body.n + o.index,
                            "text": delta,
                            "logprobs": None,
                            "finish_reason": o.finish_reason,
                        }
                    )
                if choices:
                    data = {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": body.model,
                        "choices": choices,
                    }
                    yield f"data: {json.dumps(data)}\n\n"
            for final in finals.values():
                metrics.observe_finished(final)
            if body.include_usage:
                data = {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": body.model,
                    "choices": [],
                    "usage": usage([finals[i] for i in sorted(finals)]),
                }
                yield f"data: {json.dumps(data)}\n\n"
            yield _DONE
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                await s.aclose()

    return app


async def _first(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The first output; raises the request's ValueError (a 400) before any byte is sent."""
    try:
        return await outputs.__anext__()
    except StopAsyncIteration as e:  # pragma: no cover - the engine always sends one
        raise RuntimeError("engine returned no output") from e


async def _chain(
    first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    yield first
    if not first.finished:
        async for out in rest:
            yield out


async def _last(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = first
    async for out in _chain(first, rest):
        final = out
    return final


def _encode_all(
    engine: AsyncEngine, prompts: list[str | list[int]]
) -> list[tuple[list[int], str | None]]:
    """(token ids, text) per prompt; runs on a worker thread."""
    return [engine.engine.encode_prompt(p)[::-1] for p in prompts]


def _max_token_chars(tokenizer) -> int:
    """The most characters one token stands for (from its UTF-8 length in the vocabulary, an
    upper bound for byte-level and sentencepiece vocabularies alike); 64 without a tokenizer,
    whose prompts are token ids anyway."""
    if tokenizer is None:
        return 64
    return max((len(t.encode("utf-8")) for t in tokenizer.get_vocab()), default=1)


def _sse(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
