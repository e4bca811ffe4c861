"""What a delivery carries: an email (subject, a plain-text part and an HTML part) and a
Slack-compatible webhook payload, built from a stored digest (digest/entries.py).

The email holds the summaries, not only titles: it is read where the page is not (a phone's mail
client), and "for you" papers come first as on the page. Papers ranked below --max-papers are
listed by title; failed ones only counted (the page lists them, with their errors)."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from email.message import EmailMessage
from email.utils import formatdate, make_msgid, parseaddr
from functools import cache

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from digest.entries import DailyDigest, DigestEntry
from digest.latex_text import latex_to_text
from digest.render import html_page
from digest.render.environment import unverified

SLACK_MAX_PAPERS = 20  # a chat message is a teaser; the page and the email have everything
SLACK_SUMMARY_CHARS = 300


@dataclass(slots=True)
class Rendered:
    subject: str
    text: str
    html: str


@cache
def _environment() -> Environment:
    env = Environment(
        loader=PackageLoader("digest.delivery", "templates"),
        autoescape=select_autoescape(["html"]),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["wrap"] = lambda text: "\n  ".join(textwrap.wrap(" ".join(text.split()), 76))
    env.filters["tex"] = latex_to_text  # LaTeX as text, as the page shows it
    env.filters["unverified"] = unverified  # marked as on the page: what the paper lacks
    return env


def page_url(digest: DailyDigest, site_url: str | None) -> str | None:
    """The day's page on the web, when the pages are published somewhere (--site-url)."""
    if not site_url:
        return None
    return f"{site_url.rstrip('/')}/{html_page.file_name(digest.digest_date)}"


def subject(digest: DailyDigest) -> str:
    count = len(digest.done)
    mine = f", {len(digest.for_you)} for you" if digest.for_you else ""
    return f"Paper digest {digest.digest_date}: {count} paper{'' if count == 1 else 's'}{mine}"


def render_message(digest: DailyDigest, site_url: str | None) -> Rendered:
    values = {"digest": digest, "page_url": page_url(digest, site_url), "subject": subject(digest)}
    env = _environment()
    return Rendered(
        subject(digest),
        env.get_template("email.txt").render(**values),
        env.get_template("email.html").render(**values),
    )


def email_message(
    digest: DailyDigest, sender: str, recipients: list[str], site_url: str | None
) -> EmailMessage:
    """A multipart/alternative message: the text part first, the HTML part preferred."""
    rendered = render_message(digest, site_url)
    message = EmailMessage()
    message["Subject"] = rendered.subject
    message["From"] = sender
    message["To"] = ", ".join(recipients)
    message["Date"] = formatdate(localtime=False)
    # The sender may carry a name ("Paper digest <digest@example.org>"): its address's domain.
    message["Message-ID"] = make_msgid(domain=parseaddr(sender)[1].rpartition("@")[2] or None)
    message.set_content(rendered.text)
    message.add_alternative(rendered.html, subtype="html")
    return message


def slack_payload(digest: DailyDigest, site_url: str | None) -> dict:
    """Slack's incoming-webhook JSON (`text` in mrkdwn), which Mattermost, Rocket.Chat, Zulip's
    Slack-compatible endpoint and Discord's `/slack` URLs accept as well."""
    url = page_url(digest, site_url)
    head = f"*{_slack_escape(subject(digest))}*"
    if url:
        head += f" (<{url}|read on the web>)"
    lines = [head]
    shown = [*digest.for_you, *digest.rest][:SLACK_MAX_PAPERS]
    for entry in shown:
        lines.append(_slack_entry(entry))
    hidden = len(digest.done) - len(shown) + len(digest.below_cut)
    if hidden > 0:
        lines.append(f"…and {hidden} more" + (f": <{url}|the page>" if url else "."))
    return {"text": "\n\n".join(lines)}


def _slack_entry(entry: DigestEntry) -> str:
    title = f"<{entry.paper.abs_url}|{_slack_escape(latex_to_text(entry.paper.title))}>"
    if entry.review:
        title += f" ({entry.review.overall}/10)"
    parts = [f"• {title}"]
    if entry.for_you:
        parts.append(f"_For you: {_slack_escape('; '.join(entry.for_you))}_")
    summary = entry.summary or (entry.review.summary if entry.review else None)
    if summary:
        short = textwrap.shorten(latex_to_text(summary), SLACK_SUMMARY_CHARS, placeholder="…")
        mark = "_Unverified:_ " if unverified(summary, entry) else ""
        parts.append(mark + _slack_escape(short))
    return "\n".join(parts)


def _slack_escape(text: str) -> str:
    """Slack's three control characters; a title's `<script>` must not become markup."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
