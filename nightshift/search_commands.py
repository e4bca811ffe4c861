"""`nightshift digest search QUERY` and `nightshift digest serve`: reading every past digest
through the store's full-text index (digest/store/search_index.py) and the web view
(digest/web/).

Both only read: a missing SQLite file is an error (not a new empty database), and a database
that is not at this version's revision is one line telling how to migrate it, since the nightly
job (which migrates) is what normally moves it. A query with nothing to search for is one line
and exit 2."""

from __future__ import annotations

import json
import logging
from datetime import date
from typing import TYPE_CHECKING, Annotated

import typer

from nightshift.cli_errors import EXIT_USAGE, fail

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from digest.store.search_index import SearchHit, SearchResults

EXIT_FAILED = 1
log = logging.getLogger("nightshift")

DbOpt = Annotated[
    str | None,
    typer.Option("--db", help="Database URL. Default: $NIGHTSHIFT_DATABASE_URL or SQLite."),
]


def register(app: typer.Typer) -> None:
    app.command("search")(digest_search)
    app.command("serve")(digest_serve)


def digest_search(
    query: Annotated[
        list[str],
        typer.Argument(
            help='Words (all must match) and "quoted phrases" (quoted for the shell too: '
            "'\"a phrase\"')."
        ),
    ],
    db: DbOpt = None,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="Show at most this many.")] = 20,
    category: Annotated[str | None, typer.Option(help="Only papers in this category.")] = None,
    date_: Annotated[
        str | None, typer.Option("--date", help="Only the digest of this date, YYYY-MM-DD.")
    ] = None,
    for_you: Annotated[
        bool, typer.Option("--for-you", help='Only papers a digest listed "for you" (profile).')
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    site_url: Annotated[
        str | None,
        typer.Option(
            envvar="NIGHTSHIFT_SITE_URL",
            help="Public URL of the published pages: links become absolute.",
        ),
    ] = None,
) -> None:
    """Search every stored digest: titles, authors, abstracts, summaries, reviews; best first,
    each with its digest's date, a link to its entry in that page and a snippet."""
    from sqlalchemy.exc import DBAPIError

    from digest.search_query import QueryError, parse_query
    from digest.store.database import first_line
    from digest.store.search_index import search

    day = _day(date_) if date_ else None
    try:
        parsed = parse_query(" ".join(query))
    except QueryError as exc:
        raise fail(str(exc)) from None
    engine = open_for_reading(db)
    try:
        results = search(engine, parsed, category=category, day=day, for_you=for_you, limit=limit)
    except QueryError as exc:
        raise fail(str(exc)) from None
    except DBAPIError as exc:
        raise fail(f"database error: {first_line(exc.orig or exc)}", EXIT_FAILED) from None
    base = site_url.rstrip("/") + "/" if site_url else ""
    if as_json:
        typer.echo(json.dumps(_as_json(" ".join(query), results, base), ensure_ascii=False))
    else:
        _print(results, base)


def digest_serve(
    host: Annotated[
        str, typer.Option(help="Bind address (loopback unless told; the view has no login).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port (0: any free one).")] = 8080,
    db: DbOpt = None,
) -> None:
    """A read-only web view of the store: the digests by date, each date's page, search and a
    category filter. Runs until stopped (Ctrl-C, SIGTERM)."""
    from digest.web.read_only_database import make_read_only
    from digest.web.serve import serve, url_of
    from engine.server.auth import is_loopback
    from engine.server.listen_socket import listen_socket

    engine = make_read_only(open_for_reading(db))
    try:
        sock = listen_socket(host, port)
    except OSError as exc:
        raise fail(str(exc)) from None
    if not is_loopback(host):
        log.warning(
            "listening on %s, beyond loopback: the view has no login; anyone who can reach "
            "the port reads every digest (put it behind a proxy with authentication)",
            host,
        )
    typer.echo(f"digest web view on {url_of(sock)} (read-only; Ctrl-C stops)")
    serve(engine, sock)


def open_for_reading(db: str | None) -> Engine:
    """The store, which must exist and be at this version's revision (the index is there)."""
    from digest.store import migrate
    from digest.store.database import StoreError, open_database

    try:
        engine = open_database(db, create=False)
    except StoreError as exc:
        raise fail(str(exc)) from None
    current, head = migrate.current_revision(engine), migrate.head_revision()
    if current != head:
        where = f" --db {db}" if db else ""
        raise fail(
            f"the database is at revision {current or 'base (empty)'}, this nightshift reads "
            f"{head}: run `nightshift db upgrade{where}` (every `digest run` does it too)"
        )
    return engine


def _day(value: str) -> date:
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise fail(f"--date must be YYYY-MM-DD, not {value!r}", EXIT_USAGE) from None


def _as_json(query: str, results: SearchResults, base: str) -> dict:
    return {
        "query": query,
        "total": results.total,
        "results": [
            {
                "paper_id": hit.paper.arxiv_id,
                "version": hit.paper.version,
                "title": hit.paper.title,
                "authors": hit.paper.authors,
                "categories": hit.paper.categories,
                "digest_date": hit.digest_date.isoformat(),
                "dates": [day.isoformat() for day in hit.dates],
                "link": hit.entry_link(base),
                "abs_url": hit.paper.abs_url,
                "snippet": "".join(text for text, _ in hit.snippet),
                "matches": [text for text, matched in hit.snippet if matched],
                "score": hit.score,
            }
            for hit in results.hits
        ],
    }


def _print(results: SearchResults, base: str) -> None:
    if not results.hits:
        typer.echo("no papers found" if not results.total else "no papers on this page")
        return
    shown = len(results.hits)
    typer.echo(f"{results.total} paper{'s' if results.total != 1 else ''} found", err=True)
    for hit in results.hits:
        title = "".join(text for text, _ in hit.title)  # its LaTeX as the pages show it
        typer.echo(f"{hit.digest_date}  {hit.paper.arxiv_id}  {title}")
        typer.echo(f"    {', '.join(hit.paper.authors)} · {', '.join(hit.paper.categories)}")
        typer.echo(f"    {hit.entry_link(base)}")
        typer.echo(f"    {_snippet(hit)}")
    if shown < results.total:
        typer.echo(f"({shown} of {results.total} shown; --limit for more)", err=True)


def _snippet(hit: SearchHit) -> str:
    # Bold where the query matched, on a terminal; plain text when piped.
    return "".join(typer.style(text, bold=True) if hit_ else text for text, hit_ in hit.snippet)
