"""The store: migrations up and down on both databases, idempotent writes, the job lock."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import UTC, date, datetime, timedelta

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, update

from digest.paper import Paper
from digest.review import Review
from digest.store import migrate
from digest.store.database import StoreError, open_database
from digest.store.digest_store import CallRecord, DigestStore, WorkKey, utcnow
from digest.store.job_lock import JobLock, LockHeld
from digest.store.schema import Base, JobLockRow
from digest.store.search_index import outside_schema
from engine.server.batch_schema import BatchBase

DAY = date(2026, 3, 10)
KEY = WorkKey("m", "p1", "abstract")


def _paper(n: int, version: int = 1, title: str | None = None) -> Paper:
    return Paper(
        f"2603.{n:05d}",
        title or f"Paper {n}",
        f"Abstract {n} with $x^2$.",
        ["A. Author", "B. Author"],
        ["cs.CL", "cs.LG"],
        version=version,
    )


def _review(overall: int = 6) -> Review:
    return Review(
        summary="s",
        strengths=["a"],
        weaknesses=["b"],
        questions=[],
        limitations=[],
        soundness=None,
        presentation=3,
        contribution=2,
        overall=overall,
        confidence=3,
        decision="Accept",
        input_basis="abstract",
    )


def test_migrations_match_the_schema_and_go_down_and_up(db_url):
    engine = open_database(db_url)
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) == migrate.head_revision()
    with engine.connect() as conn:
        # Both schemas of the history: the digest's, and the Batch API's (engine/server/).
        schemas = [Base.metadata, BatchBase.metadata]
        # The search index (migration 0005) is raw SQL by design: left out as env.py does.
        context = MigrationContext.configure(conn, opts={"include_name": outside_schema})
        diff = compare_metadata(context, schemas)  # type: ignore[arg-type]
    assert diff == [], f"migrations and schema.py differ: {diff}"
    migrate.downgrade(engine, "base")
    assert migrate.current_revision(engine) is None
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    migrate.upgrade(engine)
    assert {"papers", "runs", "model_calls", "job_locks"} <= set(inspect(engine).get_table_names())


def test_idempotent_writes_and_new_versions(db_url):
    engine = open_database(db_url)
    migrate.upgrade(engine)
    store = DigestStore(engine)
    store.upsert_papers([_paper(1), _paper(2)])
    store.add_items(DAY, [_paper(1), _paper(2)], "abstract")
    # The same fetch again, with a new version of paper 2: no new rows, metadata updated.
    store.upsert_papers([_paper(1), _paper(2, version=2, title="Paper 2, revised"), _paper(3)])
    store.add_items(DAY, [_paper(2, version=2), _paper(1), _paper(3)], "abstract")
    items = store.items(DAY)
    assert [p.arxiv_id for _, p in items] == ["2603.00001", "2603.00002", "2603.00003"]
    assert items[1][1].version == 2 and items[1][1].title == "Paper 2, revised"
    # An older version seen later does not overwrite the newer one.
    store.upsert_papers([_paper(2, version=1)])
    assert store.items(DAY)[1][1].version == 2

    run_id = store.start_run(DAY, {}, "m", "local", "p1")
    store.save_summary(_paper(1), KEY, "first", run_id)
    store.save_summary(_paper(1), KEY, "second", run_id)  # a replay: the first one stays
    assert store.summary("2603.00001", KEY).text == "first"
    assert store.summary("2603.00001", WorkKey("other", "p1", "abstract")) is None
    store.save_review(_paper(1), KEY, _review(), "ok", "{...}", None, run_id)
    store.save_review(_paper(1), KEY, None, "failed", "garbage", "bad", run_id)
    assert store.review("2603.00001", KEY).overall == 6


def test_run_counts_and_digest_loading(db_url):
    engine = open_database(db_url)
    migrate.upgrade(engine)
    store = DigestStore(engine)
    papers = [_paper(1), _paper(2)]
    store.upsert_papers(papers)
    store.add_items(DAY, papers, "abstract")
    run_id = store.start_run(DAY, {"x": 1}, "m", "local", "p1")
    store.save_summary(papers[0], KEY, "a summary", run_id)
    store.save_review(papers[0], KEY, _review(8), "repaired", "raw", None, run_id)
    store.set_item(DAY, papers[0].arxiv_id, "done", run_id, "abstract")
    store.set_item(DAY, papers[1].arxiv_id, "failed", run_id, "abstract", "HTTP 503")
    for kind, tokens in (("summary", 100), ("review", 150)):
        store.record_call(
            CallRecord(
                run_id,
                papers[0].arxiv_id,
                kind,
                "m",
                "e",
                "p1",
                "abstract",
                256,
                utcnow(),
                "ok",
                tokens,
                40,
                64,
                0.1,
                1.0,
            )
        )
    run = store.finish_run(run_id, "partial")
    assert (run.papers_total, run.papers_done, run.papers_failed) == (2, 1, 1)
    assert (run.calls, run.prompt_tokens, run.completion_tokens) == (2, 250, 80)
    digest = store.load_digest(DAY)
    assert digest.model == "m" and digest.prompt_version == "p1"
    assert [e.status for e in digest.entries] == ["done", "failed"]
    assert digest.entries[0].review.overall == 8
    assert digest.entries[0].review_parse_status == "repaired"
    assert digest.entries[1].error == "HTTP 503"
    assert store.load_digest(date(2000, 1, 1)) is None
    assert store.digest_dates() == [DAY]


def test_job_lock_excludes_a_second_holder_and_expires(db_url):
    engine = open_database(db_url)
    migrate.upgrade(engine)
    first = JobLock(engine, lease_s=60)
    first.acquire()
    second = JobLock(engine, lease_s=60)
    with pytest.raises(LockHeld, match="another digest run holds the lock"):
        second.acquire()
    first.release()
    second.acquire()  # free again
    second.release()
    # A lease that ran out (its holder vanished without releasing) is taken over.
    with engine.begin() as conn:
        conn.execute(
            update(JobLockRow).values(
                holder="elsewhere:1:x", expires_at=datetime.now(UTC) - timedelta(seconds=1)
            )
        )
    third = JobLock(engine, lease_s=60)
    third.acquire()
    third.release()


def test_job_lock_of_a_killed_process_on_this_host_is_taken_over(sqlite_url):
    engine = open_database(sqlite_url)
    migrate.upgrade(engine)
    code = (
        "import os, sys; from digest.store.database import open_database; "
        "from digest.store.job_lock import JobLock; "
        f"JobLock(open_database({sqlite_url!r}), lease_s=3600).acquire(); "
        "os._exit(0)"  # dies holding the lock, like kill -9
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    lock = JobLock(engine, lease_s=3600)
    lock.acquire()
    lock.release()


def test_job_lock_renews_its_lease(sqlite_url):
    engine = open_database(sqlite_url)
    migrate.upgrade(engine)
    lock = JobLock(engine, lease_s=0.6)
    lock.acquire()
    time.sleep(1.0)  # longer than the lease: only renewal keeps it
    with pytest.raises(LockHeld):
        JobLock(engine, lease_s=0.6).acquire()
    lock.release()


def test_bad_database_url_names_the_problem():
    with pytest.raises(StoreError, match="not a database URL"):
        open_database("not a url")


def test_opening_a_new_sqlite_file_waits_for_a_writer_instead_of_failing(tmp_path):
    # A second process opening a fresh file while the first holds the write lock: switching to
    # WAL answered "database is locked" at once (no busy wait); it must wait like a writer.
    import sqlite3
    import threading

    from digest.store.database import open_database

    path = tmp_path / "fresh.db"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    threading.Timer(0.5, lambda: holder.execute("COMMIT")).start()
    open_database(f"sqlite:///{path}").dispose()
    holder.close()


def test_a_result_and_its_call_record_are_stored_together(db_url):
    """One transaction: a run killed after the reply is either without both (and asks again)
    or has both, never a recorded call whose result is lost (which a rerun would repeat)."""
    engine = open_database(db_url)
    migrate.upgrade(engine)
    store = DigestStore(engine)
    store.upsert_papers([_paper(1)])
    run_id = store.start_run(DAY, {}, "m", "local", "p1")
    call = CallRecord(
        run_id=run_id,
        paper_id=_paper(1).arxiv_id,
        kind="summary",
        model="m",
        endpoint="http://127.0.0.1:1/v1",
        prompt_version="p1",
        input_basis="abstract",
        max_tokens=8,
        started_at=utcnow(),
        status="ok",
    )
    store.save_summary(_paper(1), KEY, "first", run_id, call)
    assert [c.kind for c in store.calls()] == ["summary"]
    # The row exists already (an earlier run stored it): the call was made all the same.
    store.save_summary(_paper(1), KEY, "second", run_id, call)
    assert store.summary(_paper(1).arxiv_id, KEY).text == "first"
    assert len(store.calls()) == 2
