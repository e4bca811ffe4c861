"""What one request may ask of the server. Each limit is checked before any work (tokenizing,
admission) and refused with a 400 (413 for the body) that names the limit and its flag, so that
no request can make the server build a 30 MB response or stall every stream for seconds."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.server.error_body import APIError, error_response


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_logprobs: int = 20  # logprobs, top_logprobs, prompt_logprobs (vLLM's default: 20)
    max_n: int = 128  # samples per request (OpenAI's limit)
    max_prompts: int = 256  # prompts in one /v1/completions request
    max_samples: int = 1024  # n x prompts in one request
    max_stop: int = 64  # stop strings, and separately stop_token_ids
    max_stop_chars: int = 1024  # characters in one stop string
    # logit_bias entries: each is added on every step of every sample, so a bias over the whole
    # vocabulary with n = 128 would slow every step of every request.
    max_logit_bias: int = 1024
    max_request_bytes: int = 16 << 20  # the HTTP body


def check_sampling(body, limits: RequestLimits) -> None:
    """The limits every generation request shares (n, stop lists, logprobs)."""
    if body.n > limits.max_n:
        raise _over("n", body.n, limits.max_n, "--max-n")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > limits.max_stop:
        raise _over("stop", f"{len(stop)} strings", limits.max_stop, None)
    stop_ids = getattr(body, "stop_token_ids", None) or []
    if len(stop_ids) > limits.max_stop:
        raise _over("stop_token_ids", f"{len(stop_ids)} ids", limits.max_stop, None)
    for s in stop:
        if len(s) > limits.max_stop_chars:
            raise _over("stop", f"a string of {len(s)} characters", limits.max_stop_chars, None)
    bias = getattr(body, "logit_bias", None) or {}
    if len(bias) > limits.max_logit_bias:
        raise _over("logit_bias", f"{len(bias)} tokens", limits.max_logit_bias, None)
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        value = getattr(body, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > limits.max_logprobs:
            raise _over(name, value, limits.max_logprobs, "--max-logprobs")


def check_prompt_count(count: int, limits: RequestLimits) -> None:
    if count > limits.max_prompts:
        raise _over("prompt", f"{count} prompts", limits.max_prompts, None)


def check_samples(count: int, limits: RequestLimits) -> None:
    if count > limits.max_samples:
        raise _over("n", f"n x prompts = {count} samples", limits.max_samples, None)


def _over(field: str, value: object, limit: int, flag: str | None) -> APIError:
    where = f" (set by {flag})" if flag else ""
    return APIError(
        400,
        f"{field}: {value} is over this server's limit of {limit}{where}",
        param=field,
        code="limit_exceeded",
    )


class BodySizeLimit:
    """ASGI middleware: a body over max_bytes gets a 413 before the app sees any of it, whether
    Content-Length announces it or a chunked upload only reaches it. The body is buffered (at
    most max_bytes) and replayed; later receives, such as the client's disconnect, pass through."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, path_limits: dict[str, int] | None = None
    ) -> None:
        self.app, self.max_bytes = app, max_bytes
        # Routes with their own limit (a batch input file is larger than any one request).
        self.path_limits = path_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope["path"], self.max_bytes)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await self._refuse(scope, receive, send, limit)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            size += len(message.get("body", b""))
            if size > limit:
                await self._refuse(scope, receive, send, limit)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks)}]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        flag = "--max-request-bytes" if limit == self.max_bytes else "--batch-max-file-bytes"
        response = error_response(
            413,
            f"the request body is over this server's limit of {limit} bytes (set by {flag})",
            param="body",
            code="request_too_large",
        )
        response.headers["Connection"] = "close"
        await response(scope, receive, send)
