"""`workload export`: the digest's call log through the real schema, hash_ids by hand."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime, timedelta

import pytest
from typer.testing import CliRunner

from digest.paper import Paper
from digest.store.database import open_database
from digest.store.digest_store import CallRecord, DigestStore
from digest.store.migrate import upgrade
from nightshift.cli import app
from workload.export import ExportError, export_trace, load_calls
from workload.trace import read_trace

runner = CliRunner()
T0 = datetime(2026, 3, 2, 1, 0, tzinfo=UTC)
A, B = "2603.00001", "2603.00002"

# (paper, kind, seconds after T0, prompt tokens, completion tokens, cached tokens)
CALLS = [
    (A, "summary", 0.0, 14, 5, 0),
    (A, "review", 1.0, 18, 7, 8),
    (B, "summary", 2.5, 11, 3, 4),
    (B, "review", 4.0, 15, 9, 8),
]


def _fill(url: str, calls: list[tuple], cached: bool = True) -> None:
    engine = open_database(url)
    upgrade(engine)
    store = DigestStore(engine)
    store.upsert_papers([Paper(A, "Paper A", "abs A"), Paper(B, "Paper B", "abs B")])
    run = store.start_run(date(2026, 3, 1), {}, "m", "http://local", "v1")
    for paper, kind, seconds, prompt, completion, hit in calls:
        store.record_call(
            CallRecord(
                run_id=run,
                paper_id=paper,
                kind=kind,
                model="m",
                endpoint="http://local",
                prompt_version="v1",
                input_basis="abstract",
                max_tokens=256,
                started_at=T0 + timedelta(seconds=seconds),
                status="ok",
                prompt_tokens=prompt,
                completion_tokens=completion,
                cached_tokens=hit if cached else None,
            )
        )
    # A failed call: no tokens, never exported.
    store.record_call(
        CallRecord(
            run_id=run,
            paper_id=B,
            kind="review",
            model="m",
            endpoint="http://local",
            prompt_version="v1",
            input_basis="abstract",
            max_tokens=768,
            started_at=T0 + timedelta(seconds=3),
            status="error",
            error="HTTP 503",
        )
    )
    engine.dispose()


@pytest.fixture
def url(tmp_path):
    return f"sqlite:///{tmp_path / 'digest.db'}"


def test_hash_ids_from_cached_tokens(url):
    # S = 4 (B's summary hit the system prefix); A's prefix 8 and B's 8 (the reviews' hits).
    _fill(url, CALLS)
    records = export_trace(load_calls(url), block_size=4)
    assert [r.hash_ids for r in records] == [
        [0, 1, 2, 3],
        [0, 1, 4, 5, 6],
        [0, 7, 8],
        [0, 7, 9, 10],
    ]
    assert [r.timestamp for r in records] == [0.0, 1000.0, 2500.0, 4000.0]
    assert [(r.input_length, r.output_length, r.kind) for r in records] == [
        (14, 5, "summary"),
        (18, 7, "review"),
        (11, 3, "summary"),
        (15, 9, "review"),
    ]
    assert [r.cached_tokens for r in records] == [0, 8, 4, 8]
    assert {(r.model, r.source) for r in records} == {("m", "digest")}


def test_hash_ids_estimated_without_cached_tokens(url):
    # Paper prefix = shorter prompt - task difference: A 14 - 4 = 10, B 11 - 4 = 7; the system
    # estimate is capped at the shortest paper prefix, 7.
    _fill(url, CALLS, cached=False)
    records = export_trace(load_calls(url), block_size=4)
    assert [r.hash_ids for r in records] == [
        [0, 1, 2, 3],
        [0, 1, 4, 5, 6],
        [0, 7, 8],
        [0, 9, 10, 11],
    ]


def test_default_block_size_shares_nothing_this_short(url):
    _fill(url, CALLS)
    assert [r.hash_ids for r in export_trace(load_calls(url))] == [[0], [1], [2], [3]]


def test_cli_writes_the_trace_and_filters(url, tmp_path):
    _fill(url, CALLS)
    out = tmp_path / "trace.jsonl"
    result = runner.invoke(
        app, ["workload", "export", "--db", url, "--block-size", "4", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    first = json.loads(out.read_text().splitlines()[0])
    assert first == {
        "timestamp": 0.0,
        "input_length": 14,
        "output_length": 5,
        "hash_ids": [0, 1, 2, 3],
        "block_size": 4,  # the trace carries its block size
        "kind": "summary",
        "cached_tokens": 0,
        "model": "m",
        "source": "digest",
    }
    assert len(read_trace(out)) == 4
    args = ["workload", "export", "--db", url, "-o", str(out), "--runs", "1", "--since"]
    assert runner.invoke(app, [*args, "2026-03-02"]).exit_code == 0
    later = runner.invoke(app, [*args, "2026-03-03"])
    assert later.exit_code == 2
    assert "error: no successful model calls" in later.output


def test_empty_database_is_a_clear_error(url, tmp_path):
    upgrade(open_database(url))
    result = runner.invoke(app, ["workload", "export", "--db", url, "-o", str(tmp_path / "t")])
    assert result.exit_code == 2
    assert result.output.startswith("error: no successful model calls")


@pytest.mark.parametrize(
    ("db", "message"),
    [
        ("not a url", "error: not a database URL"),
        ("nonsense://", "error: cannot open nonsense://"),
        ("sqlite:///{tmp}/missing.db", "error: no database file at"),
        ("sqlite:///{tmp}/plain.db", "error: cannot read model_calls from"),
        ("postgresql+psycopg://postgres@127.0.0.1:abc/x", "error: not a database URL"),
        ("postgresql+psycopg://postgres@[::1:5432/x", "error: not a database URL"),
    ],
)
def test_bad_database_is_a_clear_error(tmp_path, db, message):
    open_database(f"sqlite:///{tmp_path / 'plain.db'}").connect().close()  # no tables
    db = db.format(tmp=tmp_path)
    result = runner.invoke(app, ["workload", "export", "--db", db, "-o", str(tmp_path / "t")])
    assert result.exit_code == 2
    assert result.output.startswith(message)
    assert "Traceback" not in result.output
    assert not (tmp_path / "missing.db").exists()


def test_bad_options(url, tmp_path):
    base = ["workload", "export", "--db", url, "-o", str(tmp_path / "t")]
    assert "error: --since must be YYYY-MM-DD" in runner.invoke(app, [*base, "--since", "x"]).output
    assert "error: --runs must be" in runner.invoke(app, [*base, "--runs", "a,b"]).output
    assert "error: --block-size" in runner.invoke(app, [*base, "--block-size", "0"]).output
    with pytest.raises(ExportError):
        export_trace([], block_size=0)
