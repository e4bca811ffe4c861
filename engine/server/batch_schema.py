"""Tables of the Batch API (/v1/files, /v1/batches): a file's record (its body lives on disk,
under the batch home), a batch's record with its status, times and request counts.

Their own declarative base, beside the digest's: the server's database holds only these, though
one Alembic history (migrations/versions/0003) creates them, so `nightshift db upgrade` and the
server's own upgrade at start give every database the same schema."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, DateTime, Integer, MetaData, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class BatchBase(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


UtcDateTime = DateTime(timezone=True)


class BatchFileRow(BatchBase):
    __tablename__ = "batch_files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # file-...
    purpose: Mapped[str] = mapped_column(String(32))  # batch | batch_output
    filename: Mapped[str] = mapped_column(String(500))
    bytes: Mapped[int] = mapped_column(Integer)
    # Relative to the batch home, so that the home can move with its database.
    path: Mapped[str] = mapped_column(String(500))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)


class BatchRow(BatchBase):
    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # batch_...
    input_file_id: Mapped[str] = mapped_column(String(64))
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    # validating | failed | in_progress | finalizing | completed | expired | cancelling |
    # cancelled (OpenAI's statuses)
    status: Mapped[str] = mapped_column(String(16), index=True)
    batch_metadata: Mapped[dict | None] = mapped_column(JSON)
    errors: Mapped[list | None] = mapped_column(JSON)  # validation errors, line-numbered
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime)
    in_progress_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    finalizing_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    completed_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    failed_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    expired_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    cancelling_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    cancelled_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    error_text: Mapped[str | None] = mapped_column(Text)  # why a batch failed after validating
