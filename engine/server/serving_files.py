"""/v1/files: upload (multipart, purpose "batch"), list, retrieve, content, delete. Bodies are
stored as uploaded; they are checked line by line when a batch uses them (batch_validate.py)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse
from starlette.datastructures import UploadFile

from engine.server.batch_config import BatchConfig
from engine.server.batch_schema import BatchFileRow
from engine.server.batch_store import BatchStore, as_utc
from engine.server.errors import APIError

PURPOSES = ("batch",)  # what may be uploaded; "batch_output" files are the server's own
MAX_PAGE = 10_000


def file_object(row: BatchFileRow) -> dict:
    created = as_utc(row.created_at)
    assert created is not None
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": int(created.timestamp()),
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "status_details": None,
    }


class OpenAIServingFiles:
    def __init__(self, store: BatchStore, config: BatchConfig) -> None:
        self.store, self.config = store, config

    async def create(self, request: Request) -> dict:
        try:
            form = await request.form(max_files=1, max_fields=8)
        except Exception as e:  # noqa: BLE001 - starlette's parser raises several kinds
            raise APIError(400, f"the body is not a multipart form with a file: {e}") from None
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose not in PURPOSES:
            raise APIError(400, f"purpose must be 'batch', got {purpose!r}", param="purpose")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "file: the form has no file part named 'file'", param="file")
        data = await upload.read(self.config.max_file_bytes + 1)
        if len(data) > self.config.max_file_bytes:
            raise APIError(
                413,
                f"file: over this server's limit of {self.config.max_file_bytes} bytes per file "
                "(set by --batch-max-file-bytes)",
                param="file",
            )
        name = (upload.filename or "upload.jsonl")[:500]
        row = await asyncio.to_thread(self.store.create_file, purpose, name, data)
        return file_object(row)

    async def list(
        self, purpose: str | None, limit: int, after: str | None, order: str = "desc"
    ) -> dict:
        limit = _limit(limit)
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
        oldest_first = order == "asc"
        rows = await asyncio.to_thread(self.store.files, purpose, limit, after, oldest_first)
        return _page([file_object(r) for r in rows], limit)

    async def retrieve(self, file_id: str) -> dict:
        return file_object(await self._row(file_id))

    async def content(self, file_id: str) -> FileResponse:
        row = await self._row(file_id)
        path = self.store.file_path(row)
        if not path.exists():
            raise APIError(404, f"file {file_id}: its content is gone from the server's disk")
        return FileResponse(path, media_type="application/octet-stream", filename=row.filename)

    async def delete(self, file_id: str) -> dict:
        await self._row(file_id)
        if users := await asyncio.to_thread(self.store.batches_using, file_id):
            raise APIError(
                409,
                f"file {file_id} is the input of batch {users[0]}, which is still running; "
                "cancel it first",
                code="file_in_use",
            )
        await asyncio.to_thread(self.store.delete_file, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def _row(self, file_id: str) -> BatchFileRow:
        row = await asyncio.to_thread(self.store.file, file_id)
        if row is None:
            raise APIError(404, f"no file with id {file_id!r}", param="file_id", code="not_found")
        return row


def _limit(limit: int) -> int:
    if not 1 <= limit <= MAX_PAGE:
        raise APIError(400, f"limit must be from 1 to {MAX_PAGE}, got {limit}", param="limit")
    return limit


def _page(data: list[dict], limit: int) -> dict:
    shown = data[:limit]
    return {
        "object": "list",
        "data": shown,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
        "has_more": len(data) > limit,
    }


def add_file_routes(app: FastAPI, files: OpenAIServingFiles) -> None:
    @app.post("/v1/files")
    async def create_file(request: Request) -> dict:
        return await files.create(request)

    @app.get("/v1/files")
    async def list_files(
        purpose: str | None = None,
        limit: int = 10_000,
        after: str | None = None,
        order: str = "desc",
    ):
        return await files.list(purpose, limit, after, order)

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str) -> dict:
        return await files.retrieve(file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str):
        return await files.content(file_id)

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> dict:
        return await files.delete(file_id)
