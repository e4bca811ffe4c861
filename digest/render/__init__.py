"""Rendered outputs of the digest: per day an HTML page and a Markdown file, plus an Atom feed of
the recent days and an index of every page in the output directory.

`write_outputs` is the only entry point the job needs; `digest run` and `digest render` both call
it, so a re-render from the store gives the same bytes as the run that filled it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from digest.entries import DailyDigest
from digest.render import html_page, markdown_page
from digest.render.feed import render_feed
from digest.render.index_page import render_index_page

__all__ = ["write_atomic", "write_listings", "write_outputs", "write_pages"]

FEED_NAME = "feed.xml"
INDEX_NAME = "index.html"


def write_outputs(
    out_dir: Path, digest: DailyDigest, recent: list[DailyDigest], *, site_url: str | None = None
) -> list[Path]:
    """Write the day's pages, the feed and the index into `out_dir`; return the paths written.

    `recent` is newest first and normally includes `digest`; it is added when missing so the feed
    always has the day just rendered. The index comes last so it links the new page."""
    if all(d.digest_date != digest.digest_date for d in recent):
        recent = [digest, *recent]
    return [*write_pages(out_dir, digest), *write_listings(out_dir, recent, site_url=site_url)]


def write_pages(out_dir: Path, digest: DailyDigest) -> list[Path]:
    """The day's HTML page and Markdown file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    day = digest.digest_date
    return [
        write_atomic(out_dir / html_page.file_name(day), html_page.render_html_page(digest)),
        write_atomic(
            out_dir / markdown_page.file_name(day), markdown_page.render_markdown_page(digest)
        ),
    ]


def write_listings(
    out_dir: Path, recent: list[DailyDigest], *, site_url: str | None = None
) -> list[Path]:
    """The feed of `recent` (newest first) and the index of every page in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    announced = [d for d in recent if _announceable(out_dir, d)]
    return [
        write_atomic(out_dir / FEED_NAME, render_feed(announced, site_url=site_url)),
        write_atomic(out_dir / INDEX_NAME, render_index_page(out_dir)),
    ]


def _announceable(out_dir: Path, digest: DailyDigest) -> bool:
    """Whether the feed may carry the day: its page exists (after a lost output folder, a
    re-render of one date must not link the others' missing pages), and it reviewed a paper (a
    night whose endpoint was down lists only failures; that is news for the log, not readers)."""
    page = out_dir / html_page.file_name(digest.digest_date)
    return page.is_file() and bool(digest.done)


def write_atomic(path: Path, text: str) -> Path:
    """Replace `path` with `text` so readers see the old file or the new one, never a part.

    The temporary file sits in the same directory (os.replace is atomic only within a
    filesystem) and is fsynced first, so a crash after the rename cannot leave an empty file."""
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file 0600; the pages are meant to be served by a web server.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as tmp:
            tmp.write(text)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return path
