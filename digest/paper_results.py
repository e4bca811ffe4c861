"""How a paper's model replies become stored results, whichever way the calls went (streamed one
by one, or as one Batch API batch): the summary tidied, the review parsed and validated, each
saved with the record of its call in one transaction, and the paper's status set. One place, so
that both paths store exactly the same rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date

from digest.chat_client import ChatCallError, ChatResult
from digest.faithfulness import paper_source
from digest.instruction_echo import drop_recitals
from digest.paper import Paper
from digest.prompts import PROMPT_VERSION, SUMMARY_INSTRUCTIONS
from digest.review import InputBasis, repeats_title
from digest.review_parse import parse_review
from digest.store.digest_store import CallRecord, DigestStore, WorkKey, utcnow
from digest.summary_text import tidy_summary


@dataclass(slots=True)
class PaperInput:
    paper: Paper
    basis: InputBasis
    text: str
    truncated: bool


class Unparsed(Exception):
    """The review reply did not validate: the paper failed (its raw reply is stored)."""


def work_key(model: str, basis: InputBasis) -> WorkKey:
    return WorkKey(model, PROMPT_VERSION, basis)


def has_review(store: DigestStore, paper_id: str, key: WorkKey) -> bool:
    """A review that validated; an unparsed reply is kept for reading but asked for again."""
    review = store.review(paper_id, key)
    return review is not None and review.parse_status != "failed"


def new_call(
    run_id: int, item: PaperInput, kind: str, model: str, endpoint: str, max_tokens: int
) -> CallRecord:
    return CallRecord(
        run_id=run_id,
        paper_id=item.paper.arxiv_id,
        kind=kind,
        model=model,
        endpoint=endpoint,
        prompt_version=PROMPT_VERSION,
        input_basis=item.basis,
        max_tokens=max_tokens,
        started_at=utcnow(),
        status="ok",
    )


def fill_call(record: CallRecord, result: ChatResult) -> CallRecord:
    record.endpoint = result.endpoint or record.endpoint  # which of several answered
    record.prompt_tokens = result.prompt_tokens
    record.completion_tokens = result.completion_tokens
    record.cached_tokens = result.cached_tokens
    record.ttft_s, record.latency_s = result.ttft_s, result.latency_s
    record.started_at, record.attempts = result.started_at, result.attempts
    record.finish_reason = result.finish_reason
    return record


def store_summary(
    store: DigestStore,
    item: PaperInput,
    key: WorkKey,
    result: ChatResult,
    call: CallRecord,
    run_id: int,
    earlier: Sequence[CallRecord] = (),
) -> None:
    """Save the tidied summary with its call, and `earlier` calls that led to it (a looping
    reply asked again) in the same transaction; an empty one is a failed call (ChatCallError)."""
    cut_off = result.finish_reason == "length"
    text = tidy_summary(result.text, cut_off=cut_off, title=item.paper.title)
    text = drop_recitals(text, SUMMARY_INSTRUCTIONS, paper_source(item.paper, item.text))
    if not text:
        for record in (*earlier, call):
            store.record_call(record)
        raise ChatCallError(
            "the model returned an empty summary",
            status_code=None,
            attempts=result.attempts,
            started_at=result.started_at,
            latency_s=result.latency_s,
        )
    store.save_summary(item.paper, key, text, run_id, call, earlier)


def store_review(
    store: DigestStore,
    item: PaperInput,
    key: WorkKey,
    result: ChatResult,
    call: CallRecord,
    run_id: int,
) -> None:
    """Save the reply and its validated review; Unparsed when it did not validate."""
    parsed = parse_review(result.text, item.basis)
    if parsed.review is not None and repeats_title(parsed.review.summary, item.paper.title):
        # The title again says nothing (the prompt opens with it, a small model copies it):
        # no reviewer's summary rather than that one.
        parsed.review.summary = ""
    store.save_review(
        item.paper,
        key,
        parsed.review,
        parsed.status,
        result.text,
        parsed.error,
        run_id,
        call,
    )
    if parsed.review is None:
        raise Unparsed(f"review unparsed: {parsed.error}")


def set_outcome(
    store: DigestStore, day: date, item: PaperInput, run_id: int, error: str | None
) -> str:
    """The paper's status after its calls: 'done', or 'failed: why'."""
    pid = item.paper.arxiv_id
    if error is None:
        store.set_item(day, pid, "done", run_id, item.basis)
        return "done"
    store.set_item(day, pid, "failed", run_id, item.basis, error)
    return f"failed: {error}"
