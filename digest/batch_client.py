"""The digest's side of an OpenAI-compatible Batch API (ours, or a cloud provider's): upload a
JSONL file, create a batch, poll it with a growing interval, download the output and error files.
Transient failures (connect errors, timeouts, 429, 5xx) are retried with capped backoff; a
refusal (another 4xx) is a BatchAPIError naming what the server said."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})


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

    async def upload(self, filename: str, data: bytes) -> str:
        reply = await self._call(
            "POST",
            "files",
            missing_ok=True,
            files={"file": (filename, data)},
            data={"purpose": "batch"},
        )
        if reply is None:
            raise BatchAPIError(
                f"{self.config.base_url} has no Batch API (POST /files: 404); start our server "
                "with --enable-batch-api, or run with --via stream"
            )
        return reply.json()["id"]

    async def create(self, file_id: str, endpoint: str, window: str, metadata: dict) -> dict:
        body = {
            "input_file_id": file_id,
            "endpoint": endpoint,
            "completion_window": window,
            "metadata": metadata,
        }
        return (await self._call("POST", "batches", json=body)).json()

    async def retrieve(self, batch_id: str) -> dict | None:
        """The batch, or None when the server does not know it (another server, a reset one)."""
        reply = await self._call("GET", f"batches/{batch_id}", missing_ok=True)
        return None if reply is None else reply.json()

    async def content(self, file_id: str | None) -> bytes:
        if not file_id:
            return b""
        return (await self._call("GET", f"files/{file_id}/content")).content

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
        self, method: str, path: str, *, missing_ok: bool = False, **kwargs
    ) -> httpx.Response | None:
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


def _message(reply: httpx.Response) -> str:
    try:
        error = reply.json().get("error")
    except (ValueError, AttributeError):
        return reply.text[:300]
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return reply.text[:300]
