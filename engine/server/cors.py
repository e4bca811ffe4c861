"""Cross-origin requests (a browser page on another origin calling the API), with vLLM's flags
and defaults: every origin, method and header allowed, no credentials. The middleware sits
outside the API-key check, so a browser's OPTIONS preflight (which never carries the key) is
answered, and error responses carry the headers the browser needs to show them."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware


@dataclass(frozen=True, slots=True)
class CorsConfig:
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


def add_cors(app: FastAPI, config: CorsConfig) -> None:
    """Call after every other middleware: the last one added runs first."""
    app.add_middleware(
        CORSMiddleware,
        allow_origins=config.allowed_origins,
        allow_methods=config.allowed_methods,
        allow_headers=config.allowed_headers,
        allow_credentials=config.allow_credentials,
    )
