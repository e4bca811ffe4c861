"""Alembic migrations of the digest store (a package so that they ship with the install)."""
