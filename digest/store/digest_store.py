"""What the pipeline and the renderer ask of the database, one short transaction each.

Every result is committed as soon as it exists, so a run killed at any point loses at most the
calls in flight; the unique constraints make a repeated write a no-op instead of a duplicate."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime

from sqlalchemy import Engine, delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from digest.entries import DailyDigest, DigestEntry
from digest.paper import Paper
from digest.review import InputBasis, Review
from digest.store.schema import (
    DeliveryRow,
    DigestItemRow,
    FullTextRow,
    ModelCallRow,
    PaperRow,
    ReviewRow,
    RunRow,
    SourceWatermarkRow,
    SummaryRow,
)

# The deliveries table's target column: a longer name (a long recipient list) is recorded cut,
# and looked up cut, or a sent digest would never be found and be sent again.
TARGET_CHARS = DeliveryRow.__table__.c.target.type.length


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(slots=True, frozen=True)
class WorkKey:
    """Which results count as already done: same model, prompt version and input basis."""

    model: str
    prompt_version: str
    input_basis: InputBasis


@dataclass(slots=True)
class CallRecord:
    run_id: int
    paper_id: str
    kind: str  # summary | review
    model: str
    endpoint: str
    prompt_version: str
    input_basis: str
    max_tokens: int
    started_at: datetime
    status: str  # ok | error
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    error: str | None = None
    attempts: int = 1
    finish_reason: str | None = None


class DigestStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._session = sessionmaker(engine, expire_on_commit=False)

    def session(self) -> Session:
        return self._session()

    # -- runs -------------------------------------------------------------------------------

    def start_run(
        self, digest_date: date, params: dict, model: str, endpoint: str, prompt_version: str
    ) -> int:
        with self._session.begin() as s:
            run = RunRow(
                digest_date=digest_date,
                status="running",
                params=params,
                model=model,
                endpoint=endpoint,
                prompt_version=prompt_version,
                started_at=utcnow(),
            )
            s.add(run)
            s.flush()
            return run.id

    def mark_stale_runs_interrupted(self) -> int:
        """Runs left 'running' by a process that died; only called while holding the job lock."""
        with self._session.begin() as s:
            result = s.execute(
                update(RunRow)
                .where(RunRow.status == "running")
                .values(status="interrupted", finished_at=utcnow())
            )
            return result.rowcount

    def finish_run(
        self,
        run_id: int,
        status: str,
        error: str | None = None,
        content_hash: str | None = None,
    ) -> RunRow:
        with self._session.begin() as s:
            run = s.get(RunRow, run_id)
            assert run is not None
            calls = s.execute(
                select(
                    func.count(),
                    func.coalesce(func.sum(ModelCallRow.prompt_tokens), 0),
                    func.coalesce(func.sum(ModelCallRow.completion_tokens), 0),
                ).where(ModelCallRow.run_id == run_id)
            ).one()
            items = s.execute(
                select(DigestItemRow.status, func.count())
                .where(DigestItemRow.digest_date == run.digest_date)
                .group_by(DigestItemRow.status)
            ).all()
            counts = dict(items)
            run.calls, run.prompt_tokens, run.completion_tokens = calls
            run.papers_total = sum(counts.values())
            run.papers_done = counts.get("done", 0)
            # Papers ranked below --max-papers are listed but were never meant to be done.
            run.papers_failed = run.papers_total - run.papers_done - counts.get("below_cut", 0)
            run.status, run.error, run.finished_at = status, error, utcnow()
            run.content_hash = content_hash
            return run

    def runs_for(self, digest_date: date) -> list[RunRow]:
        with self.session() as s:
            return list(
                s.scalars(
                    select(RunRow).where(RunRow.digest_date == digest_date).order_by(RunRow.id)
                )
            )

    def set_run_batch(self, run_id: int, batch_id: str) -> None:
        """The Batch API batch this run is waiting for (`digest run --via batch`)."""
        with self._session.begin() as s:
            s.execute(update(RunRow).where(RunRow.id == run_id).values(batch_id=batch_id))

    def batch_to_resume(self, digest_date: date, run_id: int) -> str | None:
        """The batch of the date's previous run, when that run ended before finishing (killed,
        so marked interrupted, or failed): this run polls it instead of submitting again."""
        with self.session() as s:
            previous = s.scalars(
                select(RunRow)
                .where(RunRow.digest_date == digest_date, RunRow.id < run_id)
                .order_by(RunRow.id.desc())
                .limit(1)
            ).first()
        if previous is None or previous.status not in ("interrupted", "failed"):
            return None
        return previous.batch_id

    # -- papers and the day's list ------------------------------------------------------------

    def upsert_papers(self, papers: list[Paper]) -> None:
        """Insert new papers; a newer version replaces the stored metadata of the same paper."""
        now = utcnow()
        with self._session.begin() as s:
            for paper in papers:
                row = s.get(PaperRow, paper.arxiv_id)
                if row is None:
                    s.add(
                        PaperRow(
                            arxiv_id=paper.arxiv_id,
                            first_seen_at=now,
                            last_seen_at=now,
                            **_paper_fields(paper),
                        )
                    )
                    continue
                row.last_seen_at = now
                if paper.version >= row.version:
                    for key, value in _paper_fields(paper).items():
                        setattr(row, key, value)

    def papers(self, paper_ids: list[str]) -> dict[str, Paper]:
        """The stored papers among these ids (the others are absent)."""
        with self.session() as s:
            rows = s.scalars(select(PaperRow).where(PaperRow.arxiv_id.in_(paper_ids))).all()
            return {row.arxiv_id: _paper(row) for row in rows}

    def add_items(
        self,
        digest_date: date,
        papers: list[Paper],
        input_basis: InputBasis,
        ranking: dict[str, tuple[float, list[str]]] | None = None,
        below_cut: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        """List the papers under the date; papers already listed keep their place and status.
        `ranking`: each paper's score and "for you" reasons (digest/ranking.py); `below_cut`:
        papers listed as ranked below --max-papers, which no run summarises."""
        ranking = ranking or {}
        with self._session.begin() as s:
            existing = set(
                s.scalars(
                    select(DigestItemRow.paper_id).where(DigestItemRow.digest_date == digest_date)
                )
            )
            position = len(existing)
            for paper in papers:
                if paper.arxiv_id in existing:
                    continue
                existing.add(paper.arxiv_id)
                score, reasons = ranking.get(paper.arxiv_id, (None, None))
                s.add(
                    DigestItemRow(
                        digest_date=digest_date,
                        paper_id=paper.arxiv_id,
                        position=position,
                        status="below_cut" if paper.arxiv_id in below_cut else "pending",
                        input_basis=input_basis,
                        rank_score=score,
                        for_you=reasons,
                    )
                )
                position += 1

    def published_before(self, digest_date: date, paper_ids: list[str]) -> dict[str, date]:
        """The first earlier date on which each of these papers was published (listed and
        done); papers never published before are absent."""
        with self.session() as s:
            rows = s.execute(
                select(DigestItemRow.paper_id, func.min(DigestItemRow.digest_date))
                .where(
                    DigestItemRow.paper_id.in_(paper_ids),
                    DigestItemRow.digest_date < digest_date,
                    DigestItemRow.status == "done",
                )
                .group_by(DigestItemRow.paper_id)
            ).all()
            return dict(rows)

    def listed_elsewhere(self, digest_date: date, paper_ids: list[str]) -> set[str]:
        """Those of these papers that the digest of another date lists, whatever their status:
        a nightly run takes only papers no digest has (a failed one is finished by rerunning
        its own date, not listed again)."""
        found: set[str] = set()
        with self.session() as s:
            for start in range(0, len(paper_ids), 500):  # bounded IN lists
                chunk = paper_ids[start : start + 500]
                found.update(
                    s.scalars(
                        select(DigestItemRow.paper_id).where(
                            DigestItemRow.paper_id.in_(chunk),
                            DigestItemRow.digest_date != digest_date,
                        )
                    )
                )
        return found

    def take_over_unpublished_nights(self, digest_date: date) -> dict[date, int]:
        """Move to `digest_date` the papers that an earlier night listed but never published:
        a nightly run (selection "new") killed or stopped after listing its papers, and no run
        of its date finished since. No later night takes those papers (another digest lists
        them) and nothing reruns that date by itself, so without this they stay pending under
        a date that has no page. Returns how many papers came from each date; only called
        while holding the job lock."""
        with self._session.begin() as s:
            dead = s.scalars(
                select(RunRow).where(
                    RunRow.digest_date != digest_date,
                    RunRow.status.in_(("interrupted", "failed")),
                    RunRow.content_hash.is_(None),
                )
            ).all()
            nights = {r.digest_date for r in dead if (r.params or {}).get("selection") == "new"}
            if not nights:
                return {}
            # A date some run finished (its pages written) keeps its papers: its failures are
            # listed there, and `digest run --date` retries them.
            finished = set(
                s.scalars(
                    select(RunRow.digest_date).where(
                        RunRow.digest_date.in_(nights), RunRow.content_hash.is_not(None)
                    )
                )
            )
            stranded = nights - finished
            rows = s.scalars(
                select(DigestItemRow)
                .where(DigestItemRow.digest_date.in_(stranded))
                .order_by(DigestItemRow.digest_date, DigestItemRow.position)
            ).all()
            if not rows:
                return {}
            here = set(
                s.scalars(
                    select(DigestItemRow.paper_id).where(DigestItemRow.digest_date == digest_date)
                )
            )
            position = len(here)
            moved: dict[date, int] = {}
            for row in rows:
                moved[row.digest_date] = moved.get(row.digest_date, 0) + 1
                if row.paper_id in here:
                    s.delete(row)
                    continue
                here.add(row.paper_id)
                # Its results, if any, are stored per paper: the run marks it done, no calls.
                # A paper ranked below --max-papers stays so: it was not to be summarised.
                row.digest_date, row.position, row.status, row.error = (
                    digest_date,
                    position,
                    "below_cut" if row.status == "below_cut" else "pending",
                    None,
                )
                position += 1
            return moved

    # -- source watermarks ---------------------------------------------------------------------

    def watermark(self, source_key: str) -> datetime | None:
        with self.session() as s:
            row = s.get(SourceWatermarkRow, source_key)
            return _as_utc(row.watermark) if row else None

    def advance_watermark(self, source_key: str, value: datetime, run_id: int) -> datetime:
        """Move the source's watermark up to `value` (never back: a backfill or a rerun of an
        older night must not make the next night read less); returns the watermark now."""
        with self._session.begin() as s:
            row = s.get(SourceWatermarkRow, source_key, with_for_update=True)
            if row is None:
                s.add(
                    SourceWatermarkRow(
                        source_key=source_key, watermark=value, run_id=run_id, updated_at=utcnow()
                    )
                )
                return value
            current = _as_utc(row.watermark)
            assert current is not None
            if value > current:
                row.watermark, row.run_id, row.updated_at = value, run_id, utcnow()
                return value
            return current

    def recent_paper_texts(self, limit: int, exclude: set[str]) -> list[str]:
        """Title and abstract of the most recently seen papers, for the ranking's classifiers
        (negatives and word statistics), less `exclude`."""
        with self.session() as s:
            rows = s.execute(
                select(PaperRow.arxiv_id, PaperRow.title, PaperRow.abstract)
                .order_by(PaperRow.last_seen_at.desc(), PaperRow.arxiv_id)
                .limit(limit + len(exclude))
            ).all()
        return [f"{title}. {abstract}" for pid, title, abstract in rows if pid not in exclude][
            :limit
        ]

    # -- deliveries ----------------------------------------------------------------------------

    def delivered(self, digest_date: date, channel: str, target: str, content_hash: str) -> bool:
        """Whether this target already received the date's digest as it is now."""
        with self.session() as s:
            return (
                s.scalar(
                    select(func.count()).where(
                        DeliveryRow.digest_date == digest_date,
                        DeliveryRow.channel == channel,
                        DeliveryRow.target == target[:TARGET_CHARS],  # as recorded
                        DeliveryRow.content_hash == content_hash,
                        DeliveryRow.status == "sent",
                    )
                )
                > 0
            )

    def record_delivery(
        self,
        digest_date: date,
        channel: str,
        target: str,
        content_hash: str,
        error: str | None,
    ) -> None:
        with self._session.begin() as s:
            s.add(
                DeliveryRow(
                    digest_date=digest_date,
                    channel=channel,
                    target=target[:TARGET_CHARS],
                    content_hash=content_hash,
                    status="failed" if error else "sent",
                    error=error,
                    attempted_at=utcnow(),
                )
            )

    def deliveries(self, digest_date: date) -> list[DeliveryRow]:
        with self.session() as s:
            return list(
                s.scalars(
                    select(DeliveryRow)
                    .where(DeliveryRow.digest_date == digest_date)
                    .order_by(DeliveryRow.id)
                )
            )

    def dates_with_failed_deliveries(self) -> list[date]:
        """The digest dates with a failed delivery attempt on record, oldest first."""
        with self.session() as s:
            failed = select(DeliveryRow.digest_date).where(DeliveryRow.status == "failed")
            return list(s.scalars(failed.distinct().order_by(DeliveryRow.digest_date)))

    def items(self, digest_date: date) -> list[tuple[DigestItemRow, Paper]]:
        with self.session() as s:
            rows = s.execute(
                select(DigestItemRow, PaperRow)
                .join(PaperRow)
                .where(DigestItemRow.digest_date == digest_date)
                .order_by(DigestItemRow.position)
            ).all()
            return [(item, _paper(paper)) for item, paper in rows]

    def set_item(
        self,
        digest_date: date,
        paper_id: str,
        status: str,
        run_id: int,
        input_basis: InputBasis | None,
        error: str | None = None,
    ) -> None:
        """Set an item's status; `input_basis` None keeps the stored one."""
        values = {"status": status, "error": error, "last_run_id": run_id}
        if input_basis is not None:
            values["input_basis"] = input_basis
        with self._session.begin() as s:
            s.execute(
                update(DigestItemRow)
                .where(DigestItemRow.digest_date == digest_date, DigestItemRow.paper_id == paper_id)
                .values(**values)
            )

    # -- full texts ----------------------------------------------------------------------------

    def fulltext(self, paper: Paper) -> FullTextRow | None:
        with self.session() as s:
            return s.get(FullTextRow, (paper.arxiv_id, paper.version))

    def save_fulltext(
        self, paper: Paper, text: str | None, truncated: bool, original_chars: int
    ) -> None:
        row = FullTextRow(
            paper_id=paper.arxiv_id,
            paper_version=paper.version,
            text=text,
            truncated=truncated,
            original_chars=original_chars,
            fetched_at=utcnow(),
        )
        self._insert_once(row)

    # -- results -------------------------------------------------------------------------------

    def summary(self, paper_id: str, key: WorkKey) -> SummaryRow | None:
        return self._result(SummaryRow, paper_id, key)

    def review(self, paper_id: str, key: WorkKey) -> ReviewRow | None:
        return self._result(ReviewRow, paper_id, key)

    def save_summary(
        self,
        paper: Paper,
        key: WorkKey,
        text: str,
        run_id: int,
        call: CallRecord | None = None,
        earlier: Sequence[CallRecord] = (),
    ) -> None:
        """Store a summary, with the record of the call that produced it (and of `earlier`
        calls that led to it: a looping reply asked again) in the same transaction (a kill
        between the two would otherwise make a rerun ask again and record it twice)."""
        self._insert_once(
            SummaryRow(
                paper_id=paper.arxiv_id,
                paper_version=paper.version,
                model=key.model,
                prompt_version=key.prompt_version,
                input_basis=key.input_basis,
                text=text,
                run_id=run_id,
                created_at=utcnow(),
            ),
            *earlier,
            call,
        )

    def save_review(
        self,
        paper: Paper,
        key: WorkKey,
        review: Review | None,
        parse_status: str,
        raw_text: str,
        parse_error: str | None,
        run_id: int,
        call: CallRecord | None = None,
    ) -> None:
        """Store a review (with its call's record, in one transaction); one that failed to parse
        is replaced by the next reply."""
        self._delete_result(ReviewRow, paper.arxiv_id, key, only_unparsed=True)
        self._insert_once(
            ReviewRow(
                paper_id=paper.arxiv_id,
                paper_version=paper.version,
                model=key.model,
                prompt_version=key.prompt_version,
                input_basis=key.input_basis,
                parse_status=parse_status,
                review=review.model_dump() if review else None,
                raw_text=raw_text,
                parse_error=parse_error,
                overall=review.overall if review else None,
                decision=review.decision if review else None,
                run_id=run_id,
                created_at=utcnow(),
            ),
            call,
        )

    def record_call(self, call: CallRecord) -> None:
        with self._session.begin() as s:
            s.add(_call_row(call))

    def calls(self, run_id: int | None = None) -> list[ModelCallRow]:
        with self.session() as s:
            query = select(ModelCallRow).order_by(ModelCallRow.id)
            if run_id is not None:
                query = query.where(ModelCallRow.run_id == run_id)
            return list(s.scalars(query))

    # -- reading a digest back ----------------------------------------------------------------

    def load_digest(
        self, digest_date: date, model: str | None = None, prompt_version: str | None = None
    ) -> DailyDigest | None:
        """The digest of a date as last produced: the latest run's model and prompt version
        unless given. None when the date was never run."""
        runs = self.runs_for(digest_date)
        items = self.items(digest_date)
        if not items and not runs:
            return None  # a date that was never run; a run that found no papers is a digest
        last = runs[-1] if runs else None
        model = model or (last.model if last else "")
        prompt_version = prompt_version or (last.prompt_version if last else "")
        digest = DailyDigest(digest_date, model, prompt_version, _as_utc(_changed_at(runs)))
        earlier = self.published_before(digest_date, [paper.arxiv_id for _, paper in items])
        for item, paper in items:
            key = WorkKey(model, prompt_version, item.input_basis)  # type: ignore[arg-type]
            entry = self._entry(item, paper, key)
            entry.also_in = earlier.get(paper.arxiv_id)
            digest.entries.append(entry)
        return digest

    def digest_dates(self, limit: int | None = 30) -> list[date]:
        """Dates with a digest, newest first; `limit` None: all of them."""
        with self.session() as s:
            return list(
                s.scalars(
                    select(DigestItemRow.digest_date)
                    .distinct()
                    .order_by(DigestItemRow.digest_date.desc())
                    .limit(limit)
                )
            )

    def _entry(self, item: DigestItemRow, paper: Paper, key: WorkKey) -> DigestEntry:
        summary = self.summary(paper.arxiv_id, key)
        review = self.review(paper.arxiv_id, key)
        status = item.status if item.status in ("done", "failed", "below_cut") else "pending"
        return DigestEntry(
            paper=paper,
            status=status,
            summary=summary.text if summary else None,  # type: ignore[arg-type]
            review=Review.model_validate(review.review) if review and review.review else None,
            review_raw=review.raw_text if review else None,
            review_parse_status=review.parse_status if review else None,  # type: ignore[arg-type]
            input_basis=key.input_basis,
            source_text=self._source_text(summary, key),
            prompt_version=key.prompt_version,
            error=item.error,
            rank_score=item.rank_score,
            for_you=list(item.for_you or []),
        )

    def _source_text(self, summary: SummaryRow | None, key: WorkKey) -> str | None:
        """The full text a full-text summary was made from: of the paper version it was made
        for (a newer version's text is not what the model read); None for the abstract."""
        if summary is None or key.input_basis != "fulltext":
            return None
        with self.session() as s:
            row = s.get(FullTextRow, (summary.paper_id, summary.paper_version))
        return row.text if row is not None else None

    def _result(
        self, table: type[SummaryRow] | type[ReviewRow], paper_id: str, key: WorkKey
    ) -> SummaryRow | ReviewRow | None:
        with self.session() as s:
            return s.scalars(
                select(table).where(
                    table.paper_id == paper_id,
                    table.model == key.model,
                    table.prompt_version == key.prompt_version,
                    table.input_basis == key.input_basis,
                )
            ).first()

    def forget_results(self, paper_id: str, model: str, prompt_version: str) -> None:
        """Drop a paper's summaries and reviews by this model and prompt (either input basis),
        so that the next run asks for them again (`digest run --redo`)."""
        for basis in ("abstract", "fulltext"):
            key = WorkKey(model, prompt_version, basis)
            self._delete_result(SummaryRow, paper_id, key)
            self._delete_result(ReviewRow, paper_id, key)

    def _delete_result(
        self,
        table: type[SummaryRow] | type[ReviewRow],
        paper_id: str,
        key: WorkKey,
        only_unparsed: bool = False,
    ) -> None:
        query = delete(table).where(
            table.paper_id == paper_id,
            table.model == key.model,
            table.prompt_version == key.prompt_version,
            table.input_basis == key.input_basis,
        )
        if only_unparsed:
            query = query.where(ReviewRow.parse_status == "failed")
        with self._session.begin() as s:
            s.execute(query)

    def _insert_once(self, row: object, *calls: CallRecord | None) -> None:
        made = [call for call in calls if call is not None]
        try:
            with self._session.begin() as s:
                s.add(row)
                s.add_all([_call_row(call) for call in made])
        except IntegrityError:
            # Already stored by an earlier (interrupted) run: keep the first; the calls were
            # made all the same.
            for call in made:
                self.record_call(call)


