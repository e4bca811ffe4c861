"""Retrying a night's failed delivery under `digest schedule`: bounded attempts with a doubling
wait, made as one-off scheduler jobs (digest/schedule.py arms the first after a night whose
email or webhook failed, and at start those an earlier scheduler left pending, every night's).

The `deliveries` table is the whole state. A target's attempts at the digest as it is now (its
fingerprint) are counted there, the night's included: a target is due again `wait_s(n)` after
its n-th failure while n is within the policy's retries, and never once a row says sent. So a
scheduler restarted between two attempts resumes the count instead of starting it over; each
attempt is made under the job lock and `deliver` skips a target the table says has this digest,
so two schedulers, or a `digest deliver` by hand, never send it twice (and count too).

Only the stored digest is sent: no model call, no page written."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from apscheduler.schedulers.base import BaseScheduler
from apscheduler.triggers.date import DateTrigger

from digest.delivery import DeliveryConfig, DeliveryOutcome, deliver, target_names
from digest.entries import DailyDigest
from digest.store import migrate
from digest.store.database import open_database
from digest.store.digest_store import TARGET_CHARS, DigestStore
from digest.store.job_lock import JobLock, LockHeld

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    retries: int = 4  # attempts after the night's; 0: none
    first_wait_s: float = 600.0  # after the first failure; doubled after each further one

    def wait_s(self, failures: int) -> float:
        return self.first_wait_s * 2 ** (failures - 1)


@dataclass(frozen=True, slots=True)
class TargetState:
    channel: str
    target: str
    sent: bool
    failures: int  # failed attempts at this version of the digest
    last_attempt: datetime | None

    def due_at(self, policy: RetryPolicy) -> datetime | None:
        """When this target is tried next; None: sent, never tried (no failure to retry), or
        out of attempts."""
        if self.sent or self.last_attempt is None or self.failures > policy.retries:
            return None
        return self.last_attempt + timedelta(seconds=policy.wait_s(self.failures))

    def exhausted(self, policy: RetryPolicy) -> bool:
        return not self.sent and self.failures > policy.retries


def target_states(
    store: DigestStore, digest: DailyDigest, config: DeliveryConfig
) -> list[TargetState]:
    """Each configured target's record of this version of the digest."""
    fingerprint = digest.fingerprint()
    rows = [r for r in store.deliveries(digest.digest_date) if r.content_hash == fingerprint]
    states = []
    for channel, target in target_names(config):
        mine = [r for r in rows if (r.channel, r.target) == (channel, target[:TARGET_CHARS])]
        failed = [_utc(r.attempted_at) for r in mine if r.status == "failed"]
        sent = any(r.status == "sent" for r in mine)
        states.append(TargetState(channel, target, sent, len(failed), max(failed, default=None)))
    return states


def next_attempt(states: list[TargetState], policy: RetryPolicy) -> datetime | None:
    """The earliest time a target is due again; None when none will be."""
    return min((at for s in states if (at := s.due_at(policy)) is not None), default=None)


def retry_due(
    store: DigestStore,
    digest: DailyDigest,
    config: DeliveryConfig,
    policy: RetryPolicy,
    now: datetime | None = None,
) -> list[DeliveryOutcome]:
    """Send the digest to the targets due by `now`; the others are left to their time."""
    now = now or datetime.now(UTC)
    due = {
        (s.channel, s.target)
        for s in target_states(store, digest, config)
        if (at := s.due_at(policy)) is not None and at <= now
    }
    return deliver(store, digest, config, only=due) if due else []


@dataclass(slots=True)
class DeliveryRetries:
    """The scheduler's side: per date, one pending one-off job at its next attempt's time."""

    db_url: str | None
    config: DeliveryConfig | None
    policy: RetryPolicy
    scheduler: BaseScheduler

    def arm(self, day: date) -> datetime | None:
        """Schedule the date's next attempt, if a target is due one; when, or None."""
        if self.config is None or self.policy.retries == 0:
            return None
        with _store(self.db_url) as store:
            digest = store.load_digest(day)
            states = target_states(store, digest, self.config) if digest else []
        when = next_attempt(states, self.policy)
        if when is not None:
            self._at(day, when)
        return when

    def arm_pending(self) -> list[date]:
        """At start: every night whose retries an earlier scheduler left pending (one stopped
        for days may have left several); the dates armed."""
        if self.config is None or self.policy.retries == 0:
            return []
        with _store(self.db_url, upgrade=True) as store:
            nights = store.dates_with_failed_deliveries()
        return [day for day in nights if self.arm(day) is not None]

    def attempt(self, day: date) -> None:
        """One attempt at the date's due targets, under the job lock (never beside a run or
        another scheduler's attempt); then the next one is armed, or giving up is said."""
        assert self.config is not None
        try:
            with _store(self.db_url) as store, JobLock(store.engine):
                digest = store.load_digest(day)
                if digest is None:
                    return
                outcomes = retry_due(store, digest, self.config, self.policy)
                states = target_states(store, digest, self.config)
        except LockHeld as exc:
            log.info("the delivery retry of %s waits: %s", day.isoformat(), exc)
            self._at(day, datetime.now(UTC) + timedelta(seconds=self.policy.first_wait_s))
            return
        except Exception:
            # The scheduler outlives a bad attempt (the database away): the next night runs.
            log.exception("the delivery retry of %s failed", day.isoformat())
            return
        tried = {(o.channel, o.target) for o in outcomes}
        for state in states:
            if state.exhausted(self.policy) and (state.channel, state.target) in tried:
                log.error(
                    "delivery by %s to %s: gave up after %d attempts; send it with "
                    "`nightshift digest deliver --date %s`",
                    state.channel,
                    state.target,
                    state.failures,
                    day.isoformat(),
                )
        when = next_attempt(states, self.policy)
        # A job that found nothing due (it fired early) waits for the due time; one that did
        # find nothing and would fire again at once must not loop.
        attempted = any(o.status in ("sent", "failed") for o in outcomes)
        if when is not None and (attempted or when > datetime.now(UTC)):
            self._at(day, when)

    def _at(self, day: date, when: datetime) -> None:
        self.scheduler.add_job(
            self.attempt,
            DateTrigger(run_date=when),
            args=[day],
            id=f"delivery-retry-{day.isoformat()}",
            name=f"delivery retry {day.isoformat()}",
            replace_existing=True,
            misfire_grace_time=None,  # late is better than never: the readers wait
        )
        log.info("delivery of %s: next attempt at %s", day.isoformat(), when.isoformat())


@contextmanager
def _store(db_url: str | None, upgrade: bool = False) -> Iterator[DigestStore]:
    """A store over a fresh engine, disposed on leaving (a scheduler lives for weeks)."""
    engine = open_database(db_url)
    try:
        if upgrade:
            migrate.upgrade(engine)
        yield DigestStore(engine)
    finally:
        engine.dispose()


def _utc(stamp: datetime) -> datetime:
    """A stored time (SQLite hands it back naive; it was stored in UTC)."""
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)
