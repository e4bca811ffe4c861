"""One digest run, top to bottom: take the job lock, fetch the day's papers, store them, ask the
model for what is missing, store each answer as it arrives, render the outputs, report.

Idempotent and resumable by construction: the work list is computed from the store (a result that
exists for this model, prompt version and input basis is never asked for again) and every result
is committed as soon as it arrives, so a rerun of a date - after success, a failure, or a kill -9 -
does only what is left."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from datetime import date, timedelta
from functools import partial
from pathlib import Path
from typing import Literal

from digest.batch_calls import BatchPlan
from digest.batch_client import BatchClientConfig
from digest.chat_client import ChatCallError, ChatClient, ChatClientConfig, ChatResult
from digest.clean_text import clean_paper
from digest.delivery import DeliveryConfig, deliver
from digest.embeddings_client import EmbeddingsConfig, embed_texts
from digest.endpoint import LOCAL, Endpoint, check_endpoint, context_tokens, open_endpoint
from digest.faithfulness import unverified_entries
from digest.paper import Paper, papers_count
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
from digest.profile import ProfileError, ReaderProfile, load_profile
from digest.progress import ProgressSink
from digest.prompts import (
    PROMPT_VERSION,
    REVIEW_FREQUENCY_PENALTY,
    REVIEW_MAX_TOKENS,
    SUMMARY_FREQUENCY_PENALTY,
    SUMMARY_MAX_TOKENS,
    SUMMARY_RETRY_FREQUENCY_PENALTY,
    paper_block,
    review_messages,
    summary_messages,
)
from digest.ranking import rank_papers
from digest.render import write_listings, write_outputs, write_pages
from digest.repetition import loops
from digest.review import InputBasis
from digest.review_parse import review_response_format
from digest.run_cost import Pricing
from digest.run_report import RunReport
from digest.sources import DEFAULT_CATEGORIES, load_papers
from digest.sources.arxiv_api import API_URL
from digest.sources.arxiv_new import (
    DEFAULT_OVERLAP,
    fetch_arxiv_new,
    newest_submission,
    source_key,
    window_start,
)
from digest.sources.fulltext import HTML_URL, fetch_fulltext, truncate_text
from digest.sources.polite_http import PoliteClient, PoliteHttpConfig
from digest.store import migrate
from digest.store.database import open_database
from digest.store.digest_store import CallRecord, DigestStore
from digest.store.job_lock import JobLock
from digest.store.schema import DigestItemRow

log = logging.getLogger(__name__)

RECENT_DIGESTS = 14  # how many dates the feed and index carry
RANKING_BACKGROUND = 2000  # recent stored papers the ranking's classifiers learn against
Republished = Literal["mark", "skip"]


@dataclass(slots=True)
class RunOptions:
    digest_date: date
    out_dir: Path
    # The arXiv categories to fetch (None: the sources' default) or, for a file, to keep (None:
    # every paper in it).
    categories: list[str] | None = None
    max_papers: int | None = None
    source: str = "arxiv"  # arxiv | rss | a file path
    # arxiv: "new" takes what was announced since the last night (the source's watermark in
    # the store, less `overlap`; digest/sources/arxiv_new.py), "day" the submissions of
    # `digest_date` (an explicit backfill).
    selection: Literal["new", "day"] = "day"
    overlap: timedelta = DEFAULT_OVERLAP
    input_mode: InputBasis = "abstract"
    endpoint: str = LOCAL
    model: str | None = None
    api_key_env: str | None = None
    concurrency: int = 4
    db_url: str | None = None
    include_cross: bool = False
    max_input_chars: int = 24_000
    site_url: str | None = None  # where out_dir is published: absolute feed links and ids
    local_model: str = "default"
    local_server_args: tuple[str, ...] = ()
    redo: tuple[str, ...] = ()  # arXiv ids (no version) whose results are asked for again
    # A paper published on an earlier date: listed again with a note ("mark"), or left out.
    republished: Republished = "mark"
    # Where the arXiv sources and the model client are pointed and how patient they are; tests
    # point them at loopback fixtures and shorten the waits.
    arxiv_api_url: str | None = None
    arxiv_rss_url: str | None = None
    arxiv_html_url: str | None = None
    http: PoliteHttpConfig = field(default_factory=PoliteHttpConfig)
    chat_retries: int = 3
    chat_backoff_s: float = 2.0
    chat_read_timeout_s: float = 600.0
    # How the model is called: "stream" (one streamed chat completion per call) or "batch" (the
    # night's calls as one Batch API batch, polled; batch_calls.py).
    via: Literal["stream", "batch"] = "stream"
    batch_window: str = "24h"
    batch_poll_s: float = 10.0  # the first wait between polls; it doubles up to the next
    batch_max_poll_s: float = 300.0
    # A reader profile ranks the papers (digest/ranking.py): "for you" first, model calls to the
    # best first, and --max-papers takes the top of the ranking; the rest are listed below the
    # cut (status below_cut), never summarised, so that no paper waits or is lost.
    profile: ReaderProfile | None = None
    # The profile's file: read again at each run, so that `digest profile add` counts from the
    # next night of a long-running `digest schedule` (a file broken since keeps `profile`, a
    # file removed since means no ranking).
    profile_path: Path | None = None
    embeddings: EmbeddingsConfig | None = None  # adds embedding similarity to the ranking
    delivery: DeliveryConfig | None = None  # email / webhook after the pages are written
    pricing: Pricing | None = None  # the run report's cost line (digest/run_cost.py)


@dataclass(slots=True)
class RunHandle:
    """The run in progress, for a caller that must end it from another thread (the scheduler
    stopped by SIGTERM while its worker thread runs): what a run that unwinds does itself."""

    store: DigestStore | None = None
    lock: JobLock | None = None
    run_id: int | None = None

    def abandon(self, reason: str) -> None:
        """Record the run as failed and release the job lock, so that a second host need not
        wait for the lease to run out."""
        if self.store is not None and self.run_id is not None:
            self.store.finish_run(self.run_id, "failed", error=reason)
        if self.lock is not None:
            self.lock.release()


def run_digest(
    options: RunOptions, progress: ProgressSink | None = None, handle: RunHandle | None = None
) -> RunReport:
    """Run the digest of `options.digest_date`. Raises LockHeld when another run holds the lock,
    SourceError when the papers cannot be fetched (recorded as a failed run). `handle`, when
    given, is filled with the run and its lock while they are held."""
    handle = handle or RunHandle()
    started = time.perf_counter()
    options = _with_current_profile(options)
    engine = open_database(options.db_url)
    migrate.upgrade(engine)
    store = DigestStore(engine)
    model_name, label = check_endpoint(
        options.endpoint, options.model, options.api_key_env, options.local_model
    )
    with JobLock(engine) as lock:
        handle.store, handle.lock = store, lock
        if stale := store.mark_stale_runs_interrupted():
            log.info("%d earlier run(s) had died mid-way; resuming their work", stale)
        _check_redo(store, options)
        run_id = store.start_run(
            options.digest_date, _params(options), model_name, label, PROMPT_VERSION
        )
        handle.run_id = run_id
        try:
            for paper_id in options.redo:
                log.info("%s: asking the model again (--redo)", paper_id)
                store.forget_results(paper_id, model_name, PROMPT_VERSION)
                store.set_item(options.digest_date, paper_id, "pending", run_id, None)
            inputs = _prepare_inputs(store, options, run_id)
            work = [i for i in inputs if not _is_done(store, i, model_name)]
            _mark_done(store, options.digest_date, run_id, inputs, work)
            log.info("%d of %s need model calls", len(work), papers_count(len(inputs)))
            if work:
                # The local server starts only now: a finished date, or a run whose source
                # fails, costs no model load.
                with open_endpoint(
                    options.endpoint,
                    options.model,
                    options.api_key_env,
                    options.local_model,
                    _local_args(options),
                ) as endpoint:
                    call = _call_via_batch if options.via == "batch" else _call_model
                    asyncio.run(call(store, options, endpoint, run_id, work, progress))
        except BaseException as exc:
            store.finish_run(run_id, "failed", error=f"{type(exc).__name__}: {exc}")
            raise
        items = [i for i, _ in store.items(options.digest_date) if i.status != "below_cut"]
        failed = [(i.paper_id, i.error or "not processed") for i in items if i.status != "done"]
        # All failed (the endpoint was down all night): the run failed, though the page that
        # lists the failures is still published.
        status = "partial" if failed else "succeeded"
        if failed and len(failed) == len(items):
            status = "failed"
        digest = store.load_digest(options.digest_date)
        fingerprint = digest.fingerprint() if digest else None
        run = store.finish_run(run_id, status, content_hash=fingerprint)
        outputs = render_date(store, options.digest_date, options.out_dir, options.site_url)
        # Under the lock, so that two hosts do not both send the night; after the pages, so
        # that a failed delivery leaves everything stored and published.
        sent = deliver(store, digest, options.delivery) if options.delivery and digest else []
        handle.lock = None  # released on leaving the block
    cached = sum(c.cached_tokens or 0 for c in store.calls(run_id))
    return RunReport(
        run_id=run_id,
        digest_date=options.digest_date,
        status=run.status,
        papers_total=run.papers_total,
        papers_done=run.papers_done,
        papers_failed=run.papers_failed,
        calls=run.calls,
        prompt_tokens=run.prompt_tokens,
        completion_tokens=run.completion_tokens,
        cached_tokens=cached,
        wall_s=time.perf_counter() - started,
        failed=failed,
        outputs=outputs,
        papers_below_cut=sum(
            1 for i, _ in store.items(options.digest_date) if i.status == "below_cut"
        ),
        deliveries=[outcome.line() for outcome in sent],
        delivery_failed=any(outcome.status == "failed" for outcome in sent),
        prompt_version=PROMPT_VERSION,
        unverified=unverified_entries(digest.done) if digest else [],
        pricing=options.pricing,
    )


def _with_current_profile(options: RunOptions) -> RunOptions:
    if options.profile_path is None:
        return options
    if not options.profile_path.is_file():  # removed since: no ranking
        return replace(options, profile=None)
    try:
        profile = load_profile(options.profile_path)
    except ProfileError as exc:
        log.warning("%s; ranking by the profile as it was at start", exc)
        return options
    return replace(options, profile=None if profile.empty else profile)


class RedoError(ValueError):
    """--redo names a paper that the date's digest does not list."""


