"""OpenAI's error body, {"error": {message, type, param, code}}, and the exception that carries
one: the part of the server's errors that needs no engine, so that the router (engine/router/),
the API-key check and the body-size limit answer in the same shape without importing torch."""

from __future__ import annotations

from starlette.responses import JSONResponse

# OpenAI's error types by status, for errors that carry none of their own.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",  # as OpenAI answers an unknown URL or model
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "internal_server_error",
    502: "internal_server_error",
    503: "service_unavailable",
    504: "timeout",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ERROR_TYPES.get(status, "invalid_request_error")


def error_body(
    message: str, kind: str, param: str | None = None, code: str | int | None = None
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    kind: str | None = None,
    param: str | None = None,
    code: str | int | None = None,
) -> JSONResponse:
    body = error_body(
        message, kind or ERROR_TYPES.get(status, "invalid_request_error"), param, code
    )
    response = JSONResponse(body, status_code=status)
    if status == 429:
        response.headers["Retry-After"] = "1"
    return response
