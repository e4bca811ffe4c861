"""An Atom feed of the recent digests: one entry per day, linking to that day's HTML page, its
summary listing each reviewed paper with the paper's summary ("for you" papers first), so that a
feed reader shows what the papers are about, not only their titles.

Entry ids must not change when a day is re-rendered, or readers show it again as new: they are the
page's URL under `site_url` when there is one, else a tag: URI (RFC 4151) built from the date.
Without `site_url` links are relative to the feed, which readers resolve against its own URL."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime

from digest.entries import DailyDigest
from digest.render import html_page
from digest.render.environment import as_utc, html_environment

# A tag: URI needs an authority and a date it was held; both only make the ids unique, so they
# are fixed forever (changing them would re-announce every digest).
_TAG_PREFIX = "tag:nightshift,2025:"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)  # `updated` of a feed with no entries


@dataclass(slots=True)
class FeedItem:
    digest: DailyDigest
    url: str
    entry_id: str


def render_feed(recent: list[DailyDigest], *, site_url: str | None = None) -> str:
    """`recent` newest first; a date given twice keeps its first (newest) digest."""
    base = site_url.rstrip("/") + "/" if site_url else ""
    digests = _one_per_date(recent)
    items = [_item(d, base) for d in digests]
    updated = max((as_utc(d.generated_at) for d in digests), default=_EPOCH)
    return (
        html_environment()
        .get_template("feed.xml")
        .render(
            items=items,
            updated=updated,
            feed_id=f"{base}feed.xml" if base else f"{_TAG_PREFIX}digest",
            index_url=f"{base}index.html",
            self_url=f"{base}feed.xml" if base else None,
        )
    )


def _item(digest: DailyDigest, base: str) -> FeedItem:
    name = html_page.file_name(digest.digest_date)
    entry_id = base + name if base else f"{_TAG_PREFIX}digest/{digest.digest_date.isoformat()}"
    return FeedItem(digest=digest, url=base + name, entry_id=entry_id)


def _one_per_date(recent: list[DailyDigest]) -> list[DailyDigest]:
    seen: dict[date, DailyDigest] = {}
    for digest in recent:
        seen.setdefault(digest.digest_date, digest)
    return sorted(seen.values(), key=lambda d: d.digest_date, reverse=True)
