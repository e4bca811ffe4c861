"""`nightshift serve`: build the engine, then run the API with uvicorn on loopback by default."""

from __future__ import annotations

import contextlib
import logging
import signal

import uvicorn

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.server.app import create_app

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn's server, except that a graceful stop ends the process normally (exit 0): uvicorn
    re-raises the captured SIGTERM after shutting down, which a supervisor reads as a crash."""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def serve(
    config: EngineConfig,
    host: str,
    port: int,
    served_model_name: str | None,
    api_key: str | None,
    max_waiting_requests: int | None = None,
    grace_period: float = 30.0,
) -> None:
    """Runs until SIGTERM/SIGINT: uvicorn then stops accepting and lets in-flight requests finish
    for up to grace_period seconds; whatever still runs after that is aborted, and we exit 0."""
    engine = AsyncEngine(config)
    core = engine.engine.core
    name = served_model_name or config.model
    logger.info(
        "serving %s as %r on http://%s:%d: %d KV blocks x %d tokens; the largest request that "
        "fits has %d tokens",
        config.model,
        name,
        host,
        port,
        core.num_blocks,
        config.block_size,
        core.max_request_tokens,
    )
    app = create_app(engine, name, api_key, max_waiting_requests)
    try:
        server_config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace_period
        )
        _Server(server_config).run()
    finally:
        engine.shutdown()