def _call_row(call: CallRecord) -> ModelCallRow:
    return ModelCallRow(**{f: getattr(call, f) for f in CallRecord.__slots__})


def _changed_at(runs: list[RunRow]) -> datetime:
    """When the digest last changed: the end of the first of the latest runs that all left the
    same fingerprint (a rerun that changed nothing keeps the time). Runs that ended by an error
    recorded none and are passed over; without any fingerprint, the last run's time."""
    hashed = [r for r in runs if r.content_hash and r.finished_at]
    if not hashed:
        last = runs[-1] if runs else None
        return (last.finished_at or last.started_at) if last else utcnow()
    since = hashed[-1]
    for run in reversed(hashed):
        if run.content_hash != since.content_hash:
            break
        since = run
    return since.finished_at  # type: ignore[return-value]


def _paper_fields(paper: Paper) -> dict:
    return {
        "version": paper.version,
        "title": paper.title,
        "abstract": paper.abstract,
        "authors": list(paper.authors),
        "categories": list(paper.categories),
        "published": paper.published,
        "updated": paper.updated,
    }


def _paper(row: PaperRow) -> Paper:
    return Paper(
        arxiv_id=row.arxiv_id,
        title=row.title,
        abstract=row.abstract,
        authors=list(row.authors),
        categories=list(row.categories),
        version=row.version,
        published=_as_utc(row.published),
        updated=_as_utc(row.updated),
    )


def _as_utc(value: datetime | None) -> datetime | None:
    # SQLite hands back naive datetimes; they were written as UTC.
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)
