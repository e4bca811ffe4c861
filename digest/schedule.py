"""`nightshift digest schedule`: a long-running process that runs the digest every night.

APScheduler's cron trigger fires at the configured local time; a firing missed while the process
was down (or busy) still runs if it is late by less than the misfire grace time, and several missed
firings coalesce into one run. Two schedulers (a standby, a second host) are safe: each run takes
the job lock in the database, and the one that finds it held skips."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import date, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.schedulers.blocking import BlockingScheduler
from apscheduler.triggers.cron import CronTrigger

from digest.pipeline import RunOptions, run_digest
from digest.run_report import RunReport
from digest.store.job_lock import LockHeld

log = logging.getLogger(__name__)


class ScheduleError(ValueError):
    """A bad --at or --timezone."""


@dataclass(slots=True)
class ScheduleOptions:
    at: str = "02:00"  # HH:MM local time
    timezone: str = "UTC"
    misfire_grace_s: int = 3600


def parse_at(at: str) -> tuple[int, int]:
    try:
        hour, minute = (int(part) for part in at.split(":"))
    except ValueError:
        raise ScheduleError(f"--at must be HH:MM, not {at!r}") from None
    if not (0 <= hour < 24 and 0 <= minute < 60):
        raise ScheduleError(f"--at must be a time of day, not {at!r}")
    return hour, minute


def zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        message = f"unknown --timezone {name!r} (an IANA name like Europe/Berlin)"
        raise ScheduleError(message) from None


def nightly_job(
    base: RunOptions, tz: ZoneInfo, today: Callable[[], date] | None = None
) -> Callable[[], RunReport | None]:
    """The scheduled job: the digest of yesterday (in the schedule's timezone); a run that finds
    the lock held by another scheduler is skipped, not queued."""

    def job() -> RunReport | None:
        day = (today() if today else datetime.now(tz).date()) - timedelta(days=1)
        try:
            report = run_digest(replace(base, digest_date=day))
        except LockHeld as exc:
            log.warning("skipping the %s run: %s", day.isoformat(), exc)
            return None
        except Exception:
            # The scheduler must outlive a bad night; the failure is in the runs table and log.
            log.exception("the digest run for %s failed", day.isoformat())
            return None
        for line in report.lines():
            log.info("%s", line)
        return report

    return job


def build_scheduler(base: RunOptions, options: ScheduleOptions) -> BlockingScheduler:
    hour, minute = parse_at(options.at)
    tz = zone(options.timezone)
    scheduler = BlockingScheduler(timezone=tz)
    scheduler.add_job(
        nightly_job(base, tz),
        CronTrigger(hour=hour, minute=minute, timezone=tz),
        id="nightly-digest",
        name="nightly digest",
        misfire_grace_time=options.misfire_grace_s,
        coalesce=True,
        max_instances=1,
    )
    return scheduler
