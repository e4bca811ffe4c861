"""Alembic driven from code: `nightshift db upgrade|downgrade|current` and the implicit upgrade at
the start of `digest run` (a fresh SQLite file gets its schema without a separate step).

Migrations run under a database-wide lock held for their one transaction, because two processes
may migrate at once (two timers, two schedulers on a fresh database): without it both see no
schema and both create it, and one crashes. With it the second waits, then finds the schema at
head and does nothing; the job lock (a table the migrations create) decides who runs after that."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text

import migrations

# Any fixed 64-bit number; it only has to differ from other applications' advisory locks.
_PG_MIGRATION_LOCK = 0x6E73_6469_6D69  # "nsdimi"


def _config(engine: Engine, connection: Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    config.attributes["connection"] = connection
    return config


@contextmanager
def _locked(engine: Engine) -> Iterator[Connection]:
    """A connection in one transaction that holds the migration lock until it commits."""
    with engine.connect() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK}
            )
        elif connection.dialect.name == "sqlite":
            # pysqlite begins a transaction only before DML, so CREATE TABLE would run on its
            # own; BEGIN IMMEDIATE takes the write lock now (others wait out the busy timeout)
            # and makes the whole migration one transaction (SQLite's DDL is transactional).
            connection.exec_driver_sql("BEGIN IMMEDIATE")
        yield connection
        connection.commit()


def upgrade(engine: Engine, revision: str = "head") -> None:
    with _locked(engine) as connection:
        command.upgrade(_config(engine, connection), revision)


def downgrade(engine: Engine, revision: str = "-1") -> None:
    with _locked(engine) as connection:
        command.downgrade(_config(engine, connection), revision)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head_revision() -> str:
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    head = ScriptDirectory.from_config(config).get_current_head()
    assert head is not None, "no migrations found"
    return head


def make_revision(engine: Engine, message: str) -> None:
    """Autogenerate a new revision from the schema (a developer command)."""
    with engine.begin() as connection:
        command.revision(_config(engine, connection), message=message, autogenerate=True)
