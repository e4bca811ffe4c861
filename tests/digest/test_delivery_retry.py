"""A night's failed delivery, retried under `digest schedule` (issue 19): bounded attempts with
a doubling wait, counted in the deliveries table (so a restarted scheduler goes on counting and
nothing is sent twice), the stored digest only (no model call). Against a real webhook on
loopback, the real `digest schedule` command and APScheduler; SQLite and PostgreSQL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from apscheduler.schedulers.background import BackgroundScheduler
from sqlalchemy import text

from digest.delivery import delivery_config
from digest.delivery.retry import (
    DeliveryRetries,
    RetryPolicy,
    next_attempt,
    retry_due,
    target_states,
)
from digest.pipeline import run_digest
from digest.store.database import open_database
from digest.store.digest_store import DigestStore
from tests.digest.fault_server import FaultServer
from tests.digest.test_delivery_webhook import Hook
from tests.digest.test_pipeline import DAY, options, write_papers

WAIT_S = 90.0


def _rows(db_url: str) -> list[tuple[str, str]]:
    engine = open_database(db_url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT channel, status FROM deliveries ORDER BY id")).all()
    engine.dispose()
    return [tuple(r) for r in rows]


def test_the_table_sets_when_a_target_is_due_and_bounds_the_attempts(tmp_path, db_url):
    policy = RetryPolicy(retries=2, first_wait_s=60.0)
    with Hook() as hook, FaultServer() as stub:
        config = delivery_config([], hook.url, None)
        hook.status = 500
        night = run_digest(options(tmp_path, db_url, stub.base_url, delivery=config))
        assert night.delivery_failed and len(stub.requests) == 8
        # The report's first line says so, not just "succeeded" (found from outside).
        assert night.lines()[0].endswith(": succeeded; delivery failed")
        store = DigestStore(open_database(db_url))
        digest = store.load_digest(DAY)
        (night_state,) = target_states(store, digest, config)
        assert (night_state.sent, night_state.failures) == (False, 1)
        first = next_attempt([night_state], policy)
        assert first == night_state.last_attempt + timedelta(seconds=60)
        # Not yet due: nothing is sent.
        assert retry_due(store, digest, config, policy, now=first - timedelta(seconds=1)) == []
        assert len(hook.posts) == 1
        (outcome,) = retry_due(store, digest, config, policy, now=first)
        assert outcome.status == "failed" and len(hook.posts) == 2
        (state,) = target_states(store, digest, config)
        assert state.failures == 2
        second = next_attempt([state], policy)
        assert second == state.last_attempt + timedelta(seconds=120)  # the wait doubled
        retry_due(store, digest, config, policy, now=second)
        (state,) = target_states(store, digest, config)
        # The night's and two retries: out of attempts, nothing is due ever again.
        assert state.failures == 3 and state.exhausted(policy)
        assert next_attempt([state], policy) is None
        far = datetime.now(UTC) + timedelta(days=1)
        hook.status = 200
        assert retry_due(store, digest, config, policy, now=far) == []
        # One more retry allowed: it sends, and a sent target is never due again.
        more = RetryPolicy(retries=3, first_wait_s=60.0)
        (sent,) = retry_due(store, digest, config, more, now=far)
        assert sent.status == "sent"
        assert next_attempt(target_states(store, digest, config), more) is None
        assert retry_due(store, digest, config, more, now=far) == []
        assert len(stub.requests) == 8  # no model call after the night's
    assert len(hook.posts) == 4
    assert _rows(db_url) == [("webhook", "failed")] * 3 + [("webhook", "sent")]


def test_a_start_arms_every_night_with_attempts_left(tmp_path, db_url):
    """A scheduler stopped over two failed nights re-arms both at start, not only the newest;
    a night out of attempts, or sent, is not armed."""
    nights = [DAY - timedelta(days=2), DAY - timedelta(days=1), DAY]
    with Hook() as hook, FaultServer() as stub:
        config = delivery_config([], hook.url, None)
        for day, status in zip(nights, (500, 500, 200), strict=True):
            hook.status = status
            run_digest(options(tmp_path, db_url, stub.base_url, delivery=config, digest_date=day))
        store = DigestStore(open_database(db_url))
        assert store.dates_with_failed_deliveries() == nights[:2]
        scheduler = BackgroundScheduler(timezone="UTC")  # never started: jobs stay pending
        retries = DeliveryRetries(db_url, config, RetryPolicy(retries=2), scheduler)
        assert retries.arm_pending() == nights[:2]
        ids = sorted(job.id for job in scheduler.get_jobs())
        assert ids == [f"delivery-retry-{day.isoformat()}" for day in nights[:2]]
        # The oldest night spends its attempts: a later start leaves it alone.
        digest, hook.status = store.load_digest(nights[0]), 500
        for _ in range(2):
            retry_due(store, digest, config, RetryPolicy(retries=2, first_wait_s=0.0))
        assert target_states(store, digest, config)[0].failures == 3
        later = BackgroundScheduler(timezone="UTC")
        assert DeliveryRetries(db_url, config, RetryPolicy(retries=2), later).arm_pending() == [
            nights[1]
        ]
        # The first night made the calls (later nights reuse its results); the retries none.
        assert len(hook.posts) == 5 and len(stub.requests) == 8


def _schedule(tmp_path: Path, db_url: str, stub: str, hook: str, at: str, log, *extra: str):
    papers = tmp_path / "papers.jsonl"
    if not papers.exists():
        write_papers(papers)
    cmd = [
        sys.executable, "-m", "nightshift.cli", "digest", "schedule", "--at", at,
        "--timezone", "UTC", "--source", str(papers), "--endpoint", stub, "--model",
        "stub-model", "--db", db_url, "--out", str(tmp_path / "out"), "--webhook-url", hook,
        *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _soon() -> tuple[str, str]:
    """--at a few seconds from now, and the date that night digests (yesterday, UTC)."""
    fire = datetime.now(UTC) + timedelta(seconds=6)
    return fire.strftime("%H:%M:%S"), (fire.date() - timedelta(days=1)).isoformat()


def _wait_for(condition, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def _stop(proc: subprocess.Popen, log: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, log.read_text()


def _run_schedule(
    tmp_path, db_url, stub: str, hook: str, at: str, log_path: Path, args, until, linger=0.0
) -> None:
    """A scheduler started, run until `until()` holds (then `linger` seconds more, in which
    nothing else must break it), stopped with SIGTERM; killed if anything failed on the way."""
    with log_path.open("wb") as log:
        proc = _schedule(tmp_path, db_url, stub, hook, at, log, *args)
        try:
            _wait_for(until, proc, log_path)
            time.sleep(linger)
            _stop(proc, log_path)
        finally:
            if proc.poll() is None:
                proc.kill()


def test_schedule_retries_a_failed_delivery_with_backoff_until_sent(tmp_path, db_url):
    """The webhook fails the night's POST and the first retry: the scheduler tries again 1 s,
    then 2 s later, and stops once it is sent; the night's model calls are not made again."""
    at, day = _soon()
    log_path = tmp_path / "schedule.log"
    with FaultServer() as stub, Hook() as hook:
        hook.failures = 2
        args = ("--delivery-retries", "4", "--delivery-retry-wait", "1")
        # lingering longer than the next wait would be: nothing more comes
        _run_schedule(tmp_path, db_url, stub.base_url, hook.url, at, log_path, args,
                      lambda: len(hook.posts) == 3, linger=3.0)  # fmt: skip
        requests = len(stub.requests)
    output = log_path.read_text()
    assert len(hook.posts) == 3 and requests == 8, output
    gaps = [b - a for a, b in zip(hook.times, hook.times[1:], strict=False)]
    assert gaps[0] >= 0.9 and gaps[1] >= 1.9, gaps  # 1 s, then doubled
    assert _rows(db_url) == [("webhook", "failed")] * 2 + [("webhook", "sent")]
    assert f"delivery of {day}: next attempt at" in output
    assert output.count("succeeded") == 1 and "Traceback" not in output, output


