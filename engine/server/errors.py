"""Every error the server answers has OpenAI's body, {"error": {message, type, param, code}}:
bad input (400), auth (401), unknown routes (404/405), oversized bodies (413), a full queue
(429), engine failures (500) and shutdown (503). Streams that fail after their first byte end
with the same object as an SSE event, then `data: [DONE]`. The body itself, and APIError, are in
error_body.py (no engine imports)."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import QueueFullError
from engine.errors import EngineShutdownError, RequestFailedError, StructuredOutputFailedError

# Re-exported: the serving modules import them from here.
from engine.server.error_body import APIError, error_body, error_response

logger = logging.getLogger(__name__)


def as_api_error(e: BaseException) -> APIError:
    """The HTTP error for an exception raised while serving a request."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), "rate_limit_exceeded", code="queue_full")
    if isinstance(e, StructuredOutputFailedError):
        return APIError(400, str(e), code="structured_output_failed")
    if isinstance(e, EngineShutdownError):
        return APIError(503, str(e), code="shutting_down")
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), code="engine_error")
    if isinstance(e, ValueError):
        return APIError(400, str(e), param=getattr(e, "param", None))
    return APIError(500, f"internal server error: {type(e).__name__}: {e}")


# pydantic's names for the members of a union, which its error locations include after the
# field ("prompt.list[int].0"): not part of the request's own path.
_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "null"})


def field_path(loc: tuple) -> str:
    """The request field a validation error is about, written as the server's own checks write
    it: "temperature", "messages[0].content", "logit_bias.50256" (no "body", no union members)."""
    loc = loc[1:] if loc[:1] == ("body",) else loc
    path = ""
    for p in loc:
        if isinstance(p, int):
            path += f"[{p}]"
        elif not ("[" in p or p in _UNION_MEMBERS):
            path += f".{p}" if path else p
    return path


def sse_error(e: BaseException) -> str:
    """The SSE event a failed stream ends with (before `data: [DONE]`)."""
    err = as_api_error(e)
    return f"data: {json.dumps(error_body(err.message, err.kind, err.param, err.code))}\n\n"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.kind, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = field_path(tuple(first.get("loc", ())))
        message = str(first.get("msg", "invalid request body"))
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error')}"
            where = ""
        return error_response(400, f"{where}: {message}" if where else message, param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        response = error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}")
        for name, value in (e.headers or {}).items():
            response.headers[name] = value
        return response

    async def _known(_: Request, e: Exception) -> JSONResponse:
        err = as_api_error(e)
        return error_response(err.status, err.message, err.kind, err.param, err.code)

    # Handled where they are raised, no traceback: the caller's bad input, a full queue, a
    # request the engine failed (the engine logged why) or ended at shutdown.
    for known in (ValueError, QueueFullError, RequestFailedError):
        app.add_exception_handler(known, _known)

    @app.exception_handler(Exception)
    async def _any(_: Request, e: Exception) -> JSONResponse:
        # A bug: answered in OpenAI's shape, and Starlette logs the traceback.
        err = as_api_error(e)
        if err.status >= 500:
            logger.error("request failed: %s", err.message, exc_info=e)
        return error_response(err.status, err.message, err.kind, err.param, err.code)
