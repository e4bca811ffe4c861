"""Where the digest's papers come from: the arXiv API, the announcement feed, or a local file.

`load_papers` is the one entry point the pipeline calls; each source module can also be used alone.
Full text (`fulltext.py`) is fetched later, per paper, by the pipeline."""

from __future__ import annotations

from datetime import date
from pathlib import Path

from digest.clean_text import clean_paper
from digest.paper import Paper
from digest.sources.arxiv_api import API_URL, fetch_arxiv_api
from digest.sources.arxiv_rss import RSS_URL, fetch_arxiv_rss
from digest.sources.local_file import load_papers_file
from digest.sources.polite_http import (
    PoliteClient,
    PoliteHttpConfig,
    SourceError,
    SourceUnreachable,
)

__all__ = [
    "DEFAULT_CATEGORIES",
    "PoliteClient",
    "PoliteHttpConfig",
    "SourceError",
    "SourceUnreachable",
    "load_papers",
]


DEFAULT_CATEGORIES = ("cs.CL", "cs.LG")


def load_papers(
    source: str,
    *,
    categories: list[str] | None,
    day: date,
    max_papers: int | None,
    client: PoliteClient | None = None,
    include_cross: bool = False,
    api_url: str = API_URL,
    rss_url: str = RSS_URL,
) -> list[Paper]:
    """Papers from `source`: "arxiv" (the API, papers submitted on `day` UTC), "rss" (the latest
    announcement day; `day` is not used), or else the path of a local file (all its papers, or
    those in any of `categories` when given). The feeds default to DEFAULT_CATEGORIES.
    Their text is cleaned of what XML and PostgreSQL cannot hold, whatever the source."""
    if source not in ("arxiv", "rss"):
        papers = load_papers_file(Path(source), None if categories else max_papers)
        if categories:
            wanted = set(categories)
            papers = [p for p in papers if wanted.intersection(p.categories)][:max_papers]
        return [clean_paper(p) for p in papers]
    if categories is None:
        categories = list(DEFAULT_CATEGORIES)
    own_client = client is None
    client = client or PoliteClient()
    try:
        if source == "arxiv":
            papers = fetch_arxiv_api(client, categories, day, max_papers, base_url=api_url)
        else:
            papers = fetch_arxiv_rss(
                client, categories, include_cross, max_papers, base_url=rss_url
            )
        return [clean_paper(p) for p in papers]
    finally:
        if own_client:
            client.close()