def _check_redo(store: DigestStore, options: RunOptions) -> None:
    listed = {paper.arxiv_id for _, paper in store.items(options.digest_date)}
    for paper_id in options.redo:
        if paper_id not in listed:
            day = options.digest_date.isoformat()
            raise RedoError(f"--redo {paper_id}: the digest of {day} does not list that paper")


class NoDigest(LookupError):
    """The store has no digest for the date asked (or none at all): a date to correct, or a
    run to make first; nothing failed."""


def render_date(
    store: DigestStore, digest_date: date, out_dir: Path, site_url: str | None = None
) -> list[Path]:
    """Write the date's pages and refresh the feed and index; no model calls."""
    digest = store.load_digest(digest_date)
    if digest is None:
        raise NoDigest(f"the store has no digest for {digest_date.isoformat()}")
    recent = [d for day in store.digest_dates(RECENT_DIGESTS) if (d := store.load_digest(day))]
    return write_outputs(out_dir, digest, recent, site_url=site_url)


def render_all(store: DigestStore, out_dir: Path, site_url: str | None = None) -> list[Path]:
    """Write every stored date's pages, then the feed and index: a lost output folder back."""
    days = store.digest_dates(limit=None)
    if not days:
        raise NoDigest("the store holds no digest yet; run `nightshift digest run` first")
    written, recent = [], []
    for day in days:  # newest first
        digest = store.load_digest(day)
        assert digest is not None  # a listed date has items
        written += write_pages(out_dir, digest)
        if len(recent) < RECENT_DIGESTS:
            recent.append(digest)
    return written + write_listings(out_dir, recent, site_url=site_url)


