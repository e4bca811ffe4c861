"""The index page: every digest page found in the output directory, newest first.

It lists files rather than the store's digests so that it links exactly what can be opened,
including days rendered by an earlier version or copied in by hand."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from digest.render.environment import html_environment

_PAGE_RE = re.compile(r"digest-(\d{4}-\d{2}-\d{2})\.html")


@dataclass(slots=True, frozen=True)
class DigestPage:
    day: date
    name: str


def digest_pages(out_dir: Path) -> list[DigestPage]:
    pages = []
    for path in out_dir.iterdir():
        match = _PAGE_RE.fullmatch(path.name)
        if match is None or not path.is_file():
            continue
        try:
            pages.append(DigestPage(date.fromisoformat(match.group(1)), path.name))
        except ValueError:  # digest-2024-13-99.html: not ours
            continue
    return sorted(pages, key=lambda page: page.day, reverse=True)


def render_index_page(out_dir: Path) -> str:
    return html_environment().get_template("index.html").render(pages=digest_pages(out_dir))
