"""A real server for tests: a tiny random model that speaks through the default model's
tokenizer (text in, text out), served by uvicorn on a free 127.0.0.1 port in a thread."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.model_fetch import fetch_default_model
from engine.server.app import create_app
from engine.server.limits import RequestLimits
from engine.server.serve import JsonErrorsH11Protocol
from tests.engine.tiny_models import build_tiny_model


def build_chat_model(path: Path, **overrides: object) -> Path:
    """A tiny llama with the default model's 49152-token vocabulary, tokenizer and template."""
    folder = build_tiny_model(
        "llama", path, vocab_size=49152, eos_token_id=2, bos_token_id=1, **overrides
    )
    default = fetch_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default / name).exists():
            shutil.copy(default / name, folder / name)
    return folder


@contextmanager
def live_server(
    model_dir: Path,
    served_name: str,
    *,
    api_key: str | None = None,
    max_waiting_requests: int | None = None,
    limits: RequestLimits | None = None,
    app_options: dict | None = None,
    **engine_options: object,
) -> Iterator[tuple[str, AsyncEngine]]:
    """Yields (http://127.0.0.1:PORT, engine) while the server runs. app_options: create_app's
    keyword options (cors, tool_call_parser)."""
    engine = AsyncEngine(EngineConfig(model=str(model_dir), **engine_options))
    app = create_app(
        engine, served_name, api_key, max_waiting_requests, limits, **(app_options or {})
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=JsonErrorsH11Protocol))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown()
