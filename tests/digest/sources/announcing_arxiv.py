"""A fake arXiv query API on 127.0.0.1 that lists papers only once they are announced.

arXiv's schedule (https://info.arxiv.org/help/availability.html), in US Eastern time (EST,
UTC-5, all year here): submissions close at 14:00 Monday to Friday and are announced at 20:00
the same day, Sunday to Thursday; what arrives between Thursday 14:00 and Friday 14:00 is
announced on Sunday, between Friday 14:00 and Monday 14:00 on Monday. Papers can be held longer
(`announced` overrides the schedule) and replaced by new versions, each announced in turn.

The server answers the queries `digest/sources/arxiv_api.py` and `arxiv_new.py` make:
`(cat:A OR cat:B) AND submittedDate:[YYYYMMDDHHMM TO YYYYMMDDHHMM]`, sorted by submission date
ascending, paged by `start` and `max_results`, as of the simulated time `now`."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlsplit
from xml.sax.saxutils import escape

from tests.digest.sources.scripted_server import LoopbackServer, _Server

EST = timedelta(hours=-5)
CUTOFF_HOUR, ANNOUNCE_HOUR = 14, 20


def scheduled_announcement(submitted: datetime) -> datetime:
    """When arXiv announces a submission made at `submitted` (UTC), by its weekly schedule."""
    local = (submitted + EST).replace(tzinfo=None)
    cutoff = local.replace(hour=CUTOFF_HOUR, minute=0, second=0, microsecond=0)
    if local >= cutoff:
        cutoff += timedelta(days=1)
    while cutoff.weekday() >= 5:  # no cutoffs on Saturday or Sunday
        cutoff += timedelta(days=1)
    announce = cutoff.replace(hour=ANNOUNCE_HOUR)
    if cutoff.weekday() == 4:  # Friday's cutoff is announced on Sunday evening
        announce += timedelta(days=2)
    return (announce - EST).replace(tzinfo=UTC)


@dataclass(slots=True)
class Version:
    submitted: datetime  # UTC
    announced: datetime  # UTC


@dataclass(slots=True)
class FakePaper:
    arxiv_id: str
    categories: list[str]
    versions: list[Version] = field(default_factory=list)
    topic: str | None = None  # words for the title and abstract (ranking tests)

    @classmethod
    def submit(
        cls,
        arxiv_id: str,
        submitted: datetime,
        categories: list[str],
        held: timedelta = timedelta(),
    ) -> FakePaper:
        announced = scheduled_announcement(submitted) + held
        return cls(arxiv_id, categories, [Version(submitted, announced)])

    def replace(self, submitted: datetime) -> None:
        self.versions.append(Version(submitted, scheduled_announcement(submitted)))

    @property
    def submitted(self) -> datetime:
        return self.versions[0].submitted

    @property
    def announced(self) -> datetime:
        """When the paper first appeared (its first version's announcement)."""
        return self.versions[0].announced

    def visible(self, now: datetime) -> int:
        """The newest version announced by `now` (0: none yet)."""
        return sum(1 for version in self.versions if version.announced <= now)


_RANGE_RE = re.compile(r"submittedDate:\[(\d{12}) TO (\d{12})\]")
_CAT_RE = re.compile(r"cat:([\w.\-]+)")


class AnnouncingArxiv(LoopbackServer):
    def __init__(self, papers: list[FakePaper]) -> None:
        self.papers = papers
        self.now = datetime(1970, 1, 1, tzinfo=UTC)
        self.queries: list[dict[str, list[str]]] = []
        self.lock = threading.Lock()
        super().__init__(_Handler)

    def url(self, path: str = "/api/query") -> str:
        return super().url(path)

    def answer(self, query: dict[str, list[str]]) -> tuple[int, str]:
        with self.lock:
            self.queries.append(query)
            now = self.now
        search = query.get("search_query", [""])[0]
        window = _RANGE_RE.search(search)
        cats = set(_CAT_RE.findall(search))
        if window is None or not cats:
            return 400, _feed([], 0, 0, error=f"unsupported query {search!r}")
        low, high = (
            datetime.strptime(stamp, "%Y%m%d%H%M").replace(tzinfo=UTC) for stamp in window.groups()
        )
        # The range is inclusive to the minute.
        high += timedelta(seconds=59)
        matches = sorted(
            (
                (paper, paper.visible(now))
                for paper in self.papers
                if cats.intersection(paper.categories)
                and low <= paper.submitted <= high
                and paper.visible(now)
            ),
            key=lambda pair: pair[0].submitted,
        )
        start = int(query.get("start", ["0"])[0])
        size = int(query.get("max_results", ["10"])[0])
        return 200, _feed(matches[start : start + size], len(matches), start)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        owner: AnnouncingArxiv = self.server.owner  # type: ignore[assignment]
        status, body = owner.answer(parse_qs(urlsplit(self.path).query))
        data = body.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/atom+xml; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


def _topic(paper: FakePaper) -> str:
    return f": {escape(paper.topic)}" if paper.topic else ""


def _stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _entry(paper: FakePaper, version: int) -> str:
    cats = "".join(
        f'<category term="{c}" scheme="http://arxiv.org/schemas/atom"/>' for c in paper.categories
    )
    return (
        "<entry>"
        f"<id>http://arxiv.org/abs/{paper.arxiv_id}v{version}</id>"
        f"<title>Paper {escape(paper.arxiv_id)}, version {version}{_topic(paper)}</title>"
        f"<updated>{_stamp(paper.versions[version - 1].submitted)}</updated>"
        f"<published>{_stamp(paper.submitted)}</published>"
        f"<summary>We study the problem of paper {paper.arxiv_id}{_topic(paper)} and report "
        "results.</summary>"
        f"<author><name>Ada Lovelace</name></author>{cats}"
        f'<arxiv:primary_category term="{paper.categories[0]}"/>'
        "</entry>"
    )


def _feed(
    page: list[tuple[FakePaper, int]], total: int, start: int, error: str | None = None
) -> str:
    entries = (
        f"<entry><id>http://arxiv.org/api/errors#bad</id><title>Error</title>"
        f"<summary>{escape(error)}</summary></entry>"
        if error
        else "".join(_entry(paper, version) for paper, version in page)
    )
    return (
        "<?xml version='1.0' encoding='UTF-8'?>"
        '<feed xmlns="http://www.w3.org/2005/Atom" '
        'xmlns:opensearch="http://a9.com/-/spec/opensearch/1.1/" '
        'xmlns:arxiv="http://arxiv.org/schemas/atom">'
        "<id>https://arxiv.org/api/fake</id><title>arXiv Query</title>"
        "<updated>2026-03-01T00:00:00Z</updated>"
        f"<opensearch:itemsPerPage>{len(page)}</opensearch:itemsPerPage>"
        f"<opensearch:totalResults>{total}</opensearch:totalResults>"
        f"<opensearch:startIndex>{start}</opensearch:startIndex>"
        f"{entries}</feed>"
    )
