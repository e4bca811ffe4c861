"""The digest's SQL store (SQLAlchemy 2.0; SQLite by default, PostgreSQL in production)."""
