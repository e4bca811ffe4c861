"""The nightly scheduler: its trigger, yesterday's date, and one run at a time across schedulers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from apscheduler.triggers.cron import CronTrigger

from digest.schedule import ScheduleError, ScheduleOptions, build_scheduler, nightly_job
from digest.store import migrate
from digest.store.database import open_database
from digest.store.digest_store import DigestStore
from digest.store.job_lock import JobLock
from tests.digest.fault_server import Fault, FaultServer
from tests.digest.test_pipeline import DAY, options, write_papers


def test_trigger_is_a_daily_cron_with_grace_and_coalescing(tmp_path, sqlite_url):
    base = options(tmp_path, sqlite_url, "http://127.0.0.1:9/v1")
    scheduler = build_scheduler(base, ScheduleOptions("02:30", "Europe/Berlin", 1800))
    (job,) = scheduler.get_jobs()
    assert isinstance(job.trigger, CronTrigger)
    fields = {f.name: str(f) for f in job.trigger.fields}
    assert (fields["hour"], fields["minute"], fields["second"]) == ("2", "30", "0")
    assert job.trigger.timezone == ZoneInfo("Europe/Berlin")
    assert (job.misfire_grace_time, job.coalesce, job.max_instances) == (1800, True, 1)
    with pytest.raises(ScheduleError, match="HH:MM"):
        build_scheduler(base, ScheduleOptions("2am"))
    with pytest.raises(ScheduleError, match="unknown --timezone"):
        build_scheduler(base, ScheduleOptions("02:00", "Mars/Olympus"))


def test_the_job_digests_yesterday(tmp_path, sqlite_url):
    with FaultServer() as stub:
        base = options(tmp_path, sqlite_url, stub.base_url)
        job = nightly_job(base, ZoneInfo("UTC"), today=lambda: DAY + timedelta(days=1))
        report = job()
    assert report is not None and report.digest_date == DAY and report.papers_done == 4


def test_two_schedulers_never_run_at_once(tmp_path, sqlite_url):
    migrate.upgrade(open_database(sqlite_url))
    # A run holding the lock makes the other scheduler's job skip, not wait or run twice.
    held = JobLock(open_database(sqlite_url))
    held.acquire()
    base = options(tmp_path, sqlite_url, "http://127.0.0.1:9/v1")
    assert nightly_job(base, ZoneInfo("UTC"), today=lambda: DAY)() is None
    held.release()

    # Two jobs started together against a slow server: exactly one runs the digest.
    results: list = []
    with FaultServer(faults=[Fault("hang", delay_s=0.5, times=-1)]) as stub:
        jobs = [
            nightly_job(
                replace(options(tmp_path, sqlite_url, stub.base_url)),
                ZoneInfo("UTC"),
                today=lambda: DAY + timedelta(days=1),
            )
            for _ in range(2)
        ]
        threads = [threading.Thread(target=lambda j=j: results.append(j())) for j in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        requests = len(stub.requests)
    assert sorted(r is None for r in results) == [False, True]
    assert requests == 8
    assert [r.status for r in DigestStore(open_database(sqlite_url)).runs_for(DAY)] == ["succeeded"]


def _schedule_cli(tmp_path, db_url: str, base_url: str, at: str, log) -> subprocess.Popen:
    papers = write_papers(tmp_path / "papers.jsonl")
    cmd = [
        sys.executable,
        "-m",
        "nightshift.cli",
        "digest",
        "schedule",
        "--at",
        at,
        "--timezone",
        "UTC",
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
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def test_schedule_starts_fires_the_job_and_stops_on_sigterm(tmp_path, sqlite_url):
    # The real command with the installed APScheduler: a job due a few seconds from now runs the
    # digest of yesterday (UTC), then SIGTERM stops the scheduler cleanly.
    fire = (datetime.now(UTC) + timedelta(seconds=6)).replace(microsecond=0)
    at = fire.strftime("%H:%M:%S")
    yesterday = fire.date() - timedelta(days=1)
    log_path = tmp_path / "schedule.log"
    with FaultServer() as stub, log_path.open("wb") as log:
        proc = _schedule_cli(tmp_path, sqlite_url, stub.base_url, at, log)
        try:
            page = tmp_path / "out" / f"digest-{yesterday}.html"
            deadline = time.monotonic() + 60
            while "succeeded" not in log_path.read_text() and time.monotonic() < deadline:
                assert proc.poll() is None, log_path.read_text()
                time.sleep(0.1)
            output = log_path.read_text()
            assert f"digest {yesterday} (run 1): succeeded" in output, output
            assert page.exists() and len(stub.requests) == 8
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0, log_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
    output = log_path.read_text()
    assert f"next run {fire.isoformat()}" in output, output
    assert "digest scheduler stopped" in output and "Traceback" not in output, output


def test_sigterm_during_a_run_stops_the_scheduler_at_once(tmp_path, sqlite_url):
    at = (datetime.now(UTC) + timedelta(seconds=6)).strftime("%H:%M:%S")
    log_path = tmp_path / "schedule.log"
    with (
        FaultServer(faults=[Fault("hang", delay_s=30, times=-1)]) as stub,
        log_path.open("wb") as log,
    ):
        proc = _schedule_cli(tmp_path, sqlite_url, stub.base_url, at, log)
        try:
            deadline = time.monotonic() + 60
            while not stub.requests and time.monotonic() < deadline:
                assert proc.poll() is None, log_path.read_text()
                time.sleep(0.1)
            assert stub.requests, log_path.read_text()
            proc.send_signal(signal.SIGTERM)
            # Not held until the hanging calls time out: the stored results make a rerun resume.
            assert proc.wait(timeout=10) == 0, log_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
    assert "stopped during a run" in log_path.read_text()
    # Ended as `digest run` ends on SIGTERM: the run failed, the lock free for the next run.
    from sqlalchemy import text

    from digest.store.database import open_database

    engine = open_database(sqlite_url)
    with engine.connect() as conn:
        runs = conn.execute(text("SELECT status, error FROM runs")).all()
        locks = conn.execute(text("SELECT holder FROM job_locks")).all()
    engine.dispose()
    assert runs == [("failed", "Terminated: stopped by SIGTERM")] and locks == [], (runs, locks)
