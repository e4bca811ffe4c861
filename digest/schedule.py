"""`nightshift digest schedule`: a long-running process that runs the digest every night.

APScheduler's cron trigger fires at the configured local time; a firing missed while the process
was down (or busy) still runs if it is late by less than the misfire grace time, and several missed
firings coalesce into one run. Two schedulers (a standby, a second host) are safe: each run takes
the job lock in the database, and the one that finds it held skips.

SIGTERM (systemd's stop) or Ctrl-C ends the scheduler with exit 0. A run in progress is abandoned,
not awaited: every result is already stored, so the next run of that date does only what is left.

A night whose delivery failed (the mail server down, a webhook answering 500) is delivered again
by one-off jobs at the times digest/delivery/retry.py reads from the deliveries table: bounded
attempts with a doubling wait, each under the job lock, sending only the stored digest to the
targets that have not received it. A scheduler started again picks up every night's pending
retries where the table left them."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import date, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.schedulers.blocking import BlockingScheduler
from apscheduler.triggers.cron import CronTrigger

from digest.delivery.retry import DeliveryRetries, RetryPolicy
from digest.pipeline import RunHandle, RunOptions, run_digest
from digest.run_report import RunReport
from digest.store.job_lock import LockHeld

log = logging.getLogger(__name__)


class ScheduleError(ValueError):
    """A bad --at or --timezone."""


@dataclass(slots=True)
class ScheduleOptions:
    at: str = "02:00"  # HH:MM[:SS] local time
    timezone: str = "UTC"
    misfire_grace_s: int = 3600
    delivery_retry: RetryPolicy = field(default_factory=RetryPolicy)


def parse_at(at: str) -> tuple[int, int, int]:
    """HH:MM or HH:MM:SS (seconds let a test, or an impatient operator, fire it right away)."""
    parts = at.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        hour, minute, second = (int(part) for part in [*parts, "0"][:3])
    except ValueError:
        raise ScheduleError(f"--at must be HH:MM or HH:MM:SS, not {at!r}") from None
    if not (0 <= hour < 24 and 0 <= minute < 60 and 0 <= second < 60):
        raise ScheduleError(f"--at must be a time of day, not {at!r}")
    return hour, minute, second


def zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        message = f"unknown --timezone {name!r} (an IANA name like Europe/Berlin)"
        raise ScheduleError(message) from None


@dataclass(slots=True)
class NightlyJob:
    """The scheduled job: the digest of yesterday (in the schedule's timezone); a run that finds
    the lock held by another scheduler is skipped, not queued."""

    base: RunOptions
    tz: ZoneInfo
    today: Callable[[], date] | None = None
    # Set while a run is in progress: a stop then exits without waiting for it.
    running: threading.Event = field(default_factory=threading.Event)
    current: RunHandle | None = None  # the run in progress, to end it on a stop
    retries: DeliveryRetries | None = None  # a failed delivery's retries (build_scheduler)

    def __call__(self) -> RunReport | None:
        day = (self.today() if self.today else datetime.now(self.tz).date()) - timedelta(days=1)
        self.current = RunHandle()
        self.running.set()
        try:
            report = run_digest(replace(self.base, digest_date=day), handle=self.current)
        except LockHeld as exc:
            log.warning("skipping the %s run: %s", day.isoformat(), exc)
            return None
        except Exception:
            # The scheduler must outlive a bad night; the failure is in the runs table and log.
            log.exception("the digest run for %s failed", day.isoformat())
            return None
        finally:
            self.running.clear()
            self.current = None
        for line in report.lines():
            log.info("%s", line)
        if report.delivery_failed and self.retries is not None:
            try:
                self.retries.arm(day)
            except Exception:
                log.exception("could not schedule the delivery retry of %s", day.isoformat())
        return report


def nightly_job(
    base: RunOptions,
    tz: ZoneInfo,
    today: Callable[[], date] | None = None,
    retries: DeliveryRetries | None = None,
) -> NightlyJob:
    return NightlyJob(base, tz, today, retries=retries)


def build_scheduler(base: RunOptions, options: ScheduleOptions) -> BlockingScheduler:
    hour, minute, second = parse_at(options.at)
    tz = zone(options.timezone)
    scheduler = BlockingScheduler(timezone=tz)
    retries = DeliveryRetries(base.db_url, base.delivery, options.delivery_retry, scheduler)
    scheduler.add_job(
        nightly_job(base, tz, retries=retries),
        CronTrigger(hour=hour, minute=minute, second=second, timezone=tz),
        id="nightly-digest",
        name="nightly digest",
        misfire_grace_time=options.misfire_grace_s,
        coalesce=True,
        max_instances=1,
    )
    return scheduler


def next_fire_time(scheduler: BlockingScheduler) -> datetime | None:
    """When the job fires next. A job added before start() has no `next_run_time` attribute in
    APScheduler 3.x (it is pending), so ask its trigger."""
    job = scheduler.get_job("nightly-digest")
    return job.trigger.get_next_fire_time(None, datetime.now(job.trigger.timezone))


def run_scheduler(scheduler: BlockingScheduler) -> None:
    """Block until SIGTERM or Ctrl-C, then stop the scheduler."""
    nightly: NightlyJob = scheduler.get_job("nightly-digest").func
    if nightly.retries is not None:
        try:
            nightly.retries.arm_pending()
        except Exception:  # the nights still run; their own failures are retried
            log.exception("could not look for a delivery to retry")

    def on_sigterm(_signum: int, _frame: object) -> None:
        raise SystemExit(0)  # unwinds the scheduler's wait in the main thread

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        scheduler.start()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        if scheduler.running:
            scheduler.shutdown(wait=False)
    if nightly.running.is_set():
        # The run's worker thread would hold the interpreter's exit until the run ends (hours);
        # its results are stored, so leaving it is safe. A local server dies with the process.
        # The run is ended as `digest run` ends one on SIGTERM: failed, the lock released.
        log.warning("digest scheduler stopped during a run; rerun that date to finish it")
        if (current := nightly.current) is not None:
            try:
                current.abandon("Terminated: stopped by SIGTERM")
            except Exception:  # the database went away too: the lease still runs out
                log.exception("could not record the stopped run")
        logging.shutdown()
        os._exit(0)
    log.info("digest scheduler stopped")