def _local_args(options: RunOptions) -> tuple[str, ...]:
    """The local server's options; with --via batch it serves the Batch API (its records and
    files under $NIGHTSHIFT_HOME/batches, so that a resumed run finds the batch again)."""
    batch = ("--enable-batch-api",) if options.via == "batch" else ()
    return (*options.local_server_args, *batch)


async def _call_via_batch(
    store: DigestStore,
    options: RunOptions,
    endpoint: Endpoint,
    run_id: int,
    work: list[PaperInput],
    progress: ProgressSink | None,
) -> None:
    config = BatchClientConfig(
        base_url=endpoint.base_url,
        api_key=endpoint.api_key,
        max_retries=options.chat_retries,
        backoff_s=options.chat_backoff_s,
        poll_s=options.batch_poll_s,
        max_poll_s=options.batch_max_poll_s,
    )
    plan = BatchPlan(store, endpoint, config, options.batch_window, run_id, options.digest_date)
    await plan.run(work, progress)


def _params(options: RunOptions) -> dict:
    keep = (
        "categories",
        "max_papers",
        "source",
        "selection",
        "input_mode",
        "endpoint",
        "model",
        "concurrency",
        "include_cross",
        "max_input_chars",
        "republished",
        "via",
    )
    # Not asdict(options): that would copy the whole profile (and the SMTP password) first.
    params = {k: getattr(options, k) for k in keep}
    return {**params, "ranked": options.profile is not None}


