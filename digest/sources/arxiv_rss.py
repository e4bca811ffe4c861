"""Papers from arXiv's daily announcement feed (https://rss.arxiv.org/rss/cs.CL+cs.LG).

The feed lists one announcement day. Each item says why it is there (`arxiv:announce_type`):
`new` submissions, `cross`-lists from other categories, and `replace`/`replace-cross` for new
versions of older papers, which a daily digest has already seen and skips."""

from __future__ import annotations

import re
from typing import Any

from digest.paper import InvalidArxivId, Paper, parse_arxiv_id
from digest.sources.arxiv_api import keep_latest_versions, normalize_space, parse_feed, unique
from digest.sources.polite_http import PoliteClient, SourceError

RSS_URL = "https://rss.arxiv.org/rss"
RSS_ACCEPT = "application/rss+xml, application/xml;q=0.9, */*;q=0.1"

# "arXiv:2403.01234v1 Announce Type: new \nAbstract: ..." is how every description starts.
_TYPE_RE = re.compile(r"Announce Type:\s*(\S+)")
_ABSTRACT_RE = re.compile(r"Abstract:\s*(.*)", re.DOTALL)


def parse_rss(text: str | bytes, origin: str, include_cross: bool) -> list[Paper]:
    """The `new` (and, with `include_cross`, `cross`) announcements of one feed document."""
    wanted = {"new", "cross"} if include_cross else {"new"}
    papers = []
    for number, item in enumerate(parse_feed(text, origin).entries, start=1):
        announce_type = _announce_type(item)
        if announce_type in wanted:
            papers.append(_paper(item, announce_type, f"{origin}: item {number}"))
    return keep_latest_versions(papers)


def _announce_type(item: Any) -> str:
    # The element is the source of truth; the description repeats it, for feeds without one.
    found = item.get("arxiv_announce_type")
    if not found:
        match = _TYPE_RE.search(item.get("summary", ""))
        found = match.group(1) if match else ""
    return found.strip().lower()


def _paper(item: Any, announce_type: str, where: str) -> Paper:
    try:
        arxiv_id, version = parse_arxiv_id(item.get("id") or item.get("link", ""))
    except InvalidArxivId as exc:
        raise SourceError(f"{where}: {exc}") from exc
    description = item.get("summary", "")
    match = _ABSTRACT_RE.search(description)
    creators = ",".join(author.get("name", "") for author in item.get("authors", []))
    return Paper(
        arxiv_id=arxiv_id,
        title=normalize_space(item.get("title", "")),
        abstract=normalize_space(match.group(1) if match else description),
        authors=unique(normalize_space(name) for name in creators.split(",")),
        categories=unique(tag.get("term", "") for tag in item.get("tags", [])),
        version=version or 1,
        announce_type=announce_type,
    )


def fetch_arxiv_rss(
    client: PoliteClient,
    categories: list[str],
    include_cross: bool,
    max_papers: int | None,
    base_url: str = RSS_URL,
) -> list[Paper]:
    """Today's announcements in `categories` (one request for all of them)."""
    if not categories:
        raise ValueError("no arXiv categories to fetch")
    url = f"{base_url}/{'+'.join(categories)}"
    response = client.get(url, accept=RSS_ACCEPT)
    if response.status_code == 404:
        raise SourceError(f"{url}: HTTP 404 Not Found (unknown category?)")
    return parse_rss(response.content, url, include_cross)[:max_papers]
