"""Databases for the digest tests: SQLite always; PostgreSQL too when NIGHTSHIFT_TEST_DATABASE_URL
names one (CI creates a fresh database). Each test gets an empty schema."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sqlalchemy import text

from digest.store.database import open_database
from digest.store.schema import Base
from digest.store.search_index import drop_search_index
from engine.server.batch_schema import BatchBase

PG_URL = os.environ.get("NIGHTSHIFT_TEST_DATABASE_URL")


def _empty_postgres(url: str) -> None:
    engine = open_database(url)
    with engine.begin() as conn:
        drop_search_index(conn)  # raw SQL outside schema.py (migration 0005)
        Base.metadata.drop_all(conn)
        BatchBase.metadata.drop_all(conn)
        conn.execute(text("DROP TABLE IF EXISTS alembic_version"))
    engine.dispose()


def fresh_database(url: str, sqlite_path: Path) -> str:
    """An empty database of the kind `url` names: a new SQLite file, or `url` emptied."""
    if url.startswith("sqlite"):
        return f"sqlite:///{sqlite_path}"
    _empty_postgres(url)
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'digest.db'}"
        return
    if not PG_URL:
        pytest.skip("NIGHTSHIFT_TEST_DATABASE_URL is not set")
    _empty_postgres(PG_URL)
    yield PG_URL
    _empty_postgres(PG_URL)


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path / 'digest.db'}"
