"""Opening the store: the database URL, engine settings per dialect, and migrations to head.

SQLite is the embedded default (a file under $NIGHTSHIFT_HOME); PostgreSQL is the production store
(`postgresql+psycopg://user@host/db`). Both get the same schema from the Alembic migrations."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from engine.model_fetch import nightshift_home

DATABASE_URL_ENV = "NIGHTSHIFT_DATABASE_URL"


class StoreError(RuntimeError):
    """The database URL is wrong or the database cannot be opened."""


def default_database_url() -> str:
    if url := os.environ.get(DATABASE_URL_ENV):
        return url
    return f"sqlite:///{nightshift_home() / 'digest.db'}"


def open_database(url: str | None = None) -> Engine:
    """An engine for `url` (default: $NIGHTSHIFT_DATABASE_URL or the SQLite file)."""
    url = url or default_database_url()
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise StoreError(f"not a database URL: {url!r} ({exc})") from None
    if parsed.get_backend_name() == "sqlite":
        return _open_sqlite(url, parsed.database)
    if parsed.get_backend_name() == "postgresql" and parsed.drivername == "postgresql":
        url = parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    return create_engine(url, pool_pre_ping=True)


def _open_sqlite(url: str, database: str | None) -> Engine:
    if database and database != ":memory:":
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    # A second writer (another scheduler, a manual rerun) waits for the lock instead of failing.
    engine = create_engine(url, connect_args={"timeout": 30})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection: sqlite3.Connection, _record: object) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    return engine
