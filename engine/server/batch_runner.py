"""Runs the batches in the store, in the server's own event loop: validating, then each line
through the app at the batch priority, at most `concurrency` lines of all batches at once, each
finished line appended to its journal as it ends; then finalizing into output and error files.

Resumable by construction: a batch's progress is its journals, so after a restart (a crash, a
kill -9) the runner picks up every batch left validating, in_progress, finalizing or cancelling,
reads back which custom_ids are done, and runs only the rest. Cancel aborts the lines in flight
(their requests leave the engine) and keeps what finished; expiry does the same and writes every
line that never ran to the error file as batch_expired, as OpenAI does."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

import httpx

from digest.store.job_lock import JobLock, LockHeld
from engine.server import batch_journal
from engine.server.batch_config import BatchConfig
from engine.server.batch_lines import run_line, succeeded, unrun_result
from engine.server.batch_schema import BatchRow
from engine.server.batch_store import BatchStore, as_utc, utcnow
from engine.server.batch_validate import BatchLine, LineError, parse_input

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often the store is looked at for batches nobody woke us for
# One runner per batch database: servers that share one (replicas on one PostgreSQL) all take
# files and batches, and one of them runs them. Its lease is renewed while it lives; a holder
# killed on this host is replaced at once, one on another host after the lease runs out.
RUNNER_LOCK, RUNNER_LEASE_S = "batch-runner", 60.0
RETRY_S = 5.0  # after a batch's driver failed (the database went away): try again then
EXPIRED = "This request could not be executed before the completion window expired."


@dataclass(slots=True)
class ActiveBatch:
    """A batch this process is running: its progress for /metrics, and what stops it."""

    batch_id: str
    total: int = 0
    completed: int = 0
    failed: int = 0
    running: set[asyncio.Task] = field(default_factory=set)
    stop_reason: str | None = None  # "cancelled" | "expired"
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    # Lines that ended without a journal entry (the disk refused the write): the batch must
    # not finish as if they had run; it is driven again, and they run again.
    unrecorded: list[BaseException] = field(default_factory=list)

    def stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
        self.stopped.set()
        for task in list(self.running):
            task.cancel()


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        new_client: Callable[[], httpx.AsyncClient],
        config: BatchConfig,
        served_model: str,
    ) -> None:
        self.store, self.config, self.served_model = store, config, served_model
        self._new_client = new_client
        self._client: httpx.AsyncClient | None = None
        self.active: dict[str, ActiveBatch] = {}
        self._drivers: dict[str, asyncio.Task] = {}
        self._supervisor: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self.lines_finished = {"completed": 0, "failed": 0, "expired": 0}
        self._lock = JobLock(store.engine, RUNNER_LOCK, lease_s=RUNNER_LEASE_S)
        self.holds_lock = False

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        self._client = self._new_client()
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(self.config.concurrency)
        self._supervisor = asyncio.create_task(self._supervise())

    async def stop(self) -> None:
        """The server is stopping: lines in flight are dropped (not journaled), to run again
        after the restart; every batch keeps its status."""
        lines = [t for batch in self.active.values() for t in batch.running]
        drivers = [t for t in (self._supervisor, *self._drivers.values()) if t is not None]
        # Drivers first: a driver whose lines ended under it would go on to finalize the batch.
        tasks = drivers + lines
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._client is not None:
            await self._client.aclose()
        if self.holds_lock:
            await asyncio.to_thread(self._lock.release)
            self.holds_lock = False

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def cancel(self, batch_id: str) -> bool:
        """Move the batch to cancelling; False when it had already ended."""
        moved = await asyncio.to_thread(
            self.store.update_batch,
            batch_id,
            ("validating", "in_progress", "finalizing"),
            status="cancelling",
            cancelling_at=utcnow(),
        )
        if not moved:
            row = await asyncio.to_thread(self.store.batch, batch_id)
            return row is not None and row.status == "cancelling"
        if (active := self.active.get(batch_id)) is not None:
            active.stop("cancelled")
        self.wake()
        return True

    async def _supervise(self) -> None:
        assert self._wake is not None
        while True:
            rows = []
            try:
                if not self.holds_lock:
                    await asyncio.to_thread(self._lock.acquire)
                    self.holds_lock = True
                    log.info("batch runner: running this database's batches")
                rows = await asyncio.to_thread(self.store.active_batches)
            except LockHeld:
                pass  # another server runs them; this one takes over if that one dies
            except Exception:  # noqa: BLE001 - the database is away; the next look may work
                log.exception("batch runner: cannot list the active batches")
            for row in rows:
                if row.id not in self._drivers:
                    task = asyncio.create_task(self._drive(row.id))
                    self._drivers[row.id] = task
                    task.add_done_callback(lambda _, i=row.id: self._drivers.pop(i, None))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            self._wake.clear()

    # -- one batch --------------------------------------------------------------------------

    async def _drive(self, batch_id: str) -> None:
        try:
            row = await asyncio.to_thread(self.store.batch, batch_id)
            if row is not None and row.status == "validating":
                await self._validate(row)
                row = await asyncio.to_thread(self.store.batch, batch_id)
            if row is None:
                return
            if row.status == "in_progress":
                await self._run(row)
            elif row.status == "finalizing":
                await self._finish(row.id, "completed")
            elif row.status == "cancelling":
                await self._finish(row.id, "cancelled")
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - logged; the batch stays as it was and is retried
            log.exception("batch %s: runner failed; retrying in %.0f s", batch_id, RETRY_S)
            await asyncio.sleep(RETRY_S)

    async def _validate(self, row: BatchRow) -> None:
        parsed = await self._parse(row)
        if isinstance(parsed, list) and parsed and isinstance(parsed[0], LineError):
            await self._fail(row.id, parsed)
            return
        await asyncio.to_thread(
            self.store.update_batch,
            row.id,
            ("validating",),
            status="in_progress",
            in_progress_at=utcnow(),
            total=len(parsed),
        )

    async def _parse(self, row: BatchRow) -> list[BatchLine] | list[LineError]:
        file = await asyncio.to_thread(self.store.file, row.input_file_id)
        if file is None:
            return [LineError("invalid_input_file", f"input file {row.input_file_id} is gone")]
        try:
            data = await asyncio.to_thread(self.store.file_path(file).read_bytes)
        except OSError as e:
            return [LineError("invalid_input_file", f"input file {file.id}: {e.strerror or e}")]
        parsed = await asyncio.to_thread(
            parse_input, data, row.endpoint, self.served_model, self.config.max_lines
        )
        return parsed.errors or parsed.lines

    async def _fail(self, batch_id: str, errors: list[LineError]) -> None:
        log.info("batch %s failed validation: %s", batch_id, errors[0].message)
        await asyncio.to_thread(
            self.store.update_batch,
            batch_id,
            ("validating", "in_progress"),
            status="failed",
            failed_at=utcnow(),
            errors=[e.as_json() for e in errors],
        )

    async def _run(self, row: BatchRow) -> None:
        parsed = await self._parse(row)
        if parsed and isinstance(parsed[0], LineError):
            await self._fail(row.id, parsed)  # the file or the model changed under the batch
            return
        lines: list[BatchLine] = parsed  # type: ignore[assignment]
        out, err = self.store.journal(row.id, "output"), self.store.journal(row.id, "errors")
        done_ok = await asyncio.to_thread(batch_journal.recover, out)
        done_failed = await asyncio.to_thread(batch_journal.recover, err)
        done = set(done_ok) | set(done_failed)
        active = ActiveBatch(row.id, len(lines), len(done_ok), len(done_failed))
        self.active[row.id] = active
        current = await asyncio.to_thread(self.store.batch, row.id)
        if current is not None and current.status == "cancelling":
            active.stop("cancelled")  # the cancel came before this batch was registered
        todo = [line for line in lines if line.custom_id not in done]
        if done:
            log.info("batch %s: resuming, %d of %d lines done", row.id, len(done), len(lines))
        expires_at = as_utc(row.expires_at)
        assert expires_at is not None
        left = (expires_at - utcnow()).total_seconds()
        timer = asyncio.get_running_loop().call_later(max(0.0, left), active.stop, "expired")
        try:
            await self._run_lines(row, active, todo)
        finally:
            timer.cancel()
            self.active.pop(row.id, None)
        if active.unrecorded and active.stop_reason != "cancelled":
            first = active.unrecorded[0]
            raise RuntimeError(
                f"{len(active.unrecorded)} lines ended unrecorded ({type(first).__name__}: "
                f"{first}); they run again"
            )
        if active.stop_reason == "expired":
            await self._write_unrun(row.id, lines)
            await self._finish(row.id, "expired")
        elif active.stop_reason == "cancelled":
            await self._finish(row.id, "cancelled")
        else:
            await asyncio.to_thread(
                self.store.update_batch,
                row.id,
                ("in_progress",),
                status="finalizing",
                finalizing_at=utcnow(),
            )
            await self._finish(row.id, "completed")

    async def _run_lines(self, row: BatchRow, active: ActiveBatch, todo: list[BatchLine]) -> None:
        for line in todo:
            if not await self._take_slot(active):
                break
            task = asyncio.create_task(self._line(row, active, line))
            active.running.add(task)
            task.add_done_callback(lambda t: (active.running.discard(t), self._release()))
        while active.running:
            await asyncio.gather(*active.running, return_exceptions=True)

    async def _take_slot(self, active: ActiveBatch) -> bool:
        """A slot for one more line, or False once the batch is stopped (cancel, expiry)."""
        assert self._slots is not None
        if active.stopped.is_set():
            return False
        take = asyncio.create_task(self._slots.acquire())
        stopped = asyncio.create_task(active.stopped.wait())
        await asyncio.wait({take, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not take.done():
            take.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await take
        if take.done() and not take.cancelled():
            if not active.stopped.is_set():
                return True
            self._release()
        return False

    def _release(self) -> None:
        assert self._slots is not None
        self._slots.release()

    async def _line(self, row: BatchRow, active: ActiveBatch, line: BatchLine) -> None:
        assert self._client is not None
        result = await run_line(self._client, row.endpoint, line, self.config.priority)
        ok = succeeded(result)
        # Journaled before anything else can interrupt: a finished line is never run again.
        try:
            batch_journal.append(self.store.journal(row.id, "output" if ok else "errors"), result)
        except OSError as e:
            log.error("batch %s: line %s ran but cannot be recorded: %s", row.id, line.line, e)
            active.unrecorded.append(e)
            return
        if ok:
            active.completed += 1
        else:
            active.failed += 1
        self.lines_finished["completed" if ok else "failed"] += 1
        # The journal is the truth; the record's counts follow it (recounted when finishing).
        await asyncio.to_thread(self.store.count_line, row.id, ok)

    async def _write_unrun(self, batch_id: str, lines: list[BatchLine]) -> None:
        out, err = self.store.journal(batch_id, "output"), self.store.journal(batch_id, "errors")
        done = set(batch_journal.recover(out)) | set(batch_journal.recover(err))
        for line in lines:
            if line.custom_id not in done:
                batch_journal.append(err, unrun_result(line, "batch_expired", EXPIRED))
                self.lines_finished["expired"] += 1

    async def _finish(self, batch_id: str, status: str) -> None:
        """The journals become the output and error files; counts are recounted from them."""
        await asyncio.to_thread(self._finish_sync, batch_id, status)
        log.info("batch %s %s", batch_id, status)

    def _finish_sync(self, batch_id: str, status: str) -> None:
        row = self.store.batch(batch_id)
        if row is None:
            return
        if status == "completed" and row.status == "cancelling":
            status = "cancelled"  # the cancel came while the last lines finished
        files = {}
        counts = {}
        for kind, column in (("output", "completed"), ("errors", "failed")):
            path = self.store.journal(batch_id, kind)
            ids = batch_journal.recover(path)
            batch_journal.sync(path)
            counts[column] = len(ids)
            if ids:
                file_id = f"file-{batch_id.removeprefix('batch_')}-{kind}"
                name = f"{batch_id}_{kind}.jsonl"
                files[f"{'output' if kind == 'output' else 'error'}_file_id"] = (
                    self.store.adopt_file(file_id, "batch_output", name, path).id
                )
        now: datetime = utcnow()
        source = ("finalizing", "cancelling") if status != "expired" else ("in_progress",)
        if status == "cancelled":
            source = ("cancelling", "finalizing")
        self.store.update_batch(
            batch_id, source, status=status, **{f"{status}_at": now}, **counts, **files
        )
