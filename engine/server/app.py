"""The OpenAI-compatible API over AsyncEngine: chat and text completions (streaming or not),
models, health, version. Errors use OpenAI's body, {"error": {message, type, param, code}}; bad
input is a 400 and never stops the server."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.async_engine import AsyncEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.server.metrics import ServerMetrics
from engine.server.protocol import ChatCompletionRequest, CompletionRequest

VERSION = "0.1.0"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )


def error_response(
    status: int, message: str, kind: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def create_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_waiting_requests: int | None = None,
) -> FastAPI:
    app = FastAPI(title="Nightshift", version=VERSION)
    tokenizer = engine.engine.tokenizer
    metrics = ServerMetrics(engine)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        response = error_response(e.status, e.message, e.kind, e.param, e.code)
        if e.status == 429:
            response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = (
            f"{where}: {first.get('msg', 'invalid request')}"
            if where
            else str(first.get("msg", "invalid request body"))
        )
        return error_response(400, message, "invalid_request_error", where or None)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, e: ValueError) -> JSONResponse:
        return error_response(400, str(e), "invalid_request_error")

    @app.middleware("http")
    async def _check_key(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            header = request.headers.get("authorization", "")
            if header != f"Bearer {api_key}":
                return error_response(
                    401,
                    "invalid or missing API key",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
        return await call_next(request)

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
            "max_model_len": engine.engine.core.max_model_len,
        }
        return {"object": "list", "data": [card]}

    def check_admission(name: str) -> None:
        if max_waiting_requests is not None and (
            len(engine.engine.core.scheduler.waiting) >= max_waiting_requests
        ):
            raise APIError(
                429,
                f"the waiting queue is full ({max_waiting_requests} requests); retry later",
                "rate_limit_exceeded",
                code="queue_full",
            )
        check_model(name)

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {served_model_name!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        check_admission(body.model)
        params = body.to_sampling_params()
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        # Rendering and tokenizing run off the event loop.
        prompt_ids = await asyncio.to_thread(engine.engine.encode_chat, messages)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        outputs = engine.generate(rid, prompt_ids, params)
        first = await _first(outputs)
        if body.stream:
            return _sse(_chat_stream(rid, body, first, outputs))
        final = await _last(first, outputs)
        metrics.observe_finished(final)
        return _chat_response(rid, body, final)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        check_admission(body.model)
        params = body.to_sampling_params()
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt is empty", "invalid_request_error", "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = [engine.generate(f"{rid}-{i}", p, params) for i, p in enumerate(prompts)]
        try:
            firsts = [await _first(s) for s in streams]
        except BaseException:
            for s in streams:
                await s.aclose()
            raise
        if body.stream:
            return _sse(_completion_stream(rid, body, firsts, streams))
        finals = await asyncio.gather(*(_last(f, s) for f, s in zip(firsts, streams)))
        for final in finals:
            metrics.observe_finished(final)
        return _completion_response(rid, body, finals)

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
        yield "data: [DONE]\n\n"

    def _completion_choice(
        index: int, body: CompletionRequest, final: RequestOutput, o: CompletionOutput
    ) -> dict:
        text = (
            (final.prompt or (tokenizer.decode(final.prompt_token_ids) if tokenizer else ""))
            if body.echo
            else ""
        ) + o.text
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
            async for out in _chain(firsts[i], streams[i]):
                await queue.put((i, out))
            await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
        sent = {}
        finals: dict[int, RequestOutput] = {}
        try:
            running = len(tasks)
            while running:
                i, out = await queue.get()
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
                        delta = (out.prompt or "") + delta
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
            yield "data: [DONE]\n\n"
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


def _sse(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