def _prepare_inputs(store: DigestStore, options: RunOptions, run_id: int) -> list[PaperInput]:
    """Fetch the night's papers, store them, and build each paper's model input."""
    with PoliteClient(options.http) as client:
        if options.source == "arxiv" and options.selection == "new":
            _list_new_papers(store, client, options, run_id)
        else:
            _list_papers(store, client, options)
        # The stored list of the date, not just this fetch: a rerun also finishes papers that an
        # earlier run of the date listed. Ranked papers go best first (the model calls in that
        # order); those below the cut are not summarised.
        items = [pair for pair in store.items(options.digest_date) if pair[0].status != "below_cut"]
        items.sort(key=_rank_order)
        listed = [paper for _, paper in items]
        budget = _fulltext_budget(options) if options.input_mode == "fulltext" else 0
        return [_paper_input(store, client, options, paper, budget) for paper in listed]


def _list_new_papers(
    store: DigestStore, client: PoliteClient, options: RunOptions, run_id: int
) -> None:
    """List under the date what arXiv announced since the last night, and move the watermark."""
    categories = options.categories or list(DEFAULT_CATEGORIES)
    key = source_key(categories)
    # A night killed after listing its papers (kill -9, a stopped scheduler) left them under a
    # date without a page; tonight publishes them (a later night would skip them as listed).
    for day, count in sorted(store.take_over_unpublished_nights(options.digest_date).items()):
        log.info(
            "%s listed by the unfinished night of %s (never published) taken into this digest",
            papers_count(count),
            day.isoformat(),
        )
    mark = store.watermark(key)
    since = window_start(mark, options.digest_date, options.overlap)
    # Ranked, the night lists every new paper and the cut falls after the ranking: nothing waits.
    new = fetch_arxiv_new(
        client,
        categories,
        since,
        None if options.profile else options.max_papers,
        lambda ids: store.listed_elsewhere(options.digest_date, ids),
        base_url=options.arxiv_api_url or API_URL,
    )
    papers = [clean_paper(p) for p in new.papers]
    log.info(
        "%s new on arXiv since %s (%s; %d already in other digests%s)",
        papers_count(len(papers)),
        since.isoformat(timespec="minutes"),
        f"watermark {mark.isoformat(timespec='minutes')}" if mark else "first night",
        new.skipped,
        f"; {new.waiting}+ wait for the next run (--max-papers)" if new.waiting else "",
    )
    store.upsert_papers(papers)
    _add_items(store, options, papers)
    # Only now that they are listed: a run killed before this line asks again from the old
    # watermark and finds these papers listed under its date, not lost.
    if (newest := newest_submission(papers)) is not None:
        store.advance_watermark(key, newest, run_id)


