"""The OpenAI-compatible API over AsyncEngine: routes and error handlers only. Each endpoint
family's request handling and response shaping lives in its serving_*.py module; errors use
OpenAI's body (engine/server/errors.py); bad input is a 400 and never stops the server; no request
can fail another.

A generating request's path: limits checked (limits.py), prompts tokenized off the event loop and
off the engine thread (a length bound refuses a huge prompt before tokenizing), admitted
atomically with its samples counted against --max-waiting-requests (serving_engine.py), then
streamed or awaited while watching for the client's disconnect (disconnect.py), which aborts the
request in the engine."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.async_engine import AsyncEngine
from engine.server.auth import APIKeyCheck
from engine.server.cors import CorsConfig, add_cors
from engine.server.errors import install_error_handlers
from engine.server.limits import BodySizeLimit, RequestLimits
from engine.server.metrics import ServerMetrics
from engine.server.protocol import CompletionRequest
from engine.server.protocol_chat import ChatCompletionRequest
from engine.server.serving_chat import OpenAIServingChat
from engine.server.serving_completion import OpenAIServingCompletion

VERSION = "0.1.0"


def create_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_waiting_requests: int | None = None,
    limits: RequestLimits | None = None,
    *,
    cors: CorsConfig | None = None,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """tool_call_parser: how "auto" tool choice finds calls in the model's text (hermes,
    llama3_json, mistral); None picks one from the chat template."""
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
        app.add_middleware(APIKeyCheck, api_key=api_key)  # before reading a body
    add_cors(app, cors or CorsConfig())  # outermost: preflights never carry the key
    metrics = ServerMetrics(engine)
    serving = (engine, served_model_name, metrics, limits, max_waiting_requests)
    chat = OpenAIServingChat(*serving, tool_call_parser=tool_call_parser)
    completion = OpenAIServingCompletion(*serving)
    info = engine.info

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
            "max_model_len": info.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await chat.create(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await completion.create(body, request)

    return app
