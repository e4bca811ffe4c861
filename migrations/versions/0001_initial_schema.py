"""Initial schema: papers, runs, digest items, full texts, summaries, reviews, calls, locks.

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-29 17:41:59.310279
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_locks",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("holder", sa.String(length=200), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_job_locks")),
    )
    op.create_table(
        "papers",
        sa.Column("arxiv_id", sa.String(length=64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("title", sa.Text(), nullable=False),
        sa.Column("abstract", sa.Text(), nullable=False),
        sa.Column("authors", sa.JSON(), nullable=False),
        sa.Column("categories", sa.JSON(), nullable=False),
        sa.Column("published", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated", sa.DateTime(timezone=True), nullable=True),
        sa.Column("first_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("arxiv_id", name=op.f("pk_papers")),
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("digest_date", sa.Date(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("endpoint", sa.String(length=500), nullable=False),
        sa.Column("prompt_version", sa.String(length=64), nullable=False),
        sa.Column("papers_total", sa.Integer(), nullable=False),
        sa.Column("papers_done", sa.Integer(), nullable=False),
        sa.Column("papers_failed", sa.Integer(), nullable=False),
        sa.Column("calls", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_runs_digest_date"), ["digest_date"], unique=False)

    op.create_table(
        "digest_items",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("digest_date", sa.Date(), nullable=False),
        sa.Column("paper_id", sa.String(length=64), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("input_basis", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("last_run_id", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["last_run_id"], ["runs.id"], name=op.f("fk_digest_items_last_run_id_runs")
        ),
        sa.ForeignKeyConstraint(
            ["paper_id"], ["papers.arxiv_id"], name=op.f("fk_digest_items_paper_id_papers")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_digest_items")),
        sa.UniqueConstraint("digest_date", "paper_id", name=op.f("uq_digest_items_digest_date")),
    )
    with op.batch_alter_table("digest_items", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_digest_items_digest_date"), ["digest_date"], unique=False
        )

    op.create_table(
        "fulltexts",
        sa.Column("paper_id", sa.String(length=64), nullable=False),
        sa.Column("paper_version", sa.Integer(), nullable=False),
        sa.Column("text", sa.Text(), nullable=True),
        sa.Column("truncated", sa.Boolean(), nullable=False),
        sa.Column("original_chars", sa.Integer(), nullable=False),
        sa.Column("fetched_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["paper_id"], ["papers.arxiv_id"], name=op.f("fk_fulltexts_paper_id_papers")
        ),
        sa.PrimaryKeyConstraint("paper_id", "paper_version", name=op.f("pk_fulltexts")),
    )
    op.create_table(
        "model_calls",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("paper_id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("endpoint", sa.String(length=500), nullable=False),
        sa.Column("prompt_version", sa.String(length=64), nullable=False),
        sa.Column("input_basis", sa.String(length=16), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("cached_tokens", sa.Integer(), nullable=True),
        sa.Column("max_tokens", sa.Integer(), nullable=False),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("latency_s", sa.Float(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(length=32), nullable=True),
        sa.ForeignKeyConstraint(
            ["paper_id"], ["papers.arxiv_id"], name=op.f("fk_model_calls_paper_id_papers")
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_model_calls_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_calls")),
    )
    with op.batch_alter_table("model_calls", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_model_calls_run_id"), ["run_id"], unique=False)

    op.create_table(
        "reviews",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("paper_id", sa.String(length=64), nullable=False),
        sa.Column("paper_version", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("prompt_version", sa.String(length=64), nullable=False),
        sa.Column("input_basis", sa.String(length=16), nullable=False),
        sa.Column("parse_status", sa.String(length=16), nullable=False),
        sa.Column("review", sa.JSON(), nullable=True),
        sa.Column("raw_text", sa.Text(), nullable=False),
        sa.Column("parse_error", sa.Text(), nullable=True),
        sa.Column("overall", sa.Integer(), nullable=True),
        sa.Column("decision", sa.String(length=16), nullable=True),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["paper_id"], ["papers.arxiv_id"], name=op.f("fk_reviews_paper_id_papers")
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_reviews_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reviews")),
        sa.UniqueConstraint(
            "paper_id", "model", "prompt_version", "input_basis", name=op.f("uq_reviews_paper_id")
        ),
    )
    op.create_table(
        "summaries",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("paper_id", sa.String(length=64), nullable=False),
        sa.Column("paper_version", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("prompt_version", sa.String(length=64), nullable=False),
        sa.Column("input_basis", sa.String(length=16), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["paper_id"], ["papers.arxiv_id"], name=op.f("fk_summaries_paper_id_papers")
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_summaries_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_summaries")),
        sa.UniqueConstraint(
            "paper_id", "model", "prompt_version", "input_basis", name=op.f("uq_summaries_paper_id")
        ),
    )


def downgrade() -> None:
    op.drop_table("summaries")
    op.drop_table("reviews")
    with op.batch_alter_table("model_calls", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_model_calls_run_id"))

    op.drop_table("model_calls")
    op.drop_table("fulltexts")
    with op.batch_alter_table("digest_items", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_digest_items_digest_date"))

    op.drop_table("digest_items")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_runs_digest_date"))

    op.drop_table("runs")
    op.drop_table("papers")
    op.drop_table("job_locks")
