"""`nightshift serve`: build the engine, then run the API with uvicorn on loopback by default."""

from __future__ import annotations

import logging

import uvicorn

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.server.app import create_app

logger = logging.getLogger(__name__)


def serve(
    config: EngineConfig,
    host: str,
    port: int,
    served_model_name: str | None,
    api_key: str | None,
    max_waiting_requests: int | None = None,
) -> None:
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
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        engine.shutdown()