def test_a_restarted_scheduler_goes_on_counting_and_never_sends_twice(tmp_path, db_url):
    """Stopped after two failures, a scheduler started again reads the count from the table:
    it waits the third wait (4 s), not the first, sends once, and a third start sends nothing."""
    at, day = _soon()
    # A time of day just past: the restarted schedulers' night is tomorrow, never in the test.
    past = (datetime.now(UTC) - timedelta(minutes=5)).strftime("%H:%M:%S")
    args = ("--delivery-retries", "3", "--delivery-retry-wait", "2")
    logs = [tmp_path / f"schedule-{n}.log" for n in range(3)]
    with FaultServer() as stub, Hook() as hook:
        hook.status = 500
        _run_schedule(tmp_path, db_url, stub.base_url, hook.url, at, logs[0], args,
                      lambda: len(hook.posts) == 2)  # fmt: skip
        hook.status = 200
        started = time.monotonic()
        _run_schedule(tmp_path, db_url, stub.base_url, hook.url, past, logs[1], args,
                      lambda: len(hook.posts) == 3)  # fmt: skip
        assert hook.times[2] - hook.times[1] >= 3.9  # the count went on: 2 failures, 4 s
        _run_schedule(tmp_path, db_url, stub.base_url, hook.url, past, logs[2], args,
                      lambda: "next run" in logs[2].read_text(), linger=3.0)  # fmt: skip
        requests = len(stub.requests)
    assert time.monotonic() - started < WAIT_S
    assert len(hook.posts) == 3 and requests == 8, [p.read_text() for p in logs]
    assert _rows(db_url) == [("webhook", "failed")] * 2 + [("webhook", "sent")]
    assert f"delivery of {day}: next attempt at" in logs[1].read_text()
    assert "next attempt" not in logs[2].read_text()
    engine = open_database(db_url)
    with engine.connect() as conn:
        runs = conn.execute(text("SELECT status FROM runs")).scalars().all()
    engine.dispose()
    assert runs == ["succeeded"]  # the restarts ran no night


def test_a_target_longer_than_its_column_is_found_as_recorded(tmp_path, db_url):
    """The table keeps a target's first 500 characters; the lookup that says "already sent"
    must cut the same way, or every rerun and retry sends the digest again."""
    with FaultServer() as stub:
        run_digest(options(tmp_path, db_url, stub.base_url))
    store = DigestStore(open_database(db_url))
    long_name = ", ".join(f"reader{n}@example.org" for n in range(40))
    assert len(long_name) > 500
    store.record_delivery(DAY, "email", long_name, "fingerprint", None)
    assert store.delivered(DAY, "email", long_name, "fingerprint")
    assert not store.delivered(DAY, "email", long_name, "other fingerprint")
