"""Opening the store: the database URL, engine settings per dialect, and migrations to head.

SQLite is the embedded default (a file under $NIGHTSHIFT_HOME); PostgreSQL is the production store
(`postgresql+psycopg://user@host/db`). Both get the same schema from the Alembic migrations.

Opening connects once, so that a wrong URL (no such database, nothing listening, a driver that is
not installed, a file that is not a database) is one line naming it at the start of a command,
not a traceback from deep inside the first query."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError

from engine.model_fetch import nightshift_home

DATABASE_URL_ENV = "NIGHTSHIFT_DATABASE_URL"
SUPPORTED = "sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
PG_CONNECT_TIMEOUT_S = 10  # an unreachable host fails the start instead of hanging it
SQLITE_BUSY_S = 30  # how long a second writer waits for the first


class StoreError(RuntimeError):
    """The database URL is wrong or the database cannot be opened."""


def default_database_url() -> str:
    if url := os.environ.get(DATABASE_URL_ENV):
        return url
    return f"sqlite:///{nightshift_home() / 'digest.db'}"


def open_database(url: str | None = None, *, create: bool = True) -> Engine:
    """An engine for `url` (default: $NIGHTSHIFT_DATABASE_URL or the SQLite file), connected
    once; raises StoreError with a one-line reason when that fails. With `create=False` (a
    read-only command) a missing SQLite file is an error instead of a new empty database."""
    url = default_database_url() if url is None else url
    if not url.strip():
        raise StoreError(f"the database URL is empty; use {SUPPORTED}")
    try:
        parsed = make_url(url)
        parsed.port  # noqa: B018 - a malformed port is a ValueError here or deep in the driver
    except (ArgumentError, ValueError) as exc:  # ValueError: a port like ":abc" or "[::1:5432"
        raise StoreError(f"not a database URL: {url!r} ({exc})") from None
    shown = parsed.render_as_string(hide_password=True)
    backend = parsed.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise StoreError(f"cannot open {shown}: unsupported database; use {SUPPORTED}")
    database = parsed.database
    if backend == "sqlite" and not create and database and database != ":memory:":
        if not Path(database).is_file():
            raise StoreError(f"no database file at {database}")
    try:
        engine = _open_sqlite(url, parsed.database) if backend == "sqlite" else _open_pg(parsed)
    except (ArgumentError, ImportError) as exc:  # e.g. postgresql+asyncpg without asyncpg
        raise StoreError(f"cannot open {shown}: {first_line(exc)}; use {SUPPORTED}") from None
    except OSError as exc:  # the SQLite file's folder cannot be created
        raise StoreError(f"cannot open {shown}: {exc}") from None
    _check_connects(engine, shown)
    return engine


def _open_pg(parsed: URL) -> Engine:
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    timeout = {} if "connect_timeout" in parsed.query else {"connect_timeout": PG_CONNECT_TIMEOUT_S}
    return create_engine(parsed, pool_pre_ping=True, connect_args=timeout)


def _check_connects(engine: Engine, shown: str) -> None:
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql("SELECT 1")
    except (DBAPIError, sqlite3.Error) as exc:
        engine.dispose()
        reason = first_line(getattr(exc, "orig", None) or exc)
        raise StoreError(f"cannot open {shown}: {reason}") from None


def first_line(exc: BaseException) -> str:
    # psycopg's messages go on with hints on further lines; the first names the problem.
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0].strip()


def _open_sqlite(url: str, database: str | None) -> Engine:
    if database and database != ":memory:":
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    # A second writer (another scheduler, a manual rerun) waits for the lock instead of failing.
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_S})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection: sqlite3.Connection, _record: object) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_S * 1000}")
        cursor.execute("PRAGMA foreign_keys=ON")
        _wal(cursor)
        cursor.close()

    return engine


def _wal(cursor: sqlite3.Cursor) -> None:
    """Switch to WAL (readers never block the writer). Switching a fresh file needs an exclusive
    lock, and SQLite answers "database is locked" at once there instead of calling the busy
    handler when another process is opening the same new file: so wait here as a writer would."""
    deadline = time.monotonic() + SQLITE_BUSY_S
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)
