"""What is new on arXiv since the last night: the nightly selection of the query API.

arXiv lists a paper only once it is announced, hours to days after its submission (late-day and
Friday submissions wait for the next announcement; none happen on Saturdays; moderation can hold
a paper longer). A query for one calendar day's submissions therefore misses every paper that was
not yet announced when that day was asked for, and no later night asks again. Instead each night
asks for everything submitted since a watermark - the newest submission time among the papers
earlier nights took, kept in the store per category set - less an overlap for late announcements,
and leaves out what some digest already lists (by arXiv id, whatever its version). A paper is
then taken by the first night after its announcement, once, across weekends, missed nights and
reruns; `--date` keeps the calendar query for backfills.

Only papers announced later than the overlap after newer ones are missed (a hold of more than
`overlap` days); widen `--overlap-days` where that matters."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from digest.paper import Paper
from digest.sources.arxiv_api import API_URL, get_page, page_papers
from digest.sources.polite_http import PoliteClient

log = logging.getLogger(__name__)

DEFAULT_OVERLAP = timedelta(days=3)


def source_key(categories: list[str]) -> str:
    """The watermark's name: one per category set, in any order ("arxiv:cs.CL,cs.LG")."""
    return "arxiv:" + ",".join(sorted(set(categories)))


def window_start(watermark: datetime | None, first_day: date, overlap: timedelta) -> datetime:
    """Where tonight's query starts: the watermark less the overlap or, on a first night, the
    start of the digest's date (what a first run took before watermarks: that day's papers)."""
    if watermark is None:
        return datetime.combine(first_day, time(0, 0), tzinfo=UTC)
    return watermark - overlap


def since_query(categories: list[str], since: datetime, until: datetime) -> str:
    """Papers in any of `categories` submitted in [since, until] (UTC, to the minute)."""
    cats = " OR ".join(f"cat:{category}" for category in categories)
    start, end = (moment.astimezone(UTC).strftime("%Y%m%d%H%M") for moment in (since, until))
    return f"({cats}) AND submittedDate:[{start} TO {end}]"


@dataclass(slots=True)
class NewPapers:
    papers: list[Paper]  # tonight's: in submission order, none listed by another date
    since: datetime  # where the query started
    skipped: int  # papers in the window that another date's digest lists
    waiting: int  # new papers beyond max_papers, left for the next night


def fetch_arxiv_new(
    client: PoliteClient,
    categories: list[str],
    since: datetime,
    max_papers: int | None,
    listed_elsewhere: Callable[[list[str]], set[str]],
    base_url: str = API_URL,
    page_size: int = 100,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> NewPapers:
    """Papers submitted since `since`, oldest first, that `listed_elsewhere` does not name, up
    to `max_papers` (the rest wait: the watermark stops at the newest one taken)."""
    if not categories:
        raise ValueError("no arXiv categories to fetch")
    # The query needs an end; a day past now covers clocks that disagree by hours.
    query = since_query(categories, since, now() + timedelta(days=1))
    taken: dict[str, Paper] = {}
    skipped: set[str] = set()
    start, total, waiting = 0, 0, 0
    while max_papers is None or len(taken) < max_papers:
        feed = get_page(client, base_url, query, start, page_size)
        origin = f"{base_url} (start={start})"
        page = [p for p in page_papers(feed, origin) if p.arxiv_id not in taken]
        known = listed_elsewhere([p.arxiv_id for p in page]) if page else set()
        skipped |= known
        for paper in page:
            if paper.arxiv_id in known:
                continue
            if max_papers is None or len(taken) < max_papers:
                taken[paper.arxiv_id] = paper
            else:
                waiting += 1
        start += len(feed.entries)
        found = str(feed.feed.get("opensearch_totalresults", "0")).strip()
        total = int(found) if found.isdigit() else 0
        if start >= total:
            break
        if not feed.entries:  # the API sometimes answers a page short; the next night re-asks
            log.warning("%s: empty page at start=%d of %d results", base_url, start, total)
            break
    if waiting:  # at least these, and the results not paged through (some may be listed)
        waiting += max(0, total - start)
    return NewPapers(list(taken.values()), since, len(skipped), waiting)


def newest_submission(papers: list[Paper]) -> datetime | None:
    """The watermark these papers justify: the newest first-version submission among them."""
    times = [p.published for p in papers if p.published is not None]
    return max(times) if times else None
