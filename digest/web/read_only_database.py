"""Database connections that cannot write, for the web view: a bug or a crafted request there
must not be able to change the store that the nightly job writes.

SQLite: `PRAGMA query_only`. PostgreSQL: every transaction of the session read-only. Both are
set on each new connection of the engine's pool; the connection `open_database` made to check
the URL is dropped so that none escapes."""

from __future__ import annotations

from sqlalchemy import Engine, event


def make_read_only(engine: Engine) -> Engine:
    statement = (
        "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY"
        if engine.dialect.name == "postgresql"
        else "PRAGMA query_only = ON"
    )

    @event.listens_for(engine, "connect")
    def _read_only(dbapi_connection, _record) -> None:  # noqa: ANN001 - DBAPI objects
        cursor = dbapi_connection.cursor()
        cursor.execute(statement)
        cursor.close()
        if engine.dialect.name == "postgresql":
            dbapi_connection.commit()  # psycopg opened a transaction for the SET

    engine.dispose()
    return engine
