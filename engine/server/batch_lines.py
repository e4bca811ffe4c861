"""One batch line run through the server's own routes, in process (httpx's ASGI transport): the
same validation, limits, response bodies and errors as a request over the network, at the batch
priority. The result is a line of OpenAI's output format:
{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

import httpx

from engine.server.batch_validate import BatchLine

# A full waiting queue (429) or an engine that is not taking requests now (503) says "later", not
# "no": the line waits and asks again, rather than failing a night's request on a busy minute.
# Cancel and expiry end the wait.
RETRY_STATUSES = frozenset({429, 503})
RETRY_S, MAX_RETRY_S = 0.25, 10.0

log = logging.getLogger(__name__)


def app_client(app, api_key: str | None) -> httpx.AsyncClient:
    """A client of `app` itself; app errors become 500 responses, as a live server sends them.
    No timeout: a line ends when the engine ends it (or the batch is cancelled or expires)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(
        transport=transport, base_url="http://batch.invalid", headers=headers, timeout=None
    )


async def run_line(
    client: httpx.AsyncClient, endpoint: str, line: BatchLine, priority: int
) -> dict:
    body = dict(line.body)
    # Never ahead of interactive traffic: a line may ask to wait longer, not to jump the queue.
    body["priority"] = max(int(body.get("priority") or 0), priority)
    delay = RETRY_S
    try:
        while (response := await client.post(endpoint, json=body)).status_code in RETRY_STATUSES:
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_RETRY_S)
    except Exception as e:  # noqa: BLE001 - a line that cannot be sent still ends in a result
        log.exception("batch line %s (custom_id %r) could not be sent", line.line, line.custom_id)
        message = f"the request could not be sent: {type(e).__name__}: {e}"
        return unrun_result(line, "request_failed", message)
    try:
        answer = response.json()
    except json.JSONDecodeError:
        answer = {"error": {"message": response.text[:1000], "type": "internal_server_error"}}
    request_id = answer.get("id") if isinstance(answer, dict) else None
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": line.custom_id,
        "response": {
            "status_code": response.status_code,
            "request_id": request_id or f"req_{uuid.uuid4().hex}",
            "body": answer,
        },
        "error": None,
    }


def succeeded(result: dict) -> bool:
    response = result.get("response") or {}
    return result.get("error") is None and 200 <= response.get("status_code", 0) < 300


def unrun_result(line: BatchLine, code: str, message: str) -> dict:
    """A line that never ran (the window expired): an error line, as OpenAI writes one."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": line.custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
