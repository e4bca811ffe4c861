"""A paper's full text from its arXiv HTML rendering, as plain text within a character budget.

arXiv renders most papers since Dec 2023 to HTML with LaTeXML: the paper sits in `<article>`,
formulas are MathML whose `alttext` holds the LaTeX source. We keep the LaTeX (as `$...$`), since
a model reads it better than flattened MathML. Any failure returns None: the caller then reviews
the abstract instead."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from bs4 import BeautifulSoup, Tag

from digest.clean_text import xml_safe
from digest.paper import Paper
from digest.sources.arxiv_api import normalize_space
from digest.sources.polite_http import PoliteClient, SourceError

HTML_URL = "https://arxiv.org/html"
HTML_ACCEPT = "text/html, application/xhtml+xml;q=0.9, */*;q=0.1"

log = logging.getLogger(__name__)

_DROP = ["head", "script", "style", "noscript", "template", "nav", "header", "footer", "button"]
_DROP += ["form", "iframe", "img", "svg", "picture", "canvas", "video", "audio"]
# The reference list costs budget and tells a reviewer little.
_DROP_CLASSES = ["ltx_bibliography"]
_BLOCKS = ["p", "div", "section", "article", "main", "aside", "h1", "h2", "h3", "h4", "h5"]
_BLOCKS += ["h6", "ul", "ol", "li", "dl", "dt", "dd", "figure", "figcaption", "blockquote"]
_BLOCKS += ["pre", "table", "tr", "br", "hr"]
_CELLS = ["td", "th"]
_BREAK = "\x1e"  # marks a block boundary until the text is split into paragraphs
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s")


@dataclass(slots=True)
class FullText:
    text: str
    truncated: bool
    original_chars: int


def html_to_text(html: str) -> str:
    """Headings, paragraphs, list items and captions, one per block, separated by blank lines."""
    soup = BeautifulSoup(html, "html.parser")
    root = soup.find("article") or soup.body or soup
    for tag in root.find_all(_DROP) + root.find_all(class_=_DROP_CLASSES):
        if not tag.decomposed:
            tag.decompose()
    for math in root.find_all("math"):
        math.replace_with(f"${_latex(math)}$")
    for tag in root.find_all(_BLOCKS):
        tag.insert_before(_BREAK)
        tag.insert_after(_BREAK)
    for cell in root.find_all(_CELLS):
        cell.insert_after(" ")
    paragraphs = (normalize_space(part) for part in root.get_text().split(_BREAK))
    return "\n\n".join(part for part in paragraphs if part)


def _latex(math: Tag) -> str:
    alttext = math.get("alttext")
    if isinstance(alttext, str) and alttext.strip():
        return normalize_space(alttext)
    annotation = math.find("annotation", encoding="application/x-tex")
    source = annotation.get_text() if annotation else math.get_text(" ")
    return normalize_space(source)


def truncate_text(text: str, max_chars: int) -> FullText:
    """At most `max_chars` characters, cut at the last paragraph end, else the last sentence end,
    else the last space, if one lies in the budget's second half; else exactly at the budget."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    if len(text) <= max_chars:
        return FullText(text=text, truncated=False, original_chars=len(text))
    # The character after the budget counts: a cut before a blank line or space is a clean one.
    window = text[: max_chars + 1]
    floor = max_chars // 2
    cut = window.rfind("\n\n")
    if cut < floor:
        ends = [match.end() - 1 for match in _SENTENCE_END.finditer(window)]
        cut = ends[-1] if ends else -1  # just after the punctuation, before the space
    if cut < floor:
        cut = window.rfind(" ")
    if cut < floor:
        cut = max_chars
    return FullText(text=text[:cut].rstrip(), truncated=True, original_chars=len(text))


def fulltext_url(paper: Paper, base_url: str = HTML_URL) -> str:
    return f"{base_url}/{paper.arxiv_id}v{paper.version}"


def fetch_fulltext(client: PoliteClient, paper: Paper, base_url: str = HTML_URL) -> str | None:
    """The paper's HTML as text; None when there is none (404) or it cannot be had."""
    url = fulltext_url(paper, base_url)
    try:
        response = client.get(url, accept=HTML_ACCEPT)
    except SourceError as exc:
        log.warning("no full text for %s: %s", paper.arxiv_id, exc)
        return None
    if response.status_code == 404:
        return None
    return xml_safe(html_to_text(response.text)) or None
