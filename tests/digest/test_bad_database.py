"""A wrong database URL, for every command that opens the store: one line naming the problem and
exit 2 (bad configuration, which systemd does not retry), never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from nightshift.cli import app
from tests.digest.test_pipeline import write_papers

runner = CliRunner()

BAD_URLS = {
    # Nothing on this port (the discard port); a PostgreSQL on 5432 that lacks the database, or
    # nothing there either: both are one line.
    "closed port": "postgresql://postgres@127.0.0.1:9/digest",
    "missing database": "postgresql://postgres@127.0.0.1:5432/no_such_nightshift_db",
    "unsupported driver": "mysql://digest@127.0.0.1/digest",
    "driver not installed": "postgresql+asyncpg://digest:secret@127.0.0.1/digest",
    "not a database file": None,  # a text file, filled in below
    "port not a number": "postgresql+psycopg://postgres@127.0.0.1:abc/x",
    "unclosed IPv6 host": "postgresql+psycopg://postgres@[::1:5432/x",
}


def _commands(tmp_path, url: str) -> list[list[str]]:
    out = str(tmp_path / "out")
    papers = str(write_papers(tmp_path / "papers.jsonl"))
    run = ["--source", papers, "--endpoint", "http://127.0.0.1:9/v1", "--model", "m"]
    return [
        ["digest", "run", *run, "--db", url, "--out", out],
        ["digest", "render", "--db", url, "--out", out],
        ["digest", "render", "--date", "2026-03-10", "--db", url, "--out", out],
        ["db", "upgrade", "--db", url],
        ["db", "downgrade", "--db", url],
        ["db", "current", "--db", url],
    ]


@pytest.mark.parametrize("case", BAD_URLS)
def test_a_bad_database_url_is_one_line_and_exit_2(tmp_path, case):
    url = BAD_URLS[case]
    if url is None:
        (tmp_path / "notes.txt").write_text("these are notes, not a database\n" * 100)
        url = f"sqlite:///{tmp_path / 'notes.txt'}"
    for args in _commands(tmp_path, url):
        result = runner.invoke(app, args)
        assert result.exception is None or isinstance(result.exception, SystemExit), (
            args,
            result.output,
        )
        assert result.exit_code == 2, (args, result.output)
        assert result.output.count("\n") == 1 and result.output.startswith("error: "), (
            args,
            result.output,
        )
        assert "secret" not in result.output  # the password is not printed
    assert not (tmp_path / "out").exists()


def test_schedule_and_db_upgrade_refuse_a_bad_database_at_start(tmp_path):
    (tmp_path / "notes.txt").write_text("not a database\n")
    url = f"sqlite:///{tmp_path / 'notes.txt'}"
    for args in (["digest", "schedule"], ["db", "upgrade"]):
        # A real process: the scheduler must exit at start, not wait for 02:00 to fail.
        cmd = [sys.executable, "-m", "nightshift.cli", *args, "--db", url]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        assert result.returncode == 2, result.stderr
        assert result.stderr == (f"error: cannot open {url}: file is not a database\n"), (
            result.stderr
        )
    assert (tmp_path / "notes.txt").read_text() == "not a database\n"


def test_an_unknown_revision_is_one_line(sqlite_url):
    result = runner.invoke(app, ["db", "upgrade", "nope", "--db", sqlite_url])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "nope" in result.output
