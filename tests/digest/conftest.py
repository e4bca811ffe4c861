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


@pytest.fixture
def stored(tmp_path, sqlite_url):
    """A digest of four reviewed papers in a SQLite store, not sent anywhere yet: (store,
    digest), for the delivery tests."""
    from digest.pipeline import run_digest
    from digest.store.database import open_database
    from digest.store.digest_store import DigestStore
    from tests.digest.fault_server import FaultServer
    from tests.digest.test_pipeline import DAY, options

    with FaultServer() as stub:
        run_digest(options(tmp_path, sqlite_url, stub.base_url))
    store = DigestStore(open_database(sqlite_url))
    return store, store.load_digest(DAY)
