"""The nightly scheduler: its trigger, yesterday's date, and one run at a time across schedulers."""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import timedelta
from zoneinfo import ZoneInfo

import pytest
from apscheduler.triggers.cron import CronTrigger

from digest.schedule import ScheduleError, ScheduleOptions, build_scheduler, nightly_job
from digest.store import migrate
from digest.store.database import open_database
from digest.store.digest_store import DigestStore
from digest.store.job_lock import JobLock
from tests.digest.fault_server import Fault, FaultServer
from tests.digest.test_pipeline import DAY, options


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
