"""Alembic driven from code: `nightshift db upgrade|downgrade|current` and the implicit upgrade at
the start of `digest run` (a fresh SQLite file gets its schema without a separate step)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine

import migrations


def _config(engine: Engine, connection: Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    config.attributes["connection"] = connection
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    with engine.begin() as connection:
        command.upgrade(_config(engine, connection), revision)


def downgrade(engine: Engine, revision: str = "-1") -> None:
    with engine.begin() as connection:
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
