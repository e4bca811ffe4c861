"""The API key: where it comes from (never argv alone, which every local user sees in `ps`), and
the check on /v1/ routes and the tokenizer endpoints (bearer scheme case-insensitive, the key
compared in constant time)."""

from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from engine.server.error_body import error_response

API_KEY_ENV = "NIGHTSHIFT_API_KEY"
# Routes outside /v1/ that use the model (its tokenizer), so need the key as vLLM asks for it.
_GUARDED_ROOT_PATHS = frozenset({"/tokenize", "/detokenize"})


class APIKeyError(ValueError):
    """No usable key where one was asked for (an empty or unreadable key file)."""


def resolve_api_key(arg: str | None, key_file: Path | None) -> str | None:
    """The key from --api-key, else --api-key-file, else $NIGHTSHIFT_API_KEY; None: no key."""
    if arg and key_file:
        raise APIKeyError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            lines = key_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise APIKeyError(f"--api-key-file {key_file}: cannot read it ({e})") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise APIKeyError(f"--api-key-file {key_file}: its first line is empty")
        return key
    return arg or os.environ.get(API_KEY_ENV) or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class APIKeyCheck:
    """ASGI middleware: /v1/ routes, /tokenize and /detokenize need `Authorization: Bearer
    <key>`; health, ping, metrics and version stay open for probes and scrapers, as in vLLM."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _guarded(scope["path"]) and not self._ok(scope):
            response = error_response(
                401, "invalid or missing API key", "authentication_error", code="invalid_api_key"
            )
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _ok(self, scope: Scope) -> bool:
        header = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)


def _guarded(path: str) -> bool:
    return path.startswith("/v1/") or path.rstrip("/") in _GUARDED_ROOT_PATHS
