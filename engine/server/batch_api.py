"""The Batch API put together on an app: the store opened (and migrated to head) at start, the
file and batch routes, the runner that the app's lifespan starts and stops, its metrics."""

from __future__ import annotations

from fastapi import FastAPI

from digest.store import migrate
from digest.store.database import open_database
from engine.server.batch_config import BatchConfig
from engine.server.batch_lines import app_client
from engine.server.batch_metrics import BatchMetrics
from engine.server.batch_runner import BatchRunner
from engine.server.batch_store import BatchStore
from engine.server.metrics import ServerMetrics
from engine.server.serving_batches import OpenAIServingBatches, add_batch_routes
from engine.server.serving_files import OpenAIServingFiles, add_file_routes


def check_batch_database(config: BatchConfig) -> None:
    """Connect once, before the model loads: a wrong URL fails the start at once (StoreError)."""
    open_database(config.url()).dispose()


def install_batch_api(
    app: FastAPI,
    config: BatchConfig,
    served_model_name: str,
    api_key: str | None,
    metrics: ServerMetrics,
) -> BatchRunner:
    """Routes on `app`; the returned runner is started and stopped by the app's lifespan.
    A database that cannot be opened fails here, at start, in one line (StoreError)."""
    # The same opening and migration code as the digest's store (one schema history).
    database = open_database(config.url())
    migrate.upgrade(database)
    store = BatchStore(database, config.files_dir())
    runner = BatchRunner(store, lambda: app_client(app, api_key), config, served_model_name)
    add_file_routes(app, OpenAIServingFiles(store, config))
    add_batch_routes(app, OpenAIServingBatches(store, runner))
    BatchMetrics(runner, metrics.registry)
    return runner
