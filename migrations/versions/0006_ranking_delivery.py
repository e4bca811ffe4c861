"""Ranking by a reader profile and delivery: each listed paper's score and "for you" reasons
(`digest_items.rank_score`, `digest_items.for_you`; NULL for papers listed without a profile),
and a record of each delivery attempt (`deliveries`), so that a rerun does not send a digest
twice and a failed delivery is retried.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05 14:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("digest_items") as batch:
        batch.add_column(sa.Column("rank_score", sa.Float(), nullable=True))
        batch.add_column(sa.Column("for_you", sa.JSON(), nullable=True))
    op.create_table(
        "deliveries",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("digest_date", sa.Date(), nullable=False),
        sa.Column("channel", sa.String(length=16), nullable=False),
        sa.Column("target", sa.String(length=500), nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempted_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deliveries")),
    )
    op.create_index(op.f("ix_deliveries_digest_date"), "deliveries", ["digest_date"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_deliveries_digest_date"), table_name="deliveries")
    op.drop_table("deliveries")
    # Papers ranked below --max-papers stay listed: older code reads their status as pending,
    # so a rerun of their date summarises them (costly, but nothing is lost).
    with op.batch_alter_table("digest_items") as batch:
        batch.drop_column("for_you")
        batch.drop_column("rank_score")
