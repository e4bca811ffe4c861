"""Tables of the digest store. Migrations in `migrations/versions/` create exactly these.

Unique constraints carry idempotency: a paper is one row whatever its version; a date lists a paper
once; a paper has at most one summary and one review per (model, prompt version, input basis), so a
rerun finds the work already done instead of calling the model again."""

from __future__ import annotations

from datetime import date, datetime

from sqlalchemy import (
    JSON,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, declared_attr, mapped_column

# Stable constraint names, so that migrations can address them on every database.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


UtcDateTime = DateTime(timezone=True)


class PaperRow(Base):
    __tablename__ = "papers"

    arxiv_id: Mapped[str] = mapped_column(String(64), primary_key=True)  # without version
    version: Mapped[int] = mapped_column(Integer)
    title: Mapped[str] = mapped_column(Text)
    abstract: Mapped[str] = mapped_column(Text)
    authors: Mapped[list] = mapped_column(JSON)
    categories: Mapped[list] = mapped_column(JSON)
    published: Mapped[datetime | None] = mapped_column(UtcDateTime)
    updated: Mapped[datetime | None] = mapped_column(UtcDateTime)
    first_seen_at: Mapped[datetime] = mapped_column(UtcDateTime)
    last_seen_at: Mapped[datetime] = mapped_column(UtcDateTime)


class RunRow(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    digest_date: Mapped[date] = mapped_column(Date, index=True)
    # running | succeeded | partial | failed | interrupted
    status: Mapped[str] = mapped_column(String(16))
    params: Mapped[dict] = mapped_column(JSON)
    model: Mapped[str] = mapped_column(String(200))
    endpoint: Mapped[str] = mapped_column(String(500))
    prompt_version: Mapped[str] = mapped_column(String(64))
    papers_total: Mapped[int] = mapped_column(Integer, default=0)
    papers_done: Mapped[int] = mapped_column(Integer, default=0)
    papers_failed: Mapped[int] = mapped_column(Integer, default=0)
    calls: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    started_at: Mapped[datetime] = mapped_column(UtcDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    error: Mapped[str | None] = mapped_column(Text)
    # The fingerprint of the date's digest as this run left it (None: the run ended by an
    # error); the digest's time is when the fingerprint last changed (`load_digest`).
    content_hash: Mapped[str | None] = mapped_column(String(64))
    # The Batch API batch this run submitted (`digest run --via batch`): a run that resumes
    # after a crash polls it rather than submitting the night again.
    batch_id: Mapped[str | None] = mapped_column(String(64))


class DigestItemRow(Base):
    """A paper listed in the digest of a date, with its processing status."""

    __tablename__ = "digest_items"
    __table_args__ = (UniqueConstraint("digest_date", "paper_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    digest_date: Mapped[date] = mapped_column(Date, index=True)
    # Indexed for search (a hit's digests) and the nightly "listed elsewhere" look-up.
    paper_id: Mapped[str] = mapped_column(ForeignKey("papers.arxiv_id"), index=True)
    position: Mapped[int] = mapped_column(Integer)  # order in the source (ranked: best first)
    # pending | done | failed | below_cut (ranked below --max-papers: listed, never summarised)
    status: Mapped[str] = mapped_column(String(16))
    input_basis: Mapped[str] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text)
    last_run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id"))
    # With a reader profile (digest/ranking.py): the paper's score when it was listed, and why it
    # is "for you" (None or empty: it is not). Without a profile both stay None.
    rank_score: Mapped[float | None] = mapped_column(Float)
    for_you: Mapped[list | None] = mapped_column(JSON)


class FullTextRow(Base):
    """The plain text a fulltext prompt was built from, kept so that a resumed run sends the same
    prompt as the run it continues (and arXiv is not fetched twice)."""

    __tablename__ = "fulltexts"

    paper_id: Mapped[str] = mapped_column(ForeignKey("papers.arxiv_id"), primary_key=True)
    paper_version: Mapped[int] = mapped_column(Integer, primary_key=True)
    text: Mapped[str | None] = mapped_column(Text)  # None: not available, abstract used
    truncated: Mapped[bool] = mapped_column(default=False)
    original_chars: Mapped[int] = mapped_column(Integer, default=0)
    fetched_at: Mapped[datetime] = mapped_column(UtcDateTime)


class _ResultColumns:
    """What identifies a summary or a review: the paper, and the model, prompt version and input
    basis that produced it (unique together: the rerun's "already done")."""

    @declared_attr.directive
    def __table_args__(cls) -> tuple:  # noqa: N805 - a class-level directive
        # A new constraint per table: one object cannot belong to two tables.
        return (UniqueConstraint("paper_id", "model", "prompt_version", "input_basis"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    paper_id: Mapped[str] = mapped_column(ForeignKey("papers.arxiv_id"))
    paper_version: Mapped[int] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(200))
    prompt_version: Mapped[str] = mapped_column(String(64))
    input_basis: Mapped[str] = mapped_column(String(16))


class SummaryRow(_ResultColumns, Base):
    __tablename__ = "summaries"

    text: Mapped[str] = mapped_column(Text)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)


class ReviewRow(_ResultColumns, Base):
    __tablename__ = "reviews"

    parse_status: Mapped[str] = mapped_column(String(16))  # ok | repaired | failed
    review: Mapped[dict | None] = mapped_column(JSON)  # the validated review
    raw_text: Mapped[str] = mapped_column(Text)  # the reply as received
    parse_error: Mapped[str | None] = mapped_column(Text)
    overall: Mapped[int | None] = mapped_column(Integer)
    decision: Mapped[str | None] = mapped_column(String(16))
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)


class ModelCallRow(Base):
    """One model call as the workload tools replay it: real token lengths and timings."""

    __tablename__ = "model_calls"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    paper_id: Mapped[str] = mapped_column(ForeignKey("papers.arxiv_id"))
    kind: Mapped[str] = mapped_column(String(16))  # summary | review
    model: Mapped[str] = mapped_column(String(200))
    endpoint: Mapped[str] = mapped_column(String(500))
    prompt_version: Mapped[str] = mapped_column(String(64))
    input_basis: Mapped[str] = mapped_column(String(16))
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    max_tokens: Mapped[int] = mapped_column(Integer)
    ttft_s: Mapped[float | None] = mapped_column(Float)
    latency_s: Mapped[float | None] = mapped_column(Float)
    started_at: Mapped[datetime] = mapped_column(UtcDateTime)
    status: Mapped[str] = mapped_column(String(16))  # ok | error
    error: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, default=1)
    finish_reason: Mapped[str | None] = mapped_column(String(32))


class SourceWatermarkRow(Base):
    """How far a nightly source has been read: the newest submission time among the papers a
    run took from it, per source and category set. The next run queries from here, less an
    overlap, so that papers announced late are still found (`digest/sources/arxiv_new.py`)."""

    __tablename__ = "source_watermarks"

    source_key: Mapped[str] = mapped_column(String(500), primary_key=True)  # "arxiv:cs.CL,cs.LG"
    watermark: Mapped[datetime] = mapped_column(UtcDateTime)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id"))
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)


class DeliveryRow(Base):
    """One attempt to send a date's digest to one target (digest/delivery/): a run or `digest
    deliver` skips a target that already received the digest as it is now (same fingerprint),
    so a rerun does not mail readers twice, and a failed target is retried."""

    __tablename__ = "deliveries"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    digest_date: Mapped[date] = mapped_column(Date, index=True)
    channel: Mapped[str] = mapped_column(String(16))  # email | webhook
    # Who: the recipients, or the webhook's host and a hash of its URL (the URL is a secret).
    target: Mapped[str] = mapped_column(String(500))
    content_hash: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))  # sent | failed
    error: Mapped[str | None] = mapped_column(Text)
    attempted_at: Mapped[datetime] = mapped_column(UtcDateTime)


class JobLockRow(Base):
    """A lease: who runs the job now. Portable across SQLite and PostgreSQL (no advisory locks)."""

    __tablename__ = "job_locks"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(200))
    acquired_at: Mapped[datetime] = mapped_column(UtcDateTime)
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime)
