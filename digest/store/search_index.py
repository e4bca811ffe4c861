"""Reading the full-text index of every stored paper: ranked hits with a snippet and the digest
whose page shows the paper, on SQLite (FTS5, bm25) and PostgreSQL (tsvector, ts_rank).

The index itself (`search_documents`, kept in step by triggers on papers, summaries and
reviews) is built by migration 0005; nothing here writes. Only papers that a digest lists are
found: a paper without a page has no entry to link to."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from datetime import date

from sqlalchemy import Date, Engine, bindparam, inspect, select, text
from sqlalchemy.exc import DBAPIError

from digest.latex_text import latex_to_text
from digest.paper import Paper
from digest.render import html_page
from digest.search_query import QueryError, SearchQuery
from digest.store.schema import DigestItemRow, PaperRow

SEARCH_TABLE = "search_documents"
PG_CONFIG = "english"  # the text search configuration migration 0005 indexes with
# Hit markers in snippets: control characters, which the store never holds (clean_text).
OPEN, CLOSE = "\x02", "\x03"
SNIPPET_WORDS = 24
# bm25 column weights (title, authors, abstract, summaries, reviews); PostgreSQL weighs the same
# fields A, B, C, C, D in the tsvector.
_BM25 = "bm25(search_fts, 10.0, 4.0, 2.0, 1.0, 1.0)"
_SNIPPET_COLUMNS = ("abstract", "summaries", "reviews")  # the title is shown anyway

Snippet = list[tuple[str, bool]]  # text pieces, True where a query term matched


@dataclass(slots=True)
class SearchHit:
    paper: Paper
    digest_date: date  # the digest whose page has the paper's entry
    dates: list[date]  # every digest that lists it, oldest first
    title: Snippet
    snippet: Snippet
    score: float  # higher is better; comparable within one search only

    def entry_link(self, base: str = "") -> str:
        """The paper's entry in the published page, relative to `base` (a site URL or '')."""
        return f"{base}{html_page.file_name(self.digest_date)}#{self.paper.arxiv_id}"


@dataclass(slots=True)
class SearchResults:
    hits: list[SearchHit]
    total: int  # matches before limit and offset
    filters: dict[str, str] = field(default_factory=dict)


def outside_schema(name: str | None, type_: str, parent_names: dict) -> bool:
    """Alembic's `include_name`: False for the index's tables, which schema.py does not declare
    (so autogenerate neither drops them nor reports them as a difference)."""
    ours = name == SEARCH_TABLE or (name or "").startswith("search_fts")  # FTS5 + its shadows
    return not (type_ == "table" and ours)


def has_index(engine: Engine) -> bool:
    return inspect(engine).has_table(SEARCH_TABLE)


def search(
    engine: Engine,
    query: SearchQuery | None,
    *,
    category: str | None = None,
    day: date | None = None,
    for_you: bool = False,
    limit: int = 20,
    offset: int = 0,
) -> SearchResults:
    """Papers matching `query` (best first), or without a query those of `category`, `day`
    and/or `for_you` (a digest listed them "for you", by the reader profile; newest digest
    first). Raises QueryError for a query the index cannot take."""
    filters = {"category": category, "day": day, "for_you": "yes" if for_you else None}
    shown = {k: str(v) for k, v in filters.items() if v is not None}
    with engine.connect() as connection:
        try:
            if query is not None and query.paper_id is not None:
                by_id = {**filters, "paper_id": query.paper_id}
                total, rows = _browse(connection, by_id, limit, offset)
            elif query is None:
                total, rows = _browse(connection, filters, limit, offset)
            elif connection.dialect.name == "postgresql":
                total, rows = _search_pg(connection, query, filters, limit, offset)
            else:
                total, rows = _search_sqlite(connection, query, filters, limit, offset)
        except DBAPIError as exc:
            # The terms are quoted, so FTS5 should accept anything; should it still refuse one,
            # the user hears about the query rather than getting a server error.
            if isinstance(exc.orig, sqlite3.OperationalError) and "fts5" in str(exc.orig):
                raise QueryError(f"the index cannot search for this query ({exc.orig})") from None
            raise
        hits = _hits(connection, rows, browse=query is None or query.paper_id is not None)
    return SearchResults(hits, total, shown)


def categories(engine: Engine) -> list[tuple[str, int]]:
    """Every category of a listed paper with its number of papers, most papers first."""
    elements = _json_elements(engine.dialect.name, "p.categories")
    sql = f"""
        SELECT c.value AS category, count(DISTINCT p.arxiv_id) AS papers
        FROM papers AS p CROSS JOIN {elements} AS c(value)
        WHERE EXISTS (SELECT 1 FROM digest_items AS i WHERE i.paper_id = p.arxiv_id)
        GROUP BY c.value ORDER BY papers DESC, category"""
    if engine.dialect.name == "sqlite":  # json_each names its column itself
        sql = sql.replace(" AS c(value)", " AS c")
    with engine.connect() as connection:
        return [(row.category, row.papers) for row in connection.execute(text(sql))]


# -- the queries per database -----------------------------------------------------------------


