"""Runs record a fingerprint of the digest they left, so that a rerun that changed nothing keeps
the digest's time (and the feed's `updated`).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 11:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ALTER TABLE on both databases (SQLite adds a nullable column in place).
    op.add_column("runs", sa.Column("content_hash", sa.String(length=64), nullable=True))


def downgrade() -> None:
    # Not batch mode: on SQLite it would copy `runs` and drop the original, which the rows that
    # reference a run forbid. SQLite >= 3.35 drops a plain column in place.
    op.drop_column("runs", "content_hash")
