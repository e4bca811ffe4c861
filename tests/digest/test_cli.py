"""`nightshift digest ...` and `nightshift db ...` as a user calls them: exit codes, messages,
re-rendering without the model, migrations from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta

from typer.testing import CliRunner

from nightshift.cli import app
from tests.digest.fault_server import Fault, FaultServer
from tests.digest.test_pipeline import DAY, write_papers

runner = CliRunner()


def _run_args(tmp_path, db_url: str, base_url: str) -> list[str]:
    papers = write_papers(tmp_path / "papers.jsonl")
    return [
        "digest",
        "run",
        "--date",
        DAY.isoformat(),
        "--source",
        str(papers),
        "--endpoint",
        base_url,
        "--model",
        "stub-model",
        "--db",
        db_url,
        "--out",
        str(tmp_path / "out"),
    ]


def test_no_network_fails_fast_and_says_how_to_use_a_file(tmp_path):
    # `.invalid` never resolves (RFC 6761): what a machine without network sees for arXiv.
    env = {"NIGHTSHIFT_ARXIV_API_URL": "http://export.arxiv.invalid/api/query"}
    cmd = [
        sys.executable,
        "-m",
        "nightshift.cli",
        "digest",
        "run",
        "--db",
        f"sqlite:///{tmp_path / 'd.db'}",
        "--out",
        str(tmp_path / "out"),
    ]
    start = time.monotonic()
    result = subprocess.run(
        cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr
    assert "No network?" in result.stderr and "--source FILE" in result.stderr
    assert "export.arxiv.invalid" in result.stderr
    assert elapsed < 20, f"took {elapsed:.1f} s"
    assert not any((tmp_path / "out").iterdir())  # checked at start, nothing published


def test_partial_success_exit_code_and_render_without_model(tmp_path, sqlite_url):
    faults = [Fault("status", status=503, match="Tokenizer-Free", times=-1)]
    with FaultServer(faults=faults) as stub:
        result = runner.invoke(
            app, _run_args(tmp_path, sqlite_url, stub.base_url) + ["--concurrency", "2"]
        )
        calls = len(stub.requests)
    assert result.exit_code == 3, result.output
    assert "partial" in result.output and "failed: 2603.00004" in result.output
    page = tmp_path / "out" / f"digest-{DAY}.html"
    before = page.read_bytes()
    page.unlink()
    (tmp_path / "out" / "feed.xml").unlink()

    rendered = runner.invoke(
        app,
        [
            "digest",
            "render",
            "--date",
            DAY.isoformat(),
            "--db",
            sqlite_url,
            "--out",
            str(tmp_path / "out"),
        ],
    )
    assert rendered.exit_code == 0, rendered.output
    assert page.read_bytes() == before and (tmp_path / "out" / "feed.xml").exists()
    assert "digest.example.org" not in (tmp_path / "out" / "feed.xml").read_text()
    site = ["--site-url", "https://digest.example.org/papers"]
    rendered = runner.invoke(
        app, ["digest", "render", "--db", sqlite_url, "--out", str(tmp_path / "out"), *site]
    )
    feed = (tmp_path / "out" / "feed.xml").read_text()
    assert f"https://digest.example.org/papers/digest-{DAY}.html" in feed
    assert calls > 0  # (the stub is gone: rendering made no model call)


def test_bad_arguments_exit_2_with_a_clear_message(tmp_path, sqlite_url):
    cases = [
        (["--date", "2026-13-01"], "--date must be YYYY-MM-DD"),
        (["--input", "pdf"], "--input must be abstract or fulltext"),
        (["--endpoint", "ftp://x"], "--endpoint must be 'local' or an http(s) URL"),
        (["--concurrency", "0"], "--concurrency must be at least 1"),
        (["--db", "nonsense"], "not a database URL"),
        (["--redo", "not-an-id"], "--redo: not an arXiv identifier"),
        (["--republished", "hide"], "--republished must be mark or skip"),
        (["--redo", "2603.99999v2"], "--redo 2603.99999: the digest of 2026-03-10 does not list"),
        (["--endpoint", "http://127.0.0.1:abc/v1"], "a bad host or port"),
        (["--endpoint", "http://127.0.0.1:99999/v1"], "a bad host or port"),
        (["--endpoint", "local", "--local-model", "/nonexistent/model"], "does not exist"),
        (["--out", str(tmp_path / "papers.jsonl")], "cannot create the folder"),
        (["--out", "/proc/xx"], "cannot create the folder"),
        (["--db", "postgresql+psycopg://postgres@127.0.0.1:abc/x"], "not a database URL"),
        (["--db", "postgresql+psycopg://postgres@[::1:5432/x"], "not a database URL"),
        (["--db", ""], "the database URL is empty"),
        (["--source", "arxivv"], "--source must be arxiv, rss or a file"),
        (["--source", str(tmp_path)], "cannot read"),
        (["--source", str(tmp_path / "missing.jsonl")], "--source must be arxiv, rss or a file"),
        (["--source", _file(tmp_path, "deep.json", "[" * 100_000)], "nested too deeply"),
        (["--source", _file(tmp_path, "big.json", "[" + "9" * 5000 + "]")], "5000 digits"),
        (["--source", _file(tmp_path, "empty.jsonl", "")], "no papers in the file"),
        (["--source", _file(tmp_path, "bin.jsonl", "\x00\xff")], "binary file"),
        (["--source", _file(tmp_path, "nan.json", '[{"id": NaN}]')], "has no 'title'"),
        (["--source", _file(tmp_path, "cut.json", '[{"id": "2603.')], "not JSON"),
        (["--source", _file(tmp_path, "list.jsonl", "[1, 2]")], "line 1 is not an object"),
    ]
    for extra, message in cases:
        args = _run_args(tmp_path, sqlite_url, "http://127.0.0.1:9/v1") + extra
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (extra, result.output)
        assert message in result.output, (extra, result.output)
        assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output


def _file(tmp_path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def test_render_and_deliver_without_a_digest_are_a_usage_error(tmp_path, sqlite_url):
    """Found from outside: `render --db` with a missing SQLite file created an empty database
    and the --out folder; a --date without a digest exited 1 ("failed, retry" to systemd)."""
    out = ["--out", str(tmp_path / "out")]
    missing = runner.invoke(app, ["digest", "render", "--db", sqlite_url, *out])
    assert missing.exit_code == 2 and "no database file at" in missing.output
    assert not (tmp_path / "digest.db").exists() and not (tmp_path / "out").exists()
    assert runner.invoke(app, ["db", "upgrade", "head", "--db", sqlite_url]).exit_code == 0
    result = runner.invoke(app, ["digest", "render", "--db", sqlite_url, *out])
    assert result.exit_code == 2 and "no digest yet" in result.output
    with FaultServer() as stub:
        assert runner.invoke(app, _run_args(tmp_path, sqlite_url, stub.base_url)).exit_code == 0
    other = (DAY + timedelta(days=1)).isoformat()
    hook = ["--webhook-url", "http://127.0.0.1:9/hook"]
    for command in (["render", *out], ["deliver", *hook]):
        result = runner.invoke(app, ["digest", *command, "--db", sqlite_url, "--date", other])
        assert result.exit_code == 2, result.output
        assert f"no digest for {other}" in result.output


def test_db_commands(sqlite_url):
    result = runner.invoke(app, ["db", "current", "--db", sqlite_url])
    assert result.exit_code == 2 and "no database file at" in result.output
    result = runner.invoke(app, ["db", "upgrade", "base", "--db", sqlite_url])
    result = runner.invoke(app, ["db", "current", "--db", sqlite_url])
    assert result.exit_code == 0 and "current: base (empty)" in result.output
    from digest.store import migrate

    head = migrate.head_revision()  # the newest migration, whichever it is now
    result = runner.invoke(app, ["db", "upgrade", "--db", sqlite_url])
    assert result.exit_code == 0 and f"database at {head}" in result.output
    result = runner.invoke(app, ["db", "current", "--db", sqlite_url])
    assert f"current: {head}" in result.output and f"head:    {head}" in result.output
    result = runner.invoke(app, ["db", "downgrade", "base", "--db", sqlite_url])
    assert result.exit_code == 0 and "database at base" in result.output


def test_schedule_takes_the_run_options_and_names_a_bad_timezone(sqlite_url):
    result = runner.invoke(
        app,
        [
            "digest",
            "schedule",
            "--timezone",
            "Mars/Olympus",
            "--db",
            sqlite_url,
            "--max-papers",
            "3",
        ],
    )
    assert result.exit_code == 2 and "unknown --timezone 'Mars/Olympus'" in result.output
    result = runner.invoke(app, ["digest", "schedule", "--concurrency", "0", "--db", sqlite_url])
    assert result.exit_code == 2 and "--concurrency must be at least 1" in result.output
    # The start refuses what `digest run` refuses, instead of waiting for 02:00 to fail.
    for extra, message in [
        (["--endpoint", "http://127.0.0.1:8000/v1"], "--model is required"),
        (["--source", "/nonexistent.jsonl"], "--source must be arxiv, rss or a file"),
        (["--misfire-grace-time", "-1"], "--misfire-grace-time"),
        (["--out", "/proc/xx"], "cannot create the folder"),
    ]:
        result = runner.invoke(app, ["digest", "schedule", "--db", sqlite_url, *extra])
        assert result.exit_code == 2 and message in result.output, (extra, result.output)


def test_db_current_does_not_create_a_database(tmp_path):
    path = tmp_path / "brandnew" / "y.db"
    result = runner.invoke(app, ["db", "current", "--db", f"sqlite:///{path}"])
    assert result.exit_code == 2 and f"no database file at {path}" in result.output
    assert not (tmp_path / "brandnew").exists()


def test_categories_apply_to_a_file_source(tmp_path, sqlite_url):
    path = tmp_path / "mixed.jsonl"
    papers = [
        ("2603.00001", ["cs.CL"]),
        ("2603.00002", ["cs.CV", "cs.CL"]),
        ("2603.00003", ["cs.CV"]),
    ]
    path.write_text(
        "".join(
            json.dumps({"id": pid, "title": f"Paper {pid}", "abstract": "A.", "authors": ["A"],
                        "categories": cats}) + "\n"
            for pid, cats in papers
        )
    )  # fmt: skip
    with FaultServer() as stub:
        args = _run_args(tmp_path, sqlite_url, stub.base_url)
        args[args.index("--source") + 1] = str(path)
        result = runner.invoke(app, [*args, "--categories", "cs.CV"])
    assert result.exit_code == 0, result.output
    assert "2 listed, 2 done" in result.output
    page = (tmp_path / "out" / f"digest-{DAY}.html").read_text()
    assert "2603.00002" in page and "2603.00003" in page and "2603.00001" not in page


def test_categories_are_checked_before_anything_runs(tmp_path, sqlite_url, caplog):
    """Found from outside: a malformed --categories ("cs.CL OR all:x" went into the arXiv query
    as query syntax) or an unknown one published an empty digest with exit 0, every night."""
    args = _run_args(tmp_path, sqlite_url, "http://127.0.0.1:9/v1")
    for bad in ("CS.CL", "cs.CL;rm", "cs.CL OR all:x", "cs.CL,cs..LG"):
        result = runner.invoke(app, [*args, "--categories", bad])
        assert result.exit_code == 2, (bad, result.output)
        assert "not an arXiv category name" in result.output, result.output
    assert not (tmp_path / "out").exists()  # refused before anything was written
    with caplog.at_level("WARNING"), FaultServer() as stub:
        args = _run_args(tmp_path, sqlite_url, stub.base_url)
        result = runner.invoke(app, [*args, "--categories", "cs.XX,hep-th,cond-mat.str-el"])
    assert result.exit_code == 0, result.output
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == ["--categories: cs.XX is not in arXiv's taxonomy; no paper will match it"]


def test_options_another_source_reads_are_said_to_be_ignored(tmp_path, sqlite_url, caplog):
    """Found from outside: --include-cross and --overlap-days with a file source were accepted
    and ignored without a word."""
    with caplog.at_level("WARNING"), FaultServer() as stub:
        args = _run_args(tmp_path, sqlite_url, stub.base_url)
        result = runner.invoke(app, [*args, "--include-cross", "--overlap-days", "5"])
    assert result.exit_code == 0, result.output
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [
        "--include-cross applies to --source rss only; ignored here",
        "--overlap-days applies to --source arxiv only; ignored here",
    ]
