"""`digest run --via batch`: the night's summary and review requests as one Batch API batch
(our server's /v1/batches, or a cloud provider's), polled until it ends, then each reply stored
exactly as a streamed one is (paper_results.py: the same tables, a call record per request with
its token counts).

The batch id is recorded on the run as soon as the batch exists. A run that starts after a run
of the same date died (or failed) polls that batch instead of submitting the night again, keeps
its successful replies, and submits only what is still missing, as a new batch.

A run can die after the batch exists and before its id is recorded (or a create's reply can be
lost, and the create retried). So every batch carries metadata naming the job, the date, the run
and its input's sha256, and its input file is named by date and hash: the next run lists the
server's batches (paged, newest first, back to the dead runs' start) and resumes those of the
date's dead runs, recorded or not; it reuses their uploaded input rather than uploading it
again; and a create (or upload) retried after an error looks for what the lost attempt made
before trying again. A resumed batch's replies are used only where its request is exactly the
one this run would send (same custom_id, url and body: a changed model or prompt asks again).

A summary that loops (digest/repetition.py) is asked once more under the stronger penalty, as a
streamed run asks it: the looping papers' summaries go as a second, small batch, found again and
resumed exactly as the first is (a run that dies while it runs leaves both batches to the next,
which polls them rather than asking again). The other papers are stored before it is submitted.
The looping reply's call is recorded with the retry's result, in one transaction: a run that
dies in between records neither, so a resumed run records each call once."""

from __future__ import annotations

import hashlib
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
    SUMMARY_FREQUENCY_PENALTY,
    SUMMARY_MAX_TOKENS,
    SUMMARY_RETRY_FREQUENCY_PENALTY,
    paper_block,
    review_messages,
    summary_messages,
)
from digest.repetition import loops
from digest.review_parse import review_response_format
from digest.store.digest_store import CallRecord, DigestStore

log = logging.getLogger(__name__)

ENDPOINT = "/v1/chat/completions"
KINDS = ("summary", "review")  # a paper's summary is stored before its review, as streamed
RETRY = "summary-retry"  # the custom_id kind of a looping summary asked once more
JOB = "digest"  # the metadata's nightshift_job
DEAD = ("interrupted", "failed")  # runs whose unrecorded batches a later run looks for
# How far before a dead run's start a listing still looks: the server's clock may differ.
CLOCK_SLACK_S = 3600.0


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


