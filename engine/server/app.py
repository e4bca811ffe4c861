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
from engine.server.batch_config import BatchConfig
from engine.server.cors import CorsConfig, add_cors
from engine.server.errors import install_error_handlers
from engine.server.limits import BodySizeLimit, RequestLimits
from engine.server.metrics import ServerMetrics
from engine.server.protocol import CompletionRequest
from engine.server.protocol_chat import ChatCompletionRequest
from engine.server.protocol_embedding import EmbeddingRequest
from engine.server.protocol_tokenize import DetokenizeRequest, TokenizeRequest
from engine.server.serving_chat import OpenAIServingChat
from engine.server.serving_completion import OpenAIServingCompletion
from engine.server.serving_embedding import OpenAIServingEmbedding
from engine.server.serving_models import OpenAIServingModels
from engine.server.serving_tokenize import OpenAIServingTokenization

VERSION = "0.1.0"
UPLOAD_OVERHEAD = 64 << 10  # a multipart body's headers and boundaries around the file


def create_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_waiting_requests: int | None = None,
    limits: RequestLimits | None = None,
    *,
    cors: CorsConfig | None = None,
    tool_call_parser: str | None = None,
    pooling_type: str = "last",
    trust_request_chat_template: bool = False,
    batch: BatchConfig | None = None,
) -> FastAPI:
    """tool_call_parser: how "auto" tool choice finds calls in the model's text (hermes,
    llama3_json, mistral); None picks one from the chat template. pooling_type: how
    /v1/embeddings pools the final hidden states, "last" (vLLM's default for decoder models)
    or "mean". trust_request_chat_template: run a request's own chat_template (off: a 400).
    batch: serve /v1/files and /v1/batches with these limits and storage (None: not served)."""
    limits = limits or RequestLimits()
    runners = []

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        for runner in runners:
            await runner.start()
        yield
        for runner in runners:  # before the engine: lines in flight end first, unjournaled
            await runner.stop()
        # Stopped while the event loop still runs, so requests still open get their error. A
        # dead engine's thread may be stuck in a collective: not waited for long.
        await asyncio.to_thread(engine.shutdown, 10.0 if engine.failure is None else 1.0)

    app = FastAPI(title="Nightshift", version=VERSION, lifespan=lifespan)
    install_error_handlers(app)
    uploads = {"/v1/files": batch.max_file_bytes + UPLOAD_OVERHEAD} if batch else {}
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_bytes, path_limits=uploads)
    if api_key:
        app.add_middleware(APIKeyCheck, api_key=api_key)  # before reading a body
    add_cors(app, cors or CorsConfig())  # outermost: preflights never carry the key
    metrics = ServerMetrics(engine, served_model_name)
    serving = (engine, served_model_name, metrics, limits, max_waiting_requests)
    trust = {"trust_request_chat_template": trust_request_chat_template}
    chat = OpenAIServingChat(*serving, tool_call_parser=tool_call_parser, **trust)
    completion = OpenAIServingCompletion(*serving)
    embedding = OpenAIServingEmbedding(*serving, pooling_type=pooling_type)
    tokenization = OpenAIServingTokenization(*serving, **trust)
    model_cards = OpenAIServingModels(engine.info, served_model_name)
    if batch is not None:
        # Imported here: SQLAlchemy and Alembic load only for a server that serves batches.
        from engine.server.batch_api import install_batch_api

        runners.append(install_batch_api(app, batch, served_model_name, api_key, metrics))

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine.is_alive
        return JSONResponse(
            {"status": "ok" if ok else "engine loop stopped"}, status_code=200 if ok else 503
        )

    # vLLM's SageMaker-compatible probe: the same answer as /health, to GET and POST (one
    # route each, so that each operation has its own id in /openapi.json).
    for method in ("GET", "POST"):
        app.add_api_route("/ping", health, methods=[method], name=f"ping_{method.lower()}")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models() -> dict:
        return model_cards.list()

    # :path, since a served name may hold slashes ("org/model").
    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict:
        return model_cards.retrieve(model)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await chat.create(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await completion.create(body, request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        return await embedding.create(body, request)

    # At the root, as vLLM serves them; they need the API key too when one is set (auth.py).
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        return await tokenization.detokenize(body)

    return app
