"""One day's digest as a self-contained HTML page: inline CSS, no scripts, nothing fetched.

All paper and model text goes through Jinja's autoescaping, so a title such as `<b>` shows as
typed, and LaTeX reaches the browser unchanged apart from the entities for `<`, `>`, `&`, quotes."""

from __future__ import annotations

from datetime import date

from digest.entries import DailyDigest
from digest.render.environment import html_environment


def file_name(day: date) -> str:
    return f"digest-{day.isoformat()}.html"


def render_html_page(digest: DailyDigest) -> str:
    return html_environment().get_template("digest.html").render(digest=digest)