def _list_papers(store: DigestStore, client: PoliteClient, options: RunOptions) -> None:
    """List under the date the day's arXiv submissions, the feed's announcements or a file's
    papers."""
    kwargs = {}
    if options.arxiv_api_url:
        kwargs["api_url"] = options.arxiv_api_url
    if options.arxiv_rss_url:
        kwargs["rss_url"] = options.arxiv_rss_url
    # Every paper of the source: --max-papers is applied below, after the papers that cost no
    # model call (published before) and those that are not to be listed are known.
    papers = load_papers(
        options.source,
        categories=options.categories,
        day=options.digest_date,
        max_papers=None,
        client=client,
        include_cross=options.include_cross,
        **kwargs,
    )
    log.info("%s from %s", papers_count(len(papers)), options.source)
    if options.source == "arxiv":
        # A backfill lists only what no night took: nights select by announcement, so a
        # day's submissions may already be in the digests after that day.
        taken = store.listed_elsewhere(options.digest_date, [p.arxiv_id for p in papers])
        if taken:
            log.info("%s already in other digests; left out", papers_count(len(taken)))
            papers = [p for p in papers if p.arxiv_id not in taken]
    if options.republished == "skip":
        papers = _skip_republished(store, options.digest_date, papers)
    if options.profile is None and options.max_papers is not None:
        papers = _first_unpublished(store, options.digest_date, options.max_papers, papers)
    store.upsert_papers(papers)
    _add_items(store, options, papers)


def _rank_order(pair: tuple[DigestItemRow, Paper]) -> tuple[int, float]:
    """Ranked papers best first, then the unranked (a night's taken-over papers) in listing
    order (the sort is stable)."""
    score = pair[0].rank_score
    return (0, -score) if score is not None else (1, 0.0)


def _add_items(store: DigestStore, options: RunOptions, papers: list[Paper]) -> None:
    """List the papers under the date: as they came, or with a profile ranked best first, the
    top up to --max-papers to be summarised and the rest below the cut."""
    if options.profile is None:
        store.add_items(options.digest_date, papers, options.input_mode)
        return
    listed = {paper.arxiv_id for _, paper in store.items(options.digest_date)}
    papers = [p for p in papers if p.arxiv_id not in listed]
    ids = {p.arxiv_id for p in papers}
    embed = partial(embed_texts, options.embeddings) if options.embeddings else None
    # Liked papers come from the store: they must not also be their own tag's negatives.
    background = store.recent_paper_texts(RANKING_BACKGROUND, ids | options.profile.tagged_ids())
    ranked = rank_papers(papers, options.profile, background, embed)
    # A paper an earlier digest published has its summary (no model call): it is shown with
    # it, and neither takes one of the N places nor falls below the cut.
    published = store.published_before(options.digest_date, list(ids))
    room = None
    if options.max_papers is not None:
        room = _room(store, options.digest_date, options.max_papers)
    fresh = [r for r in ranked if r.paper.arxiv_id not in published]
    below = {r.paper.arxiv_id for r in fresh[room:]} if room is not None else set()
    mine = sum(1 for r in ranked if r.for_you)
    log.info(
        "ranked %s by the reader profile: %d for you%s%s",
        papers_count(len(ranked)),
        mine,
        f"; {len(published)} published before (not counted)" if published else "",
        f"; {len(below)} below --max-papers (listed, not summarised)" if below else "",
    )
    ranking = {r.paper.arxiv_id: (r.score, r.reasons) for r in ranked}
    store.add_items(
        options.digest_date, [r.paper for r in ranked], options.input_mode, ranking, below
    )


