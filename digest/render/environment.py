"""The two Jinja environments the renderers share, and the filters their templates use.

HTML and Atom use Jinja's autoescaping. Markdown has no autoescaping in Jinja, so its environment
escapes every `{{ ... }}` through `finalize`: a template that forgets a filter still cannot emit
raw paper text. Only values the code has already made safe (`Verbatim`) pass through unchanged."""

from __future__ import annotations

import html
import re
from datetime import UTC, datetime
from functools import cache

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from digest.entries import DigestEntry
from digest.faithfulness import entry_source, unsupported
from digest.latex_text import latex_to_text

# Display math first so `$$a$$` is not read as two empty inline spans; `\$` is a literal dollar.
_MATH_RE = re.compile(r"(?<!\\)\$\$.+?(?<!\\)\$\$|(?<!\\)\$(?:\\.|[^$\\])+?\$", re.DOTALL)
# Characters CommonMark/GFM give meaning inside a line. `\` only matters before punctuation
# (`\alpha` shows as typed), so only that case is escaped and LaTeX outside `$` stays readable.
_MD_ACTIVE_RE = re.compile(r"[`*_\[\]~]|\\(?=[!-/:-@\[-`{-~])")
# What would make a value that starts a line (an author list, a list item) a heading, list item,
# quote or setext underline: the marker must be followed by a space or end the line.
_MD_LINE_START_RE = re.compile(r"^(?:#{1,6}|[+-]|\d{1,9}[.)])(?=\s|$)|^[=-]+$")
_URL_UNSAFE = str.maketrans({c: f"%{ord(c):02X}" for c in "% ()<>"})


class Verbatim(str):
    """Markdown that the code has already made safe; `finalize` leaves it alone."""


def score(value: int | None, scale: int) -> str:
    """`7/10`, or `n/a` for a sub-score the reviewer left out (e.g. judged from an abstract)."""
    return "n/a" if value is None else f"{value}/{scale}"


def as_utc(moment: datetime) -> datetime:
    """Timestamps from the store may be naive; they are UTC by the store's convention."""
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


def rfc3339(moment: datetime) -> str:
    return as_utc(moment).isoformat(timespec="seconds").replace("+00:00", "Z")


def display_time(moment: datetime) -> str:
    return as_utc(moment).strftime("%Y-%m-%d %H:%M UTC")


def escape_markdown(text: str) -> str:
    """Make one line of paper text inert in Markdown while keeping its `$...$` math as written.

    Whitespace is collapsed (an abstract's line breaks must not start a list or heading).
    `<`, `>`, `&` become HTML entities everywhere, math included, so no HTML tag or autolink can
    form; outside math the Markdown-active characters are backslash-escaped."""
    text = " ".join(text.split())
    parts: list[str] = []
    pos = 0
    for match in _MATH_RE.finditer(text):
        parts.append(_escape_prose(text[pos : match.start()]))
        parts.append(html.escape(match.group(), quote=False))
        pos = match.end()
    parts.append(_escape_prose(text[pos:]))
    out = "".join(parts)
    return _MD_LINE_START_RE.sub(_escape_line_start, out, count=1)


def _escape_line_start(match: re.Match[str]) -> str:
    mark = match.group()
    # `1.` starts a list only with its dot, so the dot is escaped, not the digits.
    return f"{mark[:-1]}\\{mark[-1]}" if mark[0].isdigit() else "\\" + mark


def _escape_prose(text: str) -> str:
    return _MD_ACTIVE_RE.sub(lambda m: "\\" + m.group(), html.escape(text, quote=False))


def markdown_pre(text: str) -> Verbatim:
    """A preformatted block shown exactly as written: an HTML `<pre>` with escaped content, which
    Markdown passes through untouched (a code fence would show the entities literally)."""
    return Verbatim(f"<pre>{html.escape(text, quote=False)}</pre>")


def markdown_url(url: str) -> Verbatim:
    """A link destination: characters that would end it or open HTML are percent-encoded."""
    return Verbatim(url.translate(_URL_UNSAFE))


def _finalize_markdown(value: object) -> str:
    if isinstance(value, Verbatim):
        return value
    return escape_markdown(str(value))


def unverified(summary: str, entry: DigestEntry) -> list[str]:
    """The summary's numbers and names that the text it was made from lacks (the title and the
    abstract or full text, as its prompt showed them): what a reader cannot check
    (digest/faithfulness.py)."""
    return unsupported(summary, entry_source(entry))


def _add_filters(env: Environment) -> Environment:
    env.filters.update(
        score=score,
        rfc3339=rfc3339,
        display_time=display_time,
        tex=latex_to_text,
        unverified=unverified,
    )
    return env


@cache
def html_environment() -> Environment:
    """For `.html` and `.xml` templates: autoescaped; the `.css` include is taken literally."""
    env = Environment(
        loader=PackageLoader("digest.render", "templates"),
        autoescape=select_autoescape(["html", "xml"]),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    return _add_filters(env)


@cache
def markdown_environment() -> Environment:
    env = Environment(
        loader=PackageLoader("digest.render", "templates"),
        autoescape=False,
        finalize=_finalize_markdown,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters.update(pre=markdown_pre, url=markdown_url)
    return _add_filters(env)