def _json_elements(dialect: str, column: str) -> str:
    if dialect == "postgresql":
        return (
            f"json_array_elements_text(CASE WHEN json_typeof({column}) = 'array' "
            f"THEN {column} ELSE '[]'::json END)"
        )
    return f"json_each(CASE WHEN json_valid({column}) THEN {column} ELSE '[]' END)"


def _filters(dialect: str, paper_id: str, filters: dict) -> str:
    """SQL conditions on `paper_id`: listed in a digest (of `day`; "for you" there), in
    `category`."""
    on_day = " AND i.digest_date = :day" if filters["day"] is not None else ""
    if filters["for_you"] is not None:  # its reasons: a JSON list, empty or null when not
        on_day += f" AND {_json_length(dialect, 'i.for_you')} > 0"
    sql = f"EXISTS (SELECT 1 FROM digest_items AS i WHERE i.paper_id = {paper_id}{on_day})"
    if filters.get("paper_id") is not None:  # a query that is an arXiv id
        sql += f" AND {paper_id} = :paper_id"
    if filters["category"] is not None:
        elements = _json_elements(dialect, "p.categories")
        alias = "c" if dialect == "sqlite" else "c(value)"
        sql += f""" AND EXISTS (SELECT 1 FROM papers AS p CROSS JOIN {elements} AS {alias}
                    WHERE p.arxiv_id = {paper_id} AND c.value = :category)"""
    return sql


def _json_length(dialect: str, column: str) -> str:
    if dialect == "postgresql":  # json_array_length fails on a scalar: check the type first
        return f"CASE WHEN json_typeof({column}) = 'array' THEN json_array_length({column}) END"
    return f"json_array_length(CASE WHEN json_valid({column}) THEN {column} ELSE '[]' END)"


def _params(filters: dict, **more: object) -> dict:
    bound = {k: v for k, v in filters.items() if v is not None and k != "for_you"}
    return {**bound, **more}


def _bind(sql: str, filters: dict):  # noqa: ANN202 - a TextClause
    statement = text(sql)
    if filters["day"] is not None:  # SQLite stores dates as text: bind through the Date type
        statement = statement.bindparams(bindparam("day", type_=Date()))
    return statement


def _search_sqlite(connection, query: SearchQuery, filters: dict, limit: int, offset: int):
    where = f"search_fts MATCH :match AND {_filters('sqlite', 'd.paper_id', filters)}"
    frm = "FROM search_fts JOIN search_documents AS d ON d.id = search_fts.rowid"
    params = _params(filters, match=query.fts5(), open=OPEN, close=CLOSE)
    total = connection.execute(_bind(f"SELECT count(*) {frm} WHERE {where}", filters), params)
    snippets = ", ".join(
        f"snippet(search_fts, {i}, :open, :close, '…', {SNIPPET_WORDS}) AS {name}"
        for i, name in ((2, "abstract"), (3, "summaries"), (4, "reviews"))
    )
    rows = connection.execute(
        _bind(
            f"""SELECT d.paper_id, -{_BM25} AS score,
                highlight(search_fts, 0, :open, :close) AS title, {snippets}
            {frm} WHERE {where} ORDER BY {_BM25}, d.paper_id LIMIT :limit OFFSET :offset""",
            filters,
        ),
        {**params, "limit": limit, "offset": offset},
    )
    return total.scalar_one(), rows.mappings().all()


def _search_pg(connection, query: SearchQuery, filters: dict, limit: int, offset: int):
    tsquery = query.pg_tsquery_sql(PG_CONFIG)
    where = f"d.document @@ q.query AND {_filters('postgresql', 'd.paper_id', filters)}"
    head = f"WITH q AS (SELECT ({tsquery}) AS query)"
    frm = "FROM search_documents AS d, q"
    params = _params(filters, **query.pg_parameters())
    total = connection.execute(
        _bind(f"{head} SELECT count(*) {frm} WHERE {where}", filters), params
    )
    options = (
        f'StartSel="{OPEN}", StopSel="{CLOSE}", MaxWords={SNIPPET_WORDS}, '
        f'MinWords={SNIPPET_WORDS // 2}, MaxFragments=2, FragmentDelimiter=" … "'
    )
    snippets = ", ".join(
        f"ts_headline('{PG_CONFIG}', top.{name}, top.query, :options) AS {name}"
        for name in _SNIPPET_COLUMNS
    )
    # Headlines are costly (they re-parse the text): only for the page of hits shown.
    rows = connection.execute(
        _bind(
            f"""{head}, top AS (
                SELECT d.*, q.query, ts_rank(d.document, q.query) AS score {frm}
                WHERE {where} ORDER BY score DESC, d.paper_id LIMIT :limit OFFSET :offset)
            SELECT top.paper_id, top.score,
                ts_headline('{PG_CONFIG}', top.title, top.query, :whole) AS title, {snippets}
            FROM top ORDER BY top.score DESC, top.paper_id""",
            filters,
        ),
        {
            **params,
            "limit": limit,
            "offset": offset,
            "options": options,
            "whole": f'StartSel="{OPEN}", StopSel="{CLOSE}", HighlightAll=true',
        },
    )
    return total.scalar_one(), rows.mappings().all()


