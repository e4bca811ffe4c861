"""/v1/batches: create (from an uploaded file, for one endpoint, within a completion window),
list, retrieve, cancel; objects in OpenAI's shape, with request_counts and, once finished, the
output and error file ids. The work itself is the runner's (batch_runner.py)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from engine.server.batch_config import BATCH_ENDPOINTS, window_seconds
from engine.server.batch_runner import BatchRunner
from engine.server.batch_schema import BatchRow
from engine.server.batch_store import BatchStore, as_utc
from engine.server.errors import APIError
from engine.server.serving_files import _limit, _page

_TIMES = (
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str
    completion_window: str = "24h"
    # OpenAI's bounds: 16 pairs, keys up to 64 characters, values up to 512.
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


def batch_object(row: BatchRow) -> dict:
    times = {}
    for name in _TIMES:
        value = as_utc(getattr(row, name))
        times[name] = int(value.timestamp()) if value is not None else None
    return {
        "id": row.id,
        "object": "batch",
        "endpoint": row.endpoint,
        "errors": {"object": "list", "data": row.errors} if row.errors else None,
        "input_file_id": row.input_file_id,
        "completion_window": row.completion_window,
        "status": row.status,
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        **times,
        "request_counts": {"total": row.total, "completed": row.completed, "failed": row.failed},
        "metadata": row.batch_metadata,
    }


class OpenAIServingBatches:
    def __init__(self, store: BatchStore, runner: BatchRunner) -> None:
        self.store, self.runner = store, runner

    async def create(self, body: BatchCreateRequest) -> dict:
        if body.endpoint not in BATCH_ENDPOINTS:
            raise APIError(
                400,
                f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got {body.endpoint!r}",
                param="endpoint",
            )
        window_s = window_seconds(body.completion_window)
        if window_s is None:
            raise APIError(
                400,
                f"completion_window must be '24h' (or a whole number of s, m or h up to 168h), "
                f"got {body.completion_window!r}",
                param="completion_window",
            )
        for key, value in (body.metadata or {}).items():
            if len(key) > 64 or len(value) > 512:
                raise APIError(
                    400, "metadata: keys hold up to 64 characters, values 512", param="metadata"
                )
        file = await asyncio.to_thread(self.store.file, body.input_file_id)
        if file is None or file.purpose != "batch":
            what = "no file" if file is None else f"a {file.purpose} file, not a batch input,"
            raise APIError(
                400,
                f"input_file_id: {what} with id {body.input_file_id!r}; upload the requests with "
                "purpose 'batch' first",
                param="input_file_id",
            )
        row = await asyncio.to_thread(
            self.store.create_batch,
            body.input_file_id,
            body.endpoint,
            body.completion_window,
            window_s,
            body.metadata,
        )
        self.runner.wake()
        return batch_object(row)

    async def list(self, limit: int, after: str | None) -> dict:
        limit = _limit(limit)
        rows = await asyncio.to_thread(self.store.batches, limit, after)
        return _page([batch_object(r) for r in rows], limit)

    async def retrieve(self, batch_id: str) -> dict:
        return batch_object(await self._row(batch_id))

    async def cancel(self, batch_id: str) -> dict:
        row = await self._row(batch_id)
        if not await self.runner.cancel(batch_id):
            raise APIError(
                409,
                f"batch {batch_id} has already ended ({row.status}); only a validating, "
                "in_progress or finalizing batch can be cancelled",
                code="batch_not_cancellable",
            )
        return batch_object(await self._row(batch_id))

    async def _row(self, batch_id: str) -> BatchRow:
        row = await asyncio.to_thread(self.store.batch, batch_id)
        if row is None:
            raise APIError(
                404, f"no batch with id {batch_id!r}", param="batch_id", code="not_found"
            )
        return row


def add_batch_routes(app: FastAPI, batches: OpenAIServingBatches) -> None:
    @app.post("/v1/batches")
    async def create_batch(body: BatchCreateRequest) -> dict:
        return await batches.create(body)

    @app.get("/v1/batches")
    async def list_batches(limit: int = 20, after: str | None = None) -> dict:
        return await batches.list(limit, after)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str) -> dict:
        return await batches.retrieve(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> dict:
        return await batches.cancel(batch_id)