def _first_unpublished(
    store: DigestStore, day: date, max_papers: int, papers: list[Paper]
) -> list[Paper]:
    """--max-papers without a profile: the source's papers in order, up to the Nth that no
    earlier digest published. One that an earlier digest published costs no model call: it is
    kept where it stands (marked on the page) and not counted, so that a file read night after
    night moves on instead of taking its first N again. A rerun counts what the date lists."""
    listed = {paper.arxiv_id for _, paper in store.items(day)}
    published = store.published_before(day, [p.arxiv_id for p in papers])
    room = _room(store, day, max_papers)
    kept = []
    for paper in papers:
        if paper.arxiv_id in listed:
            kept.append(paper)
        elif room > 0:
            kept.append(paper)
            room -= paper.arxiv_id not in published
    passed_over = {p.arxiv_id for p in kept} | published.keys()
    if waiting := sum(1 for p in papers if p.arxiv_id not in passed_over):
        log.info("%s wait for the next run (--max-papers %d)", papers_count(waiting), max_papers)
    return kept


def _room(store: DigestStore, day: date, max_papers: int) -> int:
    """What is left of --max-papers on the date: N less the papers it lists to be summarised,
    not counting those an earlier digest published (they cost no model call)."""
    taken = [item.paper_id for item, _ in store.items(day) if item.status != "below_cut"]
    return max(0, max_papers - len(taken) + len(store.published_before(day, taken)))


def _skip_republished(store: DigestStore, day: date, papers: list[Paper]) -> list[Paper]:
    """The papers that no earlier digest published; those already listed today stay listed."""
    earlier = store.published_before(day, [p.arxiv_id for p in papers])
    if not earlier:
        return papers
    log.info("%s published on an earlier date; left out", papers_count(len(earlier)))
    return [p for p in papers if p.arxiv_id not in earlier]


# Room the prompt needs besides the paper text (system text, metadata, task, chat template), and
# a low estimate of characters per token, so that the truncated text surely fits.
PROMPT_OVERHEAD_TOKENS = 512
CHARS_PER_TOKEN = 3


def _fulltext_budget(options: RunOptions) -> int:
    """Characters of full text a prompt may carry: --max-input-chars, lowered to what fits the
    model's context next to the longest reply when the context length is known."""
    context = context_tokens(
        options.endpoint, options.model, options.api_key_env, options.local_model
    )
    if context is None:
        return options.max_input_chars
    room = (context - REVIEW_MAX_TOKENS - PROMPT_OVERHEAD_TOKENS) * CHARS_PER_TOKEN
    if room < options.max_input_chars:
        log.info("full texts truncated to %d characters to fit a %d-token context", room, context)
    return min(options.max_input_chars, max(1000, room))


def _paper_input(
    store: DigestStore, client: PoliteClient, options: RunOptions, paper: Paper, budget: int
) -> PaperInput:
    if options.input_mode == "abstract":
        return PaperInput(paper, "abstract", paper.abstract, False)
    row = store.fulltext(paper)
    if row is None:
        text = fetch_fulltext(client, paper, options.arxiv_html_url or HTML_URL)
        full = truncate_text(text, budget) if text else None
        store.save_fulltext(
            paper,
            full.text if full else None,
            full.truncated if full else False,
            full.original_chars if full else 0,
        )
        row = store.fulltext(paper)
        assert row is not None
    if row.text is None:
        log.info("%s: no HTML full text; using the abstract", paper.arxiv_id)
        return PaperInput(paper, "abstract", paper.abstract, False)
    return PaperInput(paper, "fulltext", row.text, row.truncated)


_key = work_key
_has_review = has_review


def _is_done(store: DigestStore, item: PaperInput, model: str) -> bool:
    key = _key(model, item.basis)
    pid = item.paper.arxiv_id
    return store.summary(pid, key) is not None and _has_review(store, pid, key)


def _mark_done(
    store: DigestStore, day: date, run_id: int, inputs: list[PaperInput], work: list[PaperInput]
) -> None:
    todo = {i.paper.arxiv_id for i in work}
    for item in inputs:
        if item.paper.arxiv_id not in todo:
            store.set_item(day, item.paper.arxiv_id, "done", run_id, item.basis)