@dataclass(frozen=True, slots=True)
class _Lookback:
    """Where earlier batches of the date may be: the dead runs (id -> start), the batches that
    finished runs consumed, how far back listings look, and this run's start (its metadata)."""

    dead: dict[str, str]
    consumed: frozenset[str]
    since: float
    started: str


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
        look = self._lookback()
        async with BatchClient(self.client_config) as client:
            replies = await self._answer(client, requests, look)
            if progress:
                progress.start(len(work))
            again = self._retries(requests, replies)
            looping = {r.item.paper.arxiv_id for r in again.values()}
            # The papers that need no second round are stored (and done) before it.
            self._store_all(
                [i for i in work if i.paper.arxiv_id not in looping], requests, replies, progress
            )
            if again:
                log.info("a second batch: the %d summaries that repeat themselves", len(again))
                replies |= await self._answer(client, again, look)
                requests |= again
                self._store_all(
                    [i for i in work if i.paper.arxiv_id in looping], requests, replies, progress
                )

    def _lookback(self) -> _Lookback:
        runs = {r.id: r for r in self.store.runs_for(self.day)}
        # A run is named by its id and start: run ids repeat across digest databases.
        dead = {
            str(i): _started(r)
            for i, r in runs.items()
            if i < self.run_id and r.status in DEAD and (r.params or {}).get("via") == "batch"
        }
        # Batches that finished runs consumed; the dead runs' are looked for, recorded or not.
        consumed = {r.batch_id for r in runs.values() if r.batch_id and str(r.id) not in dead}
        this_run = _started(runs[self.run_id])
        # Listings look back to the earliest dead run's start (or this run's), less the slack.
        starts = [datetime.fromisoformat(s).timestamp() for s in (this_run, *dead.values())]
        return _Lookback(dead, frozenset(consumed), min(starts) - CLOCK_SLACK_S, this_run)

    async def _answer(
        self, client: BatchClient, requests: dict[str, BatchRequest], look: _Lookback
    ) -> dict[str, BatchReply]:
        """The replies to `requests`: from the batches of the date's dead runs where they asked
        exactly these, the rest from a new batch, waited for."""
        replies: dict[str, BatchReply] = {}
        resumed = self.store.batch_to_resume(self.day, self.run_id)
        if resumed is not None:
            replies |= await self._resume(client, resumed, requests)
        skip = look.consumed | {resumed}
        for batch_id in await self._of_dead_runs(client, look.dead, skip, look.since):
            if missing := {c: r for c, r in requests.items() if c not in replies}:
                replies |= await self._resume(client, batch_id, missing)
        pending = [r for cid, r in requests.items() if cid not in replies]
        if pending:
            replies |= await self._submit(
                client, pending, bool(look.dead), look.since, look.started
            )
        return replies

    def _retries(
        self, requests: dict[str, BatchRequest], replies: dict[str, BatchReply]
    ) -> dict[str, BatchRequest]:
        """A second request for each summary whose reply loops: the same messages, the
        stronger penalty."""
        again = {}
        for request in requests.values():
            reply = replies.get(request.custom_id)
            if request.kind != "summary" or reply is None or not _succeeded(reply.line):
                continue
            if not loops(_result(reply, self.endpoint.base_url).text):
                continue
            log.info(
                "%s: the summary repeats itself; asking once more", request.item.paper.arxiv_id
            )
            body = {**request.body, "frequency_penalty": SUMMARY_RETRY_FREQUENCY_PENALTY}
            retry = BatchRequest(_custom_id(RETRY, request.item), request.item, "summary", body)
            again[retry.custom_id] = retry
        return again

    def _store_all(
        self,
        items: list[PaperInput],
        requests: dict[str, BatchRequest],
        replies: dict[str, BatchReply],
        progress: ProgressSink | None,
    ) -> None:
        for item in items:
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
                body["frequency_penalty"] = SUMMARY_FREQUENCY_PENALTY
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
        data = await client.content(batch.get("input_file_id"))
        if data is None:
            # What it asked cannot be known (the input was deleted): ask again.
            log.warning("batch %s: its input file is gone from the server; not resumed", batch_id)
            return {}
        lines = data.splitlines()
        asked = {
            line["custom_id"]
            for raw in lines
            if (line := _json_object(raw)) and _same_request(line, requests)
        }
        if not asked:
            return {}
        log.info("resuming batch %s of the previous run (%s)", batch_id, batch.get("status"))
        self.store.set_run_batch(self.run_id, batch_id)
        replies = await self._collect(client, await client.wait(batch_id))
        return {cid: r for cid, r in replies.items() if cid in asked and _succeeded(r.line)}

    async def _of_dead_runs(
        self, client: BatchClient, dead: dict[str, str], skip: set[str | None], since: float
    ) -> list[str]:
        """Batches that the date's dead runs created, newest first, found by their metadata:
        one a run never recorded (killed between the create and the record), or one recorded
        on a run before the previous (which batch_to_resume does not look at). None to look
        for when no run died."""
        if not dead:
            return []
        day = self.day.isoformat()

        def theirs(batch: dict) -> bool:
            meta = batch.get("metadata") or {}
            return (
                isinstance(meta, dict)
                and meta.get("nightshift_job", JOB) == JOB
                and meta.get("nightshift_digest_date") == day
                and meta.get("nightshift_run") in dead
                and meta.get("nightshift_run_started") == dead[meta["nightshift_run"]]
                and isinstance(batch.get("id"), str)
                and batch["id"] not in skip
                and batch.get("status") != "failed"  # refused whole: it has no replies
            )

        found = [b["id"] for b in await client.find("batches", theirs, since)]
        if found:
            log.info("batches of runs that died: %s", ", ".join(found))
        return found

    async def _submit(
        self,
        client: BatchClient,
        pending: list[BatchRequest],
        after_death: bool,
        since: float,
        started: str,
    ) -> dict[str, BatchReply]:
        data = b"".join(
            json.dumps(
                {"custom_id": r.custom_id, "method": "POST", "url": ENDPOINT, "body": r.body}
            ).encode()
            + b"\n"
            for r in pending
        )
        day, sha = self.day.isoformat(), hashlib.sha256(data).hexdigest()
        name = f"digest-{day}-{sha}.jsonl"

        async def uploaded() -> dict | None:  # the same input, uploaded by a dead run or a lost try
            found = await client.find(
                "files",
                lambda f: f.get("filename") == name and f.get("bytes") == len(data),
                since,
                {"purpose": "batch"},
            )
            return found[0] if found else None

        earlier = await uploaded() if after_death else None
        if earlier is not None:
            log.info("reusing input file %s, uploaded by a run that died", earlier["id"])
            file_id = earlier["id"]
        else:
            file_id = await client.upload(name, data, recheck=uploaded)
        metadata = {
            "nightshift_job": JOB,
            "nightshift_digest_date": day,
            "nightshift_run": str(self.run_id),
            "nightshift_run_started": started,
            "nightshift_input_sha256": sha,
        }

        async def created() -> dict | None:  # the batch of a create whose reply was lost
            found = await client.find(
                "batches",
                lambda b: b.get("metadata") == metadata and b.get("input_file_id") == file_id,
                since,
            )
            return found[0] if found else None

        batch = await client.create(file_id, ENDPOINT, self.window, metadata, recheck=created)
        # Recorded before the first poll: a run killed from here on resumes this batch (and one
        # killed before it is found by its metadata: _of_dead_runs).
        self.store.set_run_batch(self.run_id, batch["id"])
        log.info("submitted batch %s: %d requests", batch["id"], len(pending))
        return await self._collect(client, await client.wait(batch["id"]))

    async def _collect(self, client: BatchClient, batch: dict) -> dict[str, BatchReply]:
        replies = {}
        for file_id in (batch.get("output_file_id"), batch.get("error_file_id")):
            data = await client.content(file_id)
            if data is None:
                log.warning("batch %s: its file %s is gone from the server", batch["id"], file_id)
                continue  # its requests count as unanswered, and a later run asks them again
            for raw in data.splitlines():
                line = _json_object(raw)
                if line is None or not isinstance(line.get("custom_id"), str):
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
            reply = replies.get(request.custom_id)
            earlier: list[CallRecord] = []
            retry = requests.get(_custom_id(RETRY, item)) if kind == "summary" else None
            if retry is not None:
                # The looping reply: its call is recorded with the retry's, which is stored.
                earlier = [self._call(request, reply)]
                request, reply = retry, replies.get(retry.custom_id)
            try:
                self._store_reply(request, reply, key, earlier)
            except (ChatCallError, Unparsed) as exc:
                error = error or str(exc)
        return set_outcome(self.store, self.day, item, self.run_id, error)

    def _call(self, request: BatchRequest, reply: BatchReply | None) -> CallRecord:
        """The record of a successful reply's call (a batch has no per-request latency)."""
        assert reply is not None
        call = new_call(
            self.run_id,
            request.item,
            request.kind,
            self.endpoint.model,
            self.endpoint.base_url,
            request.body["max_tokens"],
        )
        fill_call(call, _result(reply, self.endpoint.base_url))
        call.latency_s = None
        return call

    def _store_reply(
        self,
        request: BatchRequest,
        reply: BatchReply | None,
        key,
        earlier: list[CallRecord],
    ) -> None:
        """Store the reply with its call (and `earlier` calls of the same result, a looping
        summary's); a failed one is recorded and raised."""
        item, kind = request.item, request.kind
        if reply is None or not _succeeded(reply.line):
            message = _failure(reply)
            call = new_call(
                self.run_id,
                item,
                kind,
                self.endpoint.model,
                self.endpoint.base_url,
                request.body["max_tokens"],
            )
            call.status, call.error = "error", message
            call.started_at = _created(reply)
            call.latency_s = None
            for record in (*earlier, call):
                self.store.record_call(record)
            raise ChatCallError(
                message, status_code=None, attempts=1, started_at=call.started_at, latency_s=0.0
            )
        result = _result(reply, self.endpoint.base_url)
        call = self._call(request, reply)
        if kind == "summary":
            store_summary(self.store, item, key, result, call, self.run_id, earlier)
        else:
            store_review(self.store, item, key, result, call, self.run_id)


def _custom_id(kind: str, item: PaperInput) -> str:
    return f"{kind}:{item.basis}:{item.paper.arxiv_id}"


def _same_request(line: dict, requests: dict[str, BatchRequest]) -> bool:
    """The input line asks exactly what this run would ask under its custom_id."""
    custom_id = line.get("custom_id")
    request = requests.get(custom_id) if isinstance(custom_id, str) else None
    if request is None or line.get("url") != ENDPOINT:
        return False
    return line.get("body") == json.loads(json.dumps(request.body))


def _utc(stamp: datetime) -> datetime:
    """A stored time (SQLite hands it back naive; it was stored in UTC)."""
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)


def _started(run) -> str:
    return _utc(run.started_at).isoformat()


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
