"""Batch API records in SQL (SQLite by default, PostgreSQL in production; the schema comes from
the project's Alembic history) and file bodies on disk under the batch home. Every method is
synchronous and short: the server calls them off the event loop (asyncio.to_thread)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import Engine, and_, or_, select, update
from sqlalchemy.orm import sessionmaker

from engine.server.batch_schema import BatchFileRow, BatchRow

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("failed", "completed", "expired", "cancelled")


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite hands timezone-aware columns back naive; they were stored in UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


class BatchStore:
    def __init__(self, engine: Engine, home: Path) -> None:
        self.engine = engine
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self._session = sessionmaker(engine, expire_on_commit=False)

    # -- files ------------------------------------------------------------------------------

    def create_file(self, purpose: str, filename: str, data: bytes) -> BatchFileRow:
        file_id = f"file-{uuid.uuid4().hex}"
        path = self.home / file_id
        tmp = path.with_suffix(".part")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # a record never names a half-written body
        return self._add_file(file_id, purpose, filename, len(data), file_id)

    def adopt_file(self, file_id: str, purpose: str, filename: str, path: Path) -> BatchFileRow:
        """A record for a body already under the home (a finished batch's journal). The id is
        the caller's, so finishing twice (a crash in between) leaves one record."""
        if (row := self.file(file_id)) is not None:
            return row
        relative = str(path.relative_to(self.home))
        return self._add_file(file_id, purpose, filename, path.stat().st_size, relative)

    def _add_file(
        self, file_id: str, purpose: str, filename: str, size: int, path: str
    ) -> BatchFileRow:
        row = BatchFileRow(
            id=file_id, purpose=purpose, filename=filename, bytes=size, path=path,
            created_at=utcnow(),
        )  # fmt: skip
        with self._session.begin() as s:
            s.add(row)
        return row

    def file(self, file_id: str) -> BatchFileRow | None:
        with self._session() as s:
            return s.get(BatchFileRow, file_id)

    def files(
        self, purpose: str | None, limit: int, after: str | None, oldest_first: bool = False
    ) -> list[BatchFileRow]:
        """Newest first, as OpenAI lists them by default (its order=asc: oldest first); `after`
        is the last id of the previous page."""
        query = select(BatchFileRow)
        if purpose is not None:
            query = query.where(BatchFileRow.purpose == purpose)
        return _page(self, query, limit, after, BatchFileRow, oldest_first)

    def file_path(self, row: BatchFileRow) -> Path:
        return self.home / row.path

    def delete_file(self, file_id: str) -> bool:
        with self._session.begin() as s:
            row = s.get(BatchFileRow, file_id)
            if row is None:
                return False
            s.delete(row)
        self.file_path(row).unlink(missing_ok=True)
        return True

    def batches_using(self, file_id: str) -> list[str]:
        """Active batches that read this file."""
        with self._session() as s:
            return list(
                s.scalars(
                    select(BatchRow.id).where(
                        BatchRow.input_file_id == file_id, BatchRow.status.in_(ACTIVE)
                    )
                )
            )

    # -- batches ----------------------------------------------------------------------------

    def create_batch(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        window_s: int,
        metadata: dict | None,
    ) -> BatchRow:
        now = utcnow()
        row = BatchRow(
            id=f"batch_{uuid.uuid4().hex}",
            input_file_id=input_file_id,
            endpoint=endpoint,
            completion_window=completion_window,
            status="validating",
            batch_metadata=metadata,
            total=0,
            completed=0,
            failed=0,
            created_at=now,
            expires_at=now + timedelta(seconds=window_s),
        )
        with self._session.begin() as s:
            s.add(row)
        return row

    def batch(self, batch_id: str) -> BatchRow | None:
        with self._session() as s:
            return s.get(BatchRow, batch_id)

    def batches(self, limit: int, after: str | None) -> list[BatchRow]:
        return _page(self, select(BatchRow), limit, after, BatchRow)

    def active_batches(self) -> list[BatchRow]:
        with self._session() as s:
            query = select(BatchRow).where(BatchRow.status.in_(ACTIVE))
            return list(s.scalars(query.order_by(BatchRow.created_at)))

    def update_batch(self, batch_id: str, only_from: Iterable[str] = (), **values) -> bool:
        """Set columns; with `only_from`, only while the status is one of those (a cancel that
        lands while the batch finishes must not be overwritten, nor overwrite a final status)."""
        statement = update(BatchRow).where(BatchRow.id == batch_id)
        allowed = tuple(only_from)
        if allowed:
            statement = statement.where(BatchRow.status.in_(allowed))
        with self._session.begin() as s:
            return s.execute(statement.values(**values)).rowcount > 0

    def count_line(self, batch_id: str, ok: bool) -> None:
        column = BatchRow.completed if ok else BatchRow.failed
        with self._session.begin() as s:
            s.execute(update(BatchRow).where(BatchRow.id == batch_id).values({column: column + 1}))

    def journal(self, batch_id: str, kind: str) -> Path:
        """Where a batch's finished lines accumulate: kind "output" (2xx) or "errors"."""
        return self.home / f"{batch_id}.{kind}.jsonl"


def _page(
    store: BatchStore, query, limit: int, after: str | None, row_type, oldest_first: bool = False
) -> list:
    """A page newest first (or oldest first), after the row `after` (keyset: created_at, then
    id, the one order reversed); one more row than asked, for the caller's has_more. An unknown
    `after` gives an empty page."""
    created, ident = row_type.created_at, row_type.id
    if oldest_first:
        query = query.order_by(created.asc(), ident.desc())
    else:
        query = query.order_by(created.desc(), ident.asc())
    with store._session() as s:
        if after is not None:
            anchor = s.get(row_type, after)
            if anchor is None:
                return []
            if oldest_first:
                beyond = or_(
                    created > anchor.created_at,
                    and_(created == anchor.created_at, ident < anchor.id),
                )
            else:
                beyond = or_(
                    created < anchor.created_at,
                    and_(created == anchor.created_at, ident > anchor.id),
                )
            query = query.where(beyond)
        return list(s.scalars(query.limit(limit + 1)))
