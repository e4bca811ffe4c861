"""Alembic environment: the connection comes from `digest.store.migrate` (config attribute), so the
same code path serves `nightshift db ...`, `digest run` and the tests."""

from __future__ import annotations

from alembic import context

from digest.store.schema import Base
from digest.store.search_index import outside_schema
from engine.server.batch_schema import BatchBase

config = context.config
target_metadata = [Base.metadata, BatchBase.metadata]


def run_migrations_online() -> None:
    connection = config.attributes["connection"]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things in place; batch mode copies the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        # The search index (migration 0005) is raw SQL, not in schema.py: not a difference.
        include_name=outside_schema,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported; give a database URL")
run_migrations_online()
