"""`digest run --via batch`: the night's summary and review requests as one Batch API batch
(our server's /v1/batches, or a cloud provider's), polled until it ends, then each reply stored
exactly as a streamed one is (paper_results.py: the same tables, a call record per request with
its token counts).

The batch id is recorded on the run as soon as the batch exists. A run that starts after a run
of the same date died (or failed) polls that batch instead of submitting the night again, keeps
its successful replies, and submits only what is still missing, as a new batch."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import UTC, date, datetime

from digest.batch_client import BatchClient, BatchClientConfig
from digest.chat_client import ChatCallError, ChatResult
from digest.endpoint import Endpoint
from digest.paper_results import (
    PaperInput,
    Unparsed,
    fill_call,
    has_review,
    new_call,
    set_outcome,
    store_review,
    store_summary,
    work_key,
)
from digest.progress import ProgressSink
from digest.prompts import (
    REVIEW_FREQUENCY_PENALTY,
    REVIEW_MAX_TOKENS,
    SUMMARY_MAX_TOKENS,
    paper_block,
    review_messages,
    summary_messages,
)
from digest.review_parse import review_response_format
from digest.store.digest_store import DigestStore

log = logging.getLogger(__name__)

ENDPOINT = "/v1/chat/completions"
KINDS = ("summary", "review")  # a paper's summary is stored before its review, as streamed


@dataclass(frozen=True, slots=True)
class BatchRequest:
    custom_id: str
    item: PaperInput
    kind: str
    body: dict


@dataclass(frozen=True, slots=True)
class BatchReply:
    """One line of the output or error file, with the batch it came from."""

    line: dict
    batch: dict


@dataclass(slots=True)
class BatchPlan:
    store: DigestStore
    endpoint: Endpoint
    client_config: BatchClientConfig
    window: str
    run_id: int
    day: date

    async def run(self, work: list[PaperInput], progress: ProgressSink | None) -> None:
        requests = {r.custom_id: r for r in self.requests(work)}
        replies: dict[str, BatchReply] = {}
        async with BatchClient(self.client_config) as client:
            resumed = self.store.batch_to_resume(self.day, self.run_id)
            if resumed is not None:
                replies |= await self._resume(client, resumed, requests)
            pending = [r for cid, r in requests.items() if cid not in replies]
            if pending:
                replies |= await self._submit(client, pending)
        if progress:
            progress.start(len(work))
        for item in work:
            outcome = self._store(item, requests, replies)
            if progress:
                progress.advance(item.paper.arxiv_id, outcome)

    def requests(self, work: list[PaperInput]) -> list[BatchRequest]:
        """The calls still missing: a summary where none is stored, a review where none
        validated. Bodies as the streaming client sends them, without streaming."""
        out = []
        for item in work:
            key = work_key(self.endpoint.model, item.basis)
            pid = item.paper.arxiv_id
            block = paper_block(item.paper, item.basis, item.text, item.truncated)
            if self.store.summary(pid, key) is None:
                body = self._body(summary_messages(block), SUMMARY_MAX_TOKENS)
                out.append(BatchRequest(_custom_id("summary", item), item, "summary", body))
            if not has_review(self.store, pid, key):
                body = self._body(review_messages(block, item.basis), REVIEW_MAX_TOKENS)
                body["response_format"] = review_response_format()
                body["frequency_penalty"] = REVIEW_FREQUENCY_PENALTY
                out.append(BatchRequest(_custom_id("review", item), item, "review", body))
        return out

    def _body(self, messages: list[dict], max_tokens: int) -> dict:
        return {
            "model": self.endpoint.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "seed": 0,
        }

    async def _resume(
        self, client: BatchClient, batch_id: str, requests: dict[str, BatchRequest]
    ) -> dict[str, BatchReply]:
        """The successful replies of an earlier run's batch, waited for if it still runs. Its
        failed lines are asked again (in the new batch): they were recorded by the run that
        collected them, or never collected, and either way a rerun is what a rerun is for."""
        batch = await client.retrieve(batch_id)
        if batch is None:
            log.info("batch %s of the previous run is unknown to the server; submitting", batch_id)
            return {}
        lines = (await client.content(batch.get("input_file_id"))).splitlines()
        asked = {line.get("custom_id") for raw in lines if (line := _json_object(raw))}
        if not asked & requests.keys():
            return {}
        log.info("resuming batch %s of the previous run (%s)", batch_id, batch.get("status"))
        self.store.set_run_batch(self.run_id, batch_id)
        replies = await self._collect(client, await client.wait(batch_id))
        return {cid: r for cid, r in replies.items() if cid in requests and _succeeded(r.line)}

    async def _submit(
        self, client: BatchClient, pending: list[BatchRequest]
    ) -> dict[str, BatchReply]:
        data = b"".join(
            json.dumps(
                {"custom_id": r.custom_id, "method": "POST", "url": ENDPOINT, "body": r.body}
            ).encode()
            + b"\n"
            for r in pending
        )
        day = self.day.isoformat()
        file_id = await client.upload(f"digest-{day}-run{self.run_id}.jsonl", data)
        metadata = {"nightshift_digest_date": day, "nightshift_run": str(self.run_id)}
        batch = await client.create(file_id, ENDPOINT, self.window, metadata)
        # Recorded before the first poll: a run killed from here on resumes this batch.
        self.store.set_run_batch(self.run_id, batch["id"])
        log.info("submitted batch %s: %d requests", batch["id"], len(pending))
        return await self._collect(client, await client.wait(batch["id"]))

    async def _collect(self, client: BatchClient, batch: dict) -> dict[str, BatchReply]:
        replies = {}
        for file_id in (batch.get("output_file_id"), batch.get("error_file_id")):
            for raw in (await client.content(file_id)).splitlines():
                line = _json_object(raw)
                if line is None:
                    if raw.strip():
                        log.warning("batch %s: an unreadable result line skipped", batch["id"])
                    continue
                replies[line.get("custom_id")] = BatchReply(line, batch)
        return replies

    def _store(
        self, item: PaperInput, requests: dict[str, BatchRequest], replies: dict[str, BatchReply]
    ) -> str:
        key = work_key(self.endpoint.model, item.basis)
        error = None
        for kind in KINDS:
            request = requests.get(_custom_id(kind, item))
            if request is None:
                continue  # stored by an earlier run
            try:
                self._store_reply(request, replies.get(request.custom_id), key)
            except (ChatCallError, Unparsed) as exc:
                error = error or str(exc)
        return set_outcome(self.store, self.day, item, self.run_id, error)

    def _store_reply(self, request: BatchRequest, reply: BatchReply | None, key) -> None:
        item, kind = request.item, request.kind
        body = request.body
        call = new_call(
            self.run_id, item, kind, self.endpoint.model, self.endpoint.base_url, body["max_tokens"]
        )
        if reply is None or not _succeeded(reply.line):
            message = _failure(reply)
            call.status, call.error = "error", message
            call.started_at = _created(reply)
            call.latency_s = None
            self.store.record_call(call)
            raise ChatCallError(
                message, status_code=None, attempts=1, started_at=call.started_at, latency_s=0.0
            )
        result = _result(reply, self.endpoint.base_url)
        fill_call(call, result)
        call.latency_s = None  # a batch has no per-request latency; its times are the batch's
        if kind == "summary":
            store_summary(self.store, item, key, result, call, self.run_id)
        else:
            store_review(self.store, item, key, result, call, self.run_id)


def _custom_id(kind: str, item: PaperInput) -> str:
    return f"{kind}:{item.basis}:{item.paper.arxiv_id}"


def _json_object(raw: bytes) -> dict | None:
    try:
        value = json.loads(raw) if raw.strip() else None
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _succeeded(line: dict) -> bool:
    response = line.get("response") or {}
    return line.get("error") is None and response.get("status_code") == 200


def _created(reply: BatchReply | None) -> datetime:
    stamp = reply.batch.get("created_at") if reply is not None else None
    if isinstance(stamp, int | float):
        return datetime.fromtimestamp(stamp, UTC)
    return datetime.now(UTC)


def _failure(reply: BatchReply | None) -> str:
    if reply is None:
        return "the batch ended before this request ran"
    line, batch_id = reply.line, reply.batch.get("id")
    if line.get("error"):
        error = line["error"]
        return f"batch {batch_id}: {error.get('code')}: {error.get('message')}"
    response = line.get("response") or {}
    body = response.get("body") or {}
    message = body.get("error", {}).get("message") if isinstance(body, dict) else None
    return f"batch {batch_id}: HTTP {response.get('status_code')}: {message or body}"


def _result(reply: BatchReply, endpoint: str) -> ChatResult:
    body = reply.line["response"]["body"]
    choice = (body.get("choices") or [{}])[0]
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return ChatResult(
        text=(choice.get("message") or {}).get("content") or "",
        finish_reason=choice.get("finish_reason"),
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        cached_tokens=details.get("cached_tokens"),
        ttft_s=None,
        latency_s=0.0,
        started_at=_created(reply),
        attempts=1,
        endpoint=endpoint,
    )
