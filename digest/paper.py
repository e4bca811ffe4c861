"""A paper as every source returns it, and arXiv identifier handling.

An arXiv id names a paper across versions: `2401.01234v2` is version 2 of `2401.01234`, and the
store keys papers by the id without its version, so a new version updates the same row. Old-style
ids carry an archive name (`math/0211159`, `hep-th/9901001v3`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime

# New style (since 2007-04): YYMM.NNNN (4 digits to 2014, then 5); old: archive[.SUBJ]/YYMMNNN.
_ID_RE = re.compile(
    r"(?P<id>\d{4}\.\d{4,5}|[a-z][a-z\-]*(?:\.[A-Z]{2})?/\d{7})(?:v(?P<version>\d+))?$"
)
_PREFIXES = ("https://", "http://", "oai:arxiv.org:", "arxiv:")


class InvalidArxivId(ValueError):
    """Raised for a string that is not an arXiv identifier."""


def parse_arxiv_id(raw: str) -> tuple[str, int | None]:
    """Split any spelling of an arXiv id into (id without version, version or None).

    Accepts bare ids, `arXiv:` / `oai:arXiv.org:` prefixes and abs/pdf/html URLs."""
    text = raw.strip()
    lowered = text.lower()
    for prefix in _PREFIXES:
        if lowered.startswith(prefix):
            text = text[len(prefix) :]
            lowered = lowered[len(prefix) :]
    if "/abs/" in text or "/pdf/" in text or "/html/" in text:
        text = re.split(r"/(?:abs|pdf|html)/", text, maxsplit=1)[1]
    text = text.removesuffix(".pdf").rstrip("/")
    match = _ID_RE.fullmatch(text)
    if match is None:
        raise InvalidArxivId(f"not an arXiv identifier: {raw!r}")
    version = match.group("version")
    return match.group("id"), int(version) if version else None


@dataclass(slots=True)
class Paper:
    """One paper's metadata; `arxiv_id` has no version suffix."""

    arxiv_id: str
    title: str
    abstract: str
    authors: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)  # primary category first
    version: int = 1
    published: datetime | None = None  # first version's submission time (UTC)
    updated: datetime | None = None  # this version's time (UTC)
    # For papers from the announcement feed: 'new', 'cross', 'replace', ...; None otherwise.
    announce_type: str | None = None

    @property
    def abs_url(self) -> str:
        return f"https://arxiv.org/abs/{self.arxiv_id}"

    @property
    def html_url(self) -> str:
        """The paper's arXiv HTML rendering (exists for most papers since Dec 2023)."""
        return f"https://arxiv.org/html/{self.arxiv_id}v{self.version}"


def papers_count(n: int) -> str:
    """ "1 paper", "3 papers": for log lines and the report."""
    return f"{n} paper" if n == 1 else f"{n} papers"
