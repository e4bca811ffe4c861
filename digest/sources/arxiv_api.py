"""Papers from the arXiv query API (Atom): one UTC day's submissions in some categories, paged.

Also home of what every feed-reading source shares: feedparser with a clear error for a broken
document, whitespace normalisation, and keeping one Paper per arXiv id."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Iterable
from datetime import UTC, date, datetime
from typing import Any

import feedparser

from digest.paper import InvalidArxivId, Paper, parse_arxiv_id
from digest.sources.polite_http import ATOM_ACCEPT, HttpStatusError, PoliteClient, SourceError

API_URL = "https://export.arxiv.org/api/query"

log = logging.getLogger(__name__)


def normalize_space(text: str) -> str:
    """Collapse the line wrapping and runs of spaces of older arXiv responses."""
    return " ".join(text.split())


def unique(items: Iterable[str]) -> list[str]:
    """Items in first-seen order without duplicates."""
    return list(dict.fromkeys(item for item in items if item))


def parse_feed(data: str | bytes, origin: str, strict: bool = False) -> Any:
    """Parse Atom or RSS with feedparser; raise `SourceError` for a document it cannot read.
    strict: also for one it could only partly read. A damaged page from the network is worth
    its recovered entries; a damaged file is not: its recovered fields can be wrong (an
    entity-expansion bomb leaves titles like "&lol9;" that would overwrite stored papers)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    # A stream, never a str: feedparser would take a str that looks like a URL or path as one.
    # No sanitising: RSS descriptions are plain text that feedparser would read as HTML, and its
    # sanitiser drops text such as "x<y and y>z". Our fields are plain text; renderers escape.
    feed = feedparser.parse(io.BytesIO(raw), sanitize_html=False, resolve_relative_uris=False)
    # A wrong encoding declaration is harmless: feedparser decoded the document another way.
    broken = feed.bozo and not isinstance(feed.bozo_exception, feedparser.CharacterEncodingOverride)
    if broken and (strict or not feed.entries):
        raise SourceError(f"{origin}: malformed feed ({feed.bozo_exception})")
    if not feed.get("version"):  # well-formed, but HTML, an empty body, or other XML
        raise SourceError(f"{origin}: not an Atom or RSS feed")
    if broken:  # recovered entries from a damaged document: use them, but say so
        log.warning(
            "%s: malformed feed, read %d entries (%s)",
            origin,
            len(feed.entries),
            feed.bozo_exception,
        )
    return feed


def keep_latest_versions(papers: Iterable[Paper]) -> list[Paper]:
    """One Paper per arXiv id, the highest version, at the place the id was first seen."""
    latest: dict[str, Paper] = {}
    for paper in papers:
        seen = latest.get(paper.arxiv_id)
        if seen is None or paper.version > seen.version:
            latest[paper.arxiv_id] = paper
    return list(latest.values())


def parse_atom(text: str | bytes, origin: str, strict: bool = False) -> list[Paper]:
    """Papers of an arXiv API response, current or older (line-wrapped) format."""
    return page_papers(parse_feed(text, origin, strict), origin)


def page_papers(feed: Any, origin: str) -> list[Paper]:
    message = _api_error(feed)
    if message is not None:
        raise SourceError(f"{origin}: arXiv API error: {message}")
    papers = [_paper(entry, f"{origin}: entry {n}") for n, entry in enumerate(feed.entries, 1)]
    return keep_latest_versions(papers)


def _api_error(feed: Any) -> str | None:
    """How the API reports a bad query: an entry with an `api/errors` id and the message."""
    for entry in feed.entries:
        entry_id = entry.get("id", "")
        if "arxiv.org/api/errors" in entry_id:
            return normalize_space(entry.get("summary", "")) or entry_id
    return None


def _paper(entry: Any, where: str) -> Paper:
    try:
        arxiv_id, version = parse_arxiv_id(entry.get("id", ""))
    except InvalidArxivId as exc:
        raise SourceError(f"{where}: {exc}") from exc
    primary = entry.get("arxiv_primary_category", {}).get("term", "")
    return Paper(
        arxiv_id=arxiv_id,
        title=normalize_space(entry.get("title", "")),
        abstract=normalize_space(entry.get("summary", "")),
        authors=unique(normalize_space(a.get("name", "")) for a in entry.get("authors", [])),
        categories=unique([primary, *(tag.get("term", "") for tag in entry.get("tags", []))]),
        version=version or 1,
        published=_utc(entry.get("published_parsed")),
        updated=_utc(entry.get("updated_parsed")),
    )


def _utc(parsed: time.struct_time | None) -> datetime | None:
    # feedparser has already converted the timestamp to UTC.
    return datetime(*parsed[:6], tzinfo=UTC) if parsed else None


def day_query(categories: list[str], day: date) -> str:
    """The API query for papers in any of `categories` submitted on `day` (UTC)."""
    cats = " OR ".join(f"cat:{category}" for category in categories)
    stamp = day.strftime("%Y%m%d")
    return f"({cats}) AND submittedDate:[{stamp}0000 TO {stamp}2359]"


def fetch_arxiv_api(
    client: PoliteClient,
    categories: list[str],
    day: date,
    max_papers: int | None,
    base_url: str = API_URL,
    page_size: int = 100,
) -> list[Paper]:
    """All papers submitted on `day` in `categories` (up to `max_papers`), page by page."""
    if not categories:
        raise ValueError("no arXiv categories to fetch")
    query = day_query(categories, day)
    papers: list[Paper] = []
    start = 0
    while max_papers is None or len(papers) < max_papers:
        wanted = page_size if max_papers is None else min(page_size, max_papers - len(papers))
        feed = get_page(client, base_url, query, start, wanted)
        papers = keep_latest_versions([*papers, *page_papers(feed, f"{base_url} (start={start})")])
        start += len(feed.entries)
        total = str(feed.feed.get("opensearch_totalresults", "0")).strip()
        if start >= (int(total) if total.isdigit() else 0):
            break
        if not feed.entries:  # the API sometimes answers a page short; we keep what we have
            log.warning("%s: empty page at start=%d of %s results", base_url, start, total)
            break
    return papers[:max_papers]


def get_page(client: PoliteClient, base_url: str, query: str, start: int, size: int) -> Any:
    params: dict[str, str | int] = {
        "search_query": query,
        # Ascending: submissions arriving while we page append at the end, offsets stay valid.
        "sortBy": "submittedDate",
        "sortOrder": "ascending",
        "start": start,
        "max_results": size,
    }
    origin = f"{base_url} (start={start})"
    try:
        response = client.get(base_url, params=params, accept=ATOM_ACCEPT)
    except HttpStatusError as exc:
        # A bad query comes back as HTTP 400 whose body is a feed with the API's error entry.
        message = _api_error(feedparser.parse(io.BytesIO(exc.response.content)))
        if message is None:
            raise
        raise SourceError(f"{origin}: arXiv API error: {message}") from exc
    if response.status_code == 404:
        raise SourceError(f"{response.url}: HTTP 404 Not Found")
    return parse_feed(response.content, origin)
