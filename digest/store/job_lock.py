"""Only one digest run at a time, even with two schedulers on two hosts: a lease row in the
database (not a PID file, which a second host cannot see).

Acquire inserts the row; the primary key makes a second insert fail. A holder renews its lease
while it works; a lease that expired (its holder died without releasing) may be taken over, and so
may one whose holder was a process on this host that no longer exists (kill -9), so that a rerun
need not wait for the lease to run out."""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine, delete, insert, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from digest.store.schema import JobLockRow

log = logging.getLogger(__name__)


class LockHeld(RuntimeError):
    """Another process holds the job lock."""


def _now() -> datetime:
    return datetime.now(UTC)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class JobLock:
    def __init__(self, engine: Engine, name: str = "digest-run", lease_s: float = 300.0) -> None:
        self.engine = engine
        self.name = name
        self.lease = timedelta(seconds=lease_s)
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lock or raise LockHeld naming the holder; then renew it in the background."""
        if not (self._insert() or self._take_over()):
            with self.engine.connect() as conn:
                row = conn.execute(select(JobLockRow).where(JobLockRow.name == self.name)).first()
            who = f"{row.holder} (lease until {row.expires_at})" if row else "another process"
            raise LockHeld(f"another digest run holds the lock: {who}")
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_loop, name="job-lock", daemon=True)
        self._renewer.start()

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        with self.engine.begin() as conn:
            conn.execute(
                delete(JobLockRow).where(
                    JobLockRow.name == self.name, JobLockRow.holder == self.holder
                )
            )

    def __enter__(self) -> JobLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _insert(self) -> bool:
        now = _now()
        row = {"name": self.name, "holder": self.holder, "acquired_at": now}
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(JobLockRow).values(**row, expires_at=now + self.lease))
        except IntegrityError:
            return False
        return True

    def _take_over(self) -> bool:
        """Replace a lease that expired or whose holder died on this host; the UPDATE's WHERE
        names the old holder, so two contenders cannot both win."""
        with self.engine.connect() as conn:
            row = conn.execute(select(JobLockRow).where(JobLockRow.name == self.name)).first()
        if row is None:
            return self._insert()
        if not (_as_utc(row.expires_at) < _now() or self._holder_dead(row.holder)):
            return False
        now = _now()
        with self.engine.begin() as conn:
            result = conn.execute(
                update(JobLockRow)
                .where(JobLockRow.name == self.name, JobLockRow.holder == row.holder)
                .values(holder=self.holder, acquired_at=now, expires_at=now + self.lease)
            )
        return result.rowcount == 1

    @staticmethod
    def _holder_dead(holder: str) -> bool:
        host, _, rest = holder.partition(":")
        pid = rest.partition(":")[0]
        return host == socket.gethostname() and pid.isdigit() and not _process_alive(int(pid))

    def _renew_loop(self) -> None:
        interval = self.lease.total_seconds() / 3
        while not self._stop.wait(interval):
            try:
                with self.engine.begin() as conn:
                    conn.execute(
                        update(JobLockRow)
                        .where(JobLockRow.name == self.name, JobLockRow.holder == self.holder)
                        .values(expires_at=_now() + self.lease)
                    )
            except SQLAlchemyError as exc:
                # A database hiccup: try again next interval; the lease outlives two misses.
                log.warning("could not renew the job lock: %s", exc)


def _as_utc(value: datetime) -> datetime:
    # SQLite hands back naive datetimes; they were written as UTC.
    return value if value.tzinfo else value.replace(tzinfo=UTC)
