"""One day's digest as Markdown, with the same content as the HTML page.

The template never emits paper text raw: the Markdown environment escapes every expression
(see `environment.escape_markdown`), which keeps HTML inert and `$...$` math as written."""

from __future__ import annotations

from datetime import date

from digest.entries import DailyDigest
from digest.render.environment import markdown_environment


def file_name(day: date) -> str:
    return f"digest-{day.isoformat()}.md"


def render_markdown_page(digest: DailyDigest) -> str:
    text = markdown_environment().get_template("digest.md").render(digest=digest)
    return text.rstrip("\n") + "\n"  # the last entry's paragraph gap is not wanted at the end