async def _call_model(
    store: DigestStore,
    options: RunOptions,
    endpoint: Endpoint,
    run_id: int,
    work: list[PaperInput],
    progress: ProgressSink | None,
) -> None:
    config = ChatClientConfig(
        base_url=endpoint.base_url,
        base_urls=endpoint.base_urls,
        model=endpoint.model,
        api_key=endpoint.api_key,
        read_timeout_s=options.chat_read_timeout_s,
        max_retries=options.chat_retries,
        backoff_s=options.chat_backoff_s,
    )
    # Bounded parallelism: `concurrency` papers in flight lets the server batch; each paper's
    # review follows its summary, so the review finds the paper's prefix already cached.
    slots = asyncio.Semaphore(options.concurrency)
    if progress:
        progress.start(len(work))
    async with ChatClient(config, concurrency=options.concurrency) as client:
        paper_calls = _PaperCalls(store, client, endpoint, options.digest_date, run_id)

        async def one(item: PaperInput) -> None:
            async with slots:
                outcome = await paper_calls.process(item)
            if progress:
                progress.advance(item.paper.arxiv_id, outcome)

        await asyncio.gather(*(one(item) for item in work))


@dataclass(slots=True)
class _PaperCalls:
    store: DigestStore
    client: ChatClient
    endpoint: Endpoint
    day: date
    run_id: int

    async def process(self, item: PaperInput) -> str:
        """Summary, then review, each stored when it arrives; 'done' or 'failed: ...'."""
        key = _key(self.endpoint.model, item.basis)
        pid = item.paper.arxiv_id
        block = paper_block(item.paper, item.basis, item.text, item.truncated)
        try:
            if self.store.summary(pid, key) is None:
                result, call = await self._summary(item, block)
                store_summary(self.store, item, key, result, call, self.run_id)
            if not _has_review(self.store, pid, key):
                # Ask for schema-constrained JSON unless this server has said it cannot.
                fmt = (
                    None
                    if self.client.json_schema_supported is False
                    else (review_response_format())
                )
                result, call = await self._call(
                    item,
                    "review",
                    review_messages(block, item.basis),
                    REVIEW_MAX_TOKENS,
                    fmt,
                    REVIEW_FREQUENCY_PENALTY,
                )
                store_review(self.store, item, key, result, call, self.run_id)
        except (ChatCallError, Unparsed) as exc:
            return set_outcome(self.store, self.day, item, self.run_id, str(exc))
        return set_outcome(self.store, self.day, item, self.run_id, None)

    async def _summary(self, item: PaperInput, block: str) -> tuple[ChatResult, CallRecord]:
        """The summary reply; one that loops is asked once more under a stronger penalty (the
        first call is recorded: its tokens were spent)."""
        messages = summary_messages(block)
        result, call = await self._call(
            item, "summary", messages, SUMMARY_MAX_TOKENS, None, SUMMARY_FREQUENCY_PENALTY
        )
        if not loops(result.text):
            return result, call
        log.info("%s: the summary repeats itself; asking once more", item.paper.arxiv_id)
        self.store.record_call(call)
        return await self._call(
            item, "summary", messages, SUMMARY_MAX_TOKENS, None, SUMMARY_RETRY_FREQUENCY_PENALTY
        )

    async def _call(
        self,
        item: PaperInput,
        kind: str,
        messages: list[dict],
        max_tokens: int,
        response_format: dict | None = None,
        frequency_penalty: float | None = None,
    ) -> tuple[ChatResult, CallRecord]:
        """The reply and the record of the call. A failed call is recorded here; a successful
        one is stored by the caller with its result, in one transaction."""
        model, url = self.endpoint.model, self.endpoint.base_url
        record = new_call(self.run_id, item, kind, model, url, max_tokens)
        try:
            result = await self.client.chat(
                messages,
                max_tokens=max_tokens,
                temperature=0.0,
                seed=0,
                response_format=response_format,
                frequency_penalty=frequency_penalty,
                label=f"{item.paper.arxiv_id} {kind}",
            )
        except ChatCallError as exc:
            record.status, record.error, record.attempts = "error", str(exc), exc.attempts
            record.started_at, record.latency_s = exc.started_at, exc.latency_s
            self.store.record_call(record)
            raise
        return result, fill_call(record, result)
