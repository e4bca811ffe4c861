"""`nightshift digest serve`: a small read-only web view of the store: every digest's date, one
date's digest, search over every digest, and a category filter.

A day's page is the published page itself (`render_html_page`, the same template and bytes as
`digest render` writes), and the view keeps the published folder's names (`index.html`,
`digest-DATE.html`, `feed.xml`), so the links inside pages work in both. Every link is relative,
so the view also works behind a reverse proxy under a path prefix. The index and search pages
are small templates of their own that include the pages' stylesheet.

Bad query parameters are 4xx pages with the search form, never a 500: FastAPI's validation
errors and a query the index cannot take are both answered as 400."""

from __future__ import annotations

import re
from datetime import date
from functools import cache
from urllib.parse import urlencode

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from jinja2 import ChoiceLoader, Environment, PackageLoader
from sqlalchemy import Engine, case, func, select
from starlette.exceptions import HTTPException

from digest.clean_text import xml_safe
from digest.render.environment import html_environment
from digest.render.feed import render_feed
from digest.render.html_page import render_html_page
from digest.search_query import MAX_QUERY_CHARS, QueryError, parse_query
from digest.store.digest_store import DigestStore
from digest.store.schema import DigestItemRow
from digest.store.search_index import categories, search

FEED_DIGESTS = 14  # as many as the published feed carries (pipeline.RECENT_DIGESTS)
MAX_PAGE = 1000
_DAY_RE = re.compile(r"\d{4}-\d{2}-\d{2}")
# Pages are the store's text (papers, model replies), all autoescaped; the headers are a second
# line of defence and keep the view out of other sites' frames.
_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
}


@cache
def _environment() -> Environment:
    """The pages' environment (filters, autoescaping), also finding this package's templates."""
    return html_environment().overlay(
        loader=ChoiceLoader(
            [PackageLoader("digest.web", "templates"), PackageLoader("digest.render", "templates")]
        )
    )


def _page(template: str, code: int = 200, **context: object) -> HTMLResponse:
    html = _environment().get_template(template).render(**context)
    return HTMLResponse(html, status_code=code, headers=_HEADERS)


def create_app(engine: Engine) -> FastAPI:
    """The web view over `engine`, which should be read-only (`make_read_only`)."""
    store = DigestStore(engine)
    app = FastAPI(title="Nightshift digests", docs_url=None, redoc_url=None, openapi_url=None)

    def form(**values: object) -> dict:
        """What the search form shows: the choices, and what was asked."""
        dates = store.digest_dates(None)
        asked = {"q": "", "category": "", "date": "", "for_you": False, **values}
        # The "for you" box only where a reader profile picked papers (digest/ranking.py).
        for_you = search(engine, None, for_you=True, limit=1).total
        return {
            "categories": categories(engine),
            "dates": dates,
            "asked": asked,
            "for_you": for_you,
        }

    @app.exception_handler(RequestValidationError)
    async def _bad_parameters(request: Request, exc: RequestValidationError) -> HTMLResponse:
        problems = [f"{'.'.join(map(str, e['loc'][1:]))}: {e['msg']}" for e in exc.errors()]
        return _error(400, "Bad request", "; ".join(problems))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> HTMLResponse:
        titles = {404: "Not found", 405: "Method not allowed"}
        return _error(exc.status_code, titles.get(exc.status_code, "Error"), str(exc.detail))

    @app.api_route("/", methods=["GET", "HEAD"], response_class=HTMLResponse)
    @app.api_route("/index.html", methods=["GET", "HEAD"], response_class=HTMLResponse)
    def index() -> HTMLResponse:
        return _page("site_index.html", days=_day_counts(engine), **form())

    @app.api_route("/digest-{day}.html", methods=["GET", "HEAD"], response_class=HTMLResponse)
    def day_page(day: str) -> HTMLResponse:
        digest = store.load_digest(_parse_day(day, status=404))
        if digest is None:
            raise HTTPException(404, f"no digest for {day}")
        return HTMLResponse(render_html_page(digest), headers=_HEADERS)

    @app.api_route("/feed.xml", methods=["GET", "HEAD"])
    def feed() -> Response:
        recent = [d for day in store.digest_dates(FEED_DIGESTS) if (d := store.load_digest(day))]
        body = render_feed([d for d in recent if d.done])
        return Response(body, media_type="application/atom+xml", headers=_HEADERS)

    @app.api_route("/search", methods=["GET", "HEAD"], response_class=HTMLResponse)
    def search_page(
        q: str = Query("", max_length=MAX_QUERY_CHARS * 2),
        category: str = Query("", max_length=200),
        date_: str = Query("", alias="date", max_length=10),
        page: int = Query(1, ge=1, le=MAX_PAGE),
        limit: int = Query(20, ge=1, le=100),
        for_you: bool = Query(False),
    ) -> HTMLResponse:
        asked = {"q": q, "category": category, "date": date_, "for_you": for_you}
        day = _parse_day(date_, status=400) if date_ else None
        if xml_safe(category) != category:  # NUL: a database error on PostgreSQL
            raise HTTPException(400, f"not a category (control characters): {category!r}")
        if not (q.strip() or category or day or for_you):
            return _page("site_search.html", results=None, **form(**asked))
        try:
            query = parse_query(q) if q.strip() else None
            results = search(
                engine,
                query,
                category=category or None,
                day=day,
                for_you=for_you,
                limit=limit,
                offset=(page - 1) * limit,
            )
        except QueryError as exc:
            return _page("site_search.html", 400, results=None, error=str(exc), **form(**asked))
        pages = _pages(asked, page, limit, results.total)
        return _page("site_search.html", results=results, pages=pages, **form(**asked))

    return app


def _error(status: int, title: str, detail: str) -> HTMLResponse:
    return _page("site_error.html", status, status=status, title=title, detail=detail)


def _parse_day(value: str, status: int) -> date:
    try:
        if _DAY_RE.fullmatch(value):
            return date.fromisoformat(value)
    except ValueError:
        pass
    raise HTTPException(status, f"not a date (YYYY-MM-DD): {value!r}")


def _day_counts(engine: Engine) -> list[tuple[date, int, int]]:
    """(date, papers listed, papers reviewed) for every digest, newest first."""
    done = func.sum(case((DigestItemRow.status == "done", 1), else_=0))
    query = (
        select(DigestItemRow.digest_date, func.count(), done)
        .group_by(DigestItemRow.digest_date)
        .order_by(DigestItemRow.digest_date.desc())
    )
    with engine.connect() as connection:
        return [(day, listed, int(done or 0)) for day, listed, done in connection.execute(query)]


def _pages(asked: dict, page: int, limit: int, total: int) -> dict[str, str | None]:
    """Links to the previous and next page of hits (None where there is none)."""

    def link(number: int) -> str:
        kept = {k: (1 if v is True else v) for k, v in asked.items() if v}
        return "search?" + urlencode({**kept, "page": number, "limit": limit})

    last = min(MAX_PAGE, max(1, -(-total // limit)))
    return {
        # Past the end (an old link, a hand-typed page): back to the last page with hits.
        "previous": link(min(page - 1, last)) if page > 1 else None,
        "next": link(page + 1) if page < last else None,
        "first": str((page - 1) * limit + 1),
        "last": str(min(total, page * limit)),
    }