def _browse(connection, filters: dict, limit: int, offset: int):
    """Without a query: the listed papers of the category / day, newest digest first."""
    where = _filters(connection.dialect.name, "d.paper_id", filters)
    # One pass over the listings, not a look-up per paper (which PostgreSQL may plan badly).
    newest = "(SELECT paper_id, max(digest_date) AS day FROM digest_items GROUP BY paper_id) AS n"
    total = connection.execute(
        _bind(f"SELECT count(*) FROM search_documents AS d WHERE {where}", filters),
        _params(filters),
    )
    rows = connection.execute(
        _bind(
            f"""SELECT d.paper_id, 0.0 AS score, d.title, d.abstract, '' AS summaries,
                '' AS reviews FROM search_documents AS d JOIN {newest} ON n.paper_id = d.paper_id
            WHERE {where} ORDER BY n.day DESC, d.paper_id LIMIT :limit OFFSET :offset""",
            filters,
        ),
        _params(filters, limit=limit, offset=offset),
    )
    return total.scalar_one(), rows.mappings().all()


# -- from rows to hits ------------------------------------------------------------------------


def _hits(connection, rows: list, browse: bool) -> list[SearchHit]:
    ids = [row["paper_id"] for row in rows]
    if not ids:
        return []
    papers = {
        p.arxiv_id: p
        for p in connection.execute(select(PaperRow).where(PaperRow.arxiv_id.in_(ids))).all()
    }
    listed: dict[str, list[tuple[date, str]]] = {}
    for item in connection.execute(
        select(DigestItemRow.paper_id, DigestItemRow.digest_date, DigestItemRow.status)
        .where(DigestItemRow.paper_id.in_(ids))
        .order_by(DigestItemRow.digest_date)
    ):
        listed.setdefault(item.paper_id, []).append((item.digest_date, item.status))
    hits = []
    for row in rows:
        paper, days = papers.get(row["paper_id"]), listed.get(row["paper_id"])
        if paper is None or not days:  # changed since the first query
            continue
        hits.append(
            SearchHit(
                paper=_paper(paper),
                digest_date=_entry_date(days),
                dates=[day for day, _ in days],
                title=marked(row["title"]),
                snippet=_best_snippet(row, browse),
                score=float(row["score"] or 0.0),
            )
        )
    return hits


def _entry_date(days: list[tuple[date, str]]) -> date:
    """The first digest that published the paper (later ones, with --republished mark, link
    back to it); a paper never done is on its latest digest's page under "Not processed"."""
    done = [day for day, status in days if status == "done"]
    return done[0] if done else days[-1][0]


def _best_snippet(row, browse: bool) -> Snippet:
    if browse:
        words = latex_to_text(row["abstract"]).split()
        shown = " ".join(words[: SNIPPET_WORDS * 2])
        return [(shown + (" …" if len(words) > SNIPPET_WORDS * 2 else ""), False)]
    # The field where most of the query matched (a phrase in a review beats one of its words
    # in the abstract); on a tie the earlier field, the abstract first.
    pieces = [marked(row[name]) for name in _SNIPPET_COLUMNS if row[name]]
    return max(pieces, key=lambda p: sum(hit for _, hit in p), default=[])


def marked(value: str | None) -> Snippet:
    """Split text carrying OPEN/CLOSE markers into (piece, matched) pairs, its LaTeX shown as the
    pages show it (`$\\alpha$` as α; a marker inside a command just ends the command)."""
    pieces: Snippet = []
    # Fields are joined by newlines in the index; a snippet reads as one line.
    for i, part in enumerate(latex_to_text((value or "").replace("\n", " ")).split(OPEN)):
        inside, _, after = part.partition(CLOSE) if i else ("", "", part)
        if inside:
            pieces.append((inside, True))
        if after:
            pieces.append((after, False))
    return pieces


def _paper(row) -> Paper:
    return Paper(
        arxiv_id=row.arxiv_id,
        title=row.title,
        abstract=row.abstract,
        authors=list(row.authors or []),
        categories=list(row.categories or []),
        version=row.version,
    )


def drop_search_index(connection) -> None:
    """Remove the index's objects whatever state they are in (tests empty a PostgreSQL database
    with `metadata.drop_all`, which knows nothing of them); `db downgrade` does it properly."""
    if connection.dialect.name == "postgresql":
        connection.execute(text("DROP FUNCTION IF EXISTS nightshift_search_sync() CASCADE"))
        connection.execute(text("DROP FUNCTION IF EXISTS nightshift_search_refresh(varchar)"))
    else:  # dropping a table drops its triggers; the others' triggers name search_documents
        for name in ("papers", "summaries", "reviews"):
            for event in ("insert", "update", "delete"):
                connection.execute(text(f"DROP TRIGGER IF EXISTS search_{name}_{event}"))
        connection.execute(text("DROP TABLE IF EXISTS search_fts"))
    connection.execute(text(f"DROP TABLE IF EXISTS {SEARCH_TABLE}"))
