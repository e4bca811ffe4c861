"""A watermark per nightly source and category set: the newest submission a run took, so that
the next night asks arXiv for what is new since then instead of one calendar day.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-05 10:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "source_watermarks",
        sa.Column("source_key", sa.String(length=500), nullable=False),
        sa.Column("watermark", sa.DateTime(timezone=True), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_source_watermarks_run_id_runs")
        ),
        sa.PrimaryKeyConstraint("source_key", name=op.f("pk_source_watermarks")),
    )


def downgrade() -> None:
    op.drop_table("source_watermarks")
