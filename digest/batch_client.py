"""The digest's side of an OpenAI-compatible Batch API (ours, or a cloud provider's): upload a
JSONL file, create a batch, poll it with a growing interval, download the output and error files.
Transient failures (connect errors, timeouts, 429, 5xx) are retried with capped backoff; a
refusal (another 4xx) is a BatchAPIError naming what the server said."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
PAGE, MAX_PAGES = 100, 1000  # list pages (OpenAI's batches list allows 1 to 100 per page)
Recheck = Callable[[], Awaitable[dict | None]]


@dataclass(slots=True)
class BatchClientConfig:
    base_url: str  # like "http://127.0.0.1:8000/v1"
    api_key: str | None = None
    timeout_s: float = 120.0  # one HTTP call (an upload of a night's requests)
    max_retries: int = 5
    backoff_s: float = 1.0
    poll_s: float = 10.0  # the first wait between two looks at the batch
    max_poll_s: float = 300.0  # the interval doubles up to this
    wait_s: float = 26 * 3600.0  # give up waiting after this long (a 24 h window, and some)


class BatchAPIError(Exception):
    """The Batch API refused a call, or the batch did not end in time."""


class BatchClient:
    def __init__(self, config: BatchClientConfig) -> None:
        self.config = config
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._http = httpx.AsyncClient(
            base_url=config.base_url.rstrip("/") + "/", headers=headers, timeout=config.timeout_s
        )

    async def __aenter__(self) -> BatchClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def upload(self, filename: str, data: bytes, recheck: Recheck | None = None) -> str:
        """The new file's id. `recheck` is asked before each retry: an upload whose reply was
        lost may have been stored, and a file it finds is used instead of a second upload."""
        reply = await self._call(
            "POST",
            "files",
            missing_ok=True,
            recheck=recheck,
            files={"file": (filename, data)},
            data={"purpose": "batch"},
        )
        if reply is None:
            raise BatchAPIError(
                f"{self.config.base_url} has no Batch API (POST /files: 404); start our server "
                "with --enable-batch-api, or run with --via stream"
            )
        return (reply if isinstance(reply, dict) else reply.json())["id"]

    async def create(
        self,
        file_id: str,
        endpoint: str,
        window: str,
        metadata: dict,
        recheck: Recheck | None = None,
    ) -> dict:
        """The new batch. A create is not idempotent: before each retry `recheck` looks for
        the batch the lost attempt may have made (by its metadata), and returns it if found."""
        body = {
            "input_file_id": file_id,
            "endpoint": endpoint,
            "completion_window": window,
            "metadata": metadata,
        }
        reply = await self._call("POST", "batches", recheck=recheck, json=body)
        return reply if isinstance(reply, dict) else reply.json()

    async def find(
        self,
        kind: str,
        match: Callable[[dict], bool],
        since: float,
        params: dict | None = None,
    ) -> list[dict]:
        """The objects of a list route ("batches", "files") that `match`, newest first, paging
        with `after` until one older than `since` (a Unix time) or the end. A server that
        cannot list them is logged and answers nothing found."""
        found: list[dict] = []
        after: str | None = None
        for _ in range(MAX_PAGES):
            query = {"limit": PAGE, **(params or {})} | ({"after": after} if after else {})
            try:
                reply = await self._call("GET", kind, missing_ok=True, params=query)
            except BatchAPIError as e:
                log.warning("cannot list %s to look for an earlier attempt's: %s", kind, e)
                return found
            page = _json(reply) if reply is not None else None
            data = page.get("data") if isinstance(page, dict) else None
            if not isinstance(data, list):
                return found
            for obj in data:
                if not isinstance(obj, dict):
                    continue
                created = obj.get("created_at")
                if isinstance(created, int | float) and created < since:
                    return found
                if match(obj):
                    found.append(obj)
            last = data[-1].get("id") if data and isinstance(data[-1], dict) else None
            if not page.get("has_more") or not last or last == after:
                return found
            after = last
        return found

    async def retrieve(self, batch_id: str) -> dict | None:
        """The batch, or None when the server does not know it (another server, a reset one)."""
        reply = await self._call("GET", f"batches/{batch_id}", missing_ok=True)
        return None if reply is None else reply.json()

    async def content(self, file_id: str | None) -> bytes | None:
        """The file's bytes (none for no file); None when the server no longer has it."""
        if not file_id:
            return b""
        reply = await self._call("GET", f"files/{file_id}/content", missing_ok=True)
        return None if reply is None else reply.content

    async def wait(self, batch_id: str) -> dict:
        """Poll until the batch ends: the first look after poll_s, each next one twice as late,
        up to max_poll_s; BatchAPIError after wait_s."""
        deadline = time.monotonic() + self.config.wait_s
        delay = self.config.poll_s
        while True:
            batch = await self.retrieve(batch_id)
            if batch is None:
                raise BatchAPIError(f"batch {batch_id}: the server no longer knows it")
            if batch.get("status") in TERMINAL:
                return batch
            counts = batch.get("request_counts") or {}
            log.info(
                "batch %s %s: %s of %s requests done",
                batch_id,
                batch.get("status"),
                (counts.get("completed") or 0) + (counts.get("failed") or 0),
                counts.get("total"),
            )
            if time.monotonic() + delay > deadline:
                raise BatchAPIError(
                    f"batch {batch_id} still {batch.get('status')} after "
                    f"{self.config.wait_s:.0f} s; the next run resumes waiting for it"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.config.max_poll_s)

    async def _call(
        self,
        method: str,
        path: str,
        *,
        missing_ok: bool = False,
        recheck: Recheck | None = None,
        **kwargs,
    ) -> httpx.Response | dict | None:
        """The reply; with `recheck`, what it finds before a retry instead (a dict)."""
        attempt = 0
        while True:
            attempt += 1
            try:
                reply = await self._http.request(method, path, **kwargs)
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as e:
                problem = f"{type(e).__name__}: {e}"
            else:
                if reply.status_code == 404 and missing_ok:
                    return None
                if reply.status_code < 400:
                    return reply
                problem = f"HTTP {reply.status_code}: {_message(reply)}"
                if reply.status_code not in (408, 409, 429) and reply.status_code < 500:
                    raise BatchAPIError(f"{method} {path}: {problem}")
            if attempt > self.config.max_retries:
                raise BatchAPIError(f"{method} {path}: {problem} (after {attempt} attempts)")
            delay = min(self.config.backoff_s * 2 ** (attempt - 1), 60.0)
            log.warning("%s %s: %s; retrying in %.1f s", method, path, problem, delay)
            await asyncio.sleep(delay)
            if recheck is not None and (found := await recheck()) is not None:
                log.info("%s %s: the lost attempt took effect (%s)", method, path, found.get("id"))
                return found


def _json(reply: httpx.Response) -> object:
    try:
        return reply.json()
    except ValueError:
        return None


def _message(reply: httpx.Response) -> str:
    try:
        error = reply.json().get("error")
    except (ValueError, AttributeError):
        return reply.text[:300]
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return reply.text[:300]
