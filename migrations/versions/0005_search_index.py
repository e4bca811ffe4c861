"""Full-text search over every stored paper: one search document per paper (title, authors,
abstract, every stored summary, the prose of every review that validated: what the public
pages show, never a raw reply), kept in step by triggers on papers, summaries and reviews, and
built here for the papers already stored.

SQLite: `search_documents` (a plain table keyed by paper) feeds the FTS5 table `search_fts`
(external content, porter stemming, diacritics folded). PostgreSQL: `search_documents` carries a
weighted `tsvector` (english configuration) with a GIN index. Triggers rather than writes in the
store, so that every path that changes a paper or a result (a rerun, `--redo`, a take-over, a
hand-written UPDATE) keeps the index in step. The SQL is written out here, not imported, so this
revision keeps doing what it did when the code moves on.

These objects are not in schema.py (a tsvector column and an FTS5 table have no portable
declaration); `digest.store.search_index.outside_schema` hides them from autogenerate.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05 14:00:00
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_REVIEW_LISTS = ("strengths", "weaknesses", "questions", "limitations")


def upgrade() -> None:
    # A hit is a paper some digest lists: looked up per matching paper, so by paper_id.
    op.create_index(op.f("ix_digest_items_paper_id"), "digest_items", ["paper_id"])
    if op.get_bind().dialect.name == "postgresql":
        _upgrade_postgresql()
    else:
        _upgrade_sqlite()


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for table in ("papers", "summaries", "reviews"):
            op.execute(f"DROP TRIGGER IF EXISTS search_sync_{table} ON {table}")
        op.execute("DROP FUNCTION IF EXISTS nightshift_search_sync()")
        op.execute("DROP FUNCTION IF EXISTS nightshift_search_refresh(varchar)")
        op.execute("DROP TABLE IF EXISTS search_documents")
    else:
        for name in _SQLITE_TRIGGERS:
            op.execute(f"DROP TRIGGER IF EXISTS {name}")
        op.execute("DROP TABLE IF EXISTS search_fts")
        op.execute("DROP TABLE IF EXISTS search_documents")
    op.drop_index(op.f("ix_digest_items_paper_id"), table_name="digest_items")


# -- SQLite ----------------------------------------------------------------------------------

_FTS_COLUMNS = "title, authors, abstract, summaries, reviews"


def _sqlite_document(where: str) -> str:
    """The search documents of the papers matching `where` (on `p`), as a SELECT."""
    review_keys = ", ".join(f"'$.{key}'" for key in _REVIEW_LISTS)
    # A review that validated contributes its prose (not scores or the decision). One that did
    # not is left out: the public page does not show raw replies, and a hit must be there. The
    # JSON is written by SQLAlchemy and always valid, but a trigger must never fail a write.
    reviews = f"""
        SELECT r.id AS rid, j.id AS part, j.value AS text
        FROM reviews AS r,
             json_tree(CASE WHEN json_valid(r.review) THEN r.review ELSE 'null' END) AS j
        WHERE r.paper_id = p.arxiv_id AND r.parse_status != 'failed' AND j.type = 'text'
          AND ((j.path = '$' AND j.key = 'summary') OR j.path IN ({review_keys}))
        ORDER BY 1, 2"""
    return f"""
        SELECT p.arxiv_id, p.title,
            coalesce((SELECT group_concat(a.value, ', ') FROM json_each(
                CASE WHEN json_valid(p.authors) THEN p.authors ELSE '[]' END) AS a), ''),
            p.abstract,
            coalesce((SELECT group_concat(s.text, char(10)) FROM (
                SELECT text FROM summaries WHERE paper_id = p.arxiv_id ORDER BY id) AS s), ''),
            coalesce((SELECT group_concat(x.text, char(10)) FROM ({reviews}) AS x), '')
        FROM papers AS p WHERE {where}"""


def _sqlite_refresh(paper_id: str) -> str:
    return f"""
        DELETE FROM search_documents WHERE paper_id = {paper_id};
        INSERT INTO search_documents (paper_id, {_FTS_COLUMNS})
        {_sqlite_document(f"p.arxiv_id = {paper_id}")};"""


def _sqlite_sync_triggers() -> dict[str, str]:
    """Trigger name -> its CREATE statement, for the three tables a document is built from."""
    triggers = {
        "search_papers_insert": "AFTER INSERT ON papers",
        "search_papers_update": "AFTER UPDATE OF arxiv_id, title, abstract, authors ON papers",
        "search_summaries_insert": "AFTER INSERT ON summaries",
        "search_summaries_update": "AFTER UPDATE ON summaries",
        "search_summaries_delete": "AFTER DELETE ON summaries",
        "search_reviews_insert": "AFTER INSERT ON reviews",
        "search_reviews_update": "AFTER UPDATE ON reviews",
        "search_reviews_delete": "AFTER DELETE ON reviews",
    }
    created = {}
    for name, when in triggers.items():
        key = "arxiv_id" if "ON papers" in when else "paper_id"
        if "INSERT" in when:
            body = _sqlite_refresh(f"NEW.{key}")
        elif "DELETE" in when:
            body = _sqlite_refresh(f"OLD.{key}")
        else:  # the old paper loses the result (or the id) first
            body = _sqlite_refresh(f"OLD.{key}") + _sqlite_refresh(f"NEW.{key}")
        created[name] = f"CREATE TRIGGER {name} {when} BEGIN {body} END"
    created["search_papers_delete"] = (
        "CREATE TRIGGER search_papers_delete AFTER DELETE ON papers BEGIN "
        "DELETE FROM search_documents WHERE paper_id = OLD.arxiv_id; END"
    )
    return created


_NEW = ", ".join(f"new.{c}" for c in _FTS_COLUMNS.split(", "))
_OLD = ", ".join(f"old.{c}" for c in _FTS_COLUMNS.split(", "))
# The FTS5 external-content protocol: the index is told each row's old values to remove.
_SQLITE_FTS_TRIGGERS = {
    "search_documents_insert": f"""CREATE TRIGGER search_documents_insert
        AFTER INSERT ON search_documents BEGIN
        INSERT INTO search_fts (rowid, {_FTS_COLUMNS}) VALUES (new.id, {_NEW}); END""",
    "search_documents_delete": f"""CREATE TRIGGER search_documents_delete
        AFTER DELETE ON search_documents BEGIN
        INSERT INTO search_fts (search_fts, rowid, {_FTS_COLUMNS})
        VALUES ('delete', old.id, {_OLD}); END""",
    "search_documents_update": f"""CREATE TRIGGER search_documents_update
        AFTER UPDATE ON search_documents BEGIN
        INSERT INTO search_fts (search_fts, rowid, {_FTS_COLUMNS})
        VALUES ('delete', old.id, {_OLD});
        INSERT INTO search_fts (rowid, {_FTS_COLUMNS}) VALUES (new.id, {_NEW}); END""",
}
_SQLITE_TRIGGERS = [*_SQLITE_FTS_TRIGGERS, *_sqlite_sync_triggers()]


def _upgrade_sqlite() -> None:
    op.execute(
        """CREATE TABLE search_documents (
            id INTEGER PRIMARY KEY,
            paper_id VARCHAR(64) NOT NULL UNIQUE,
            title TEXT NOT NULL, authors TEXT NOT NULL, abstract TEXT NOT NULL,
            summaries TEXT NOT NULL, reviews TEXT NOT NULL)"""
    )
    op.execute(
        f"""CREATE VIRTUAL TABLE search_fts USING fts5({_FTS_COLUMNS},
            content='search_documents', content_rowid='id',
            tokenize='porter unicode61 remove_diacritics 2')"""
    )
    for statement in _SQLITE_FTS_TRIGGERS.values():
        op.execute(statement)
    op.execute(
        f"INSERT INTO search_documents (paper_id, {_FTS_COLUMNS}) {_sqlite_document('1 = 1')}"
    )
    for statement in _sqlite_sync_triggers().values():
        op.execute(statement)


# -- PostgreSQL ------------------------------------------------------------------------------

# Two 32-bit keys: a key space apart from the migration lock's single 64-bit key.
_PG_REFRESH_LOCK = 0x6E737278  # "nsrx"

_PG_REVIEW_TEXT = f"""
    SELECT string_agg(x.text, E'\\n' ORDER BY x.rid, x.n, x.m) FROM (
        SELECT r.id AS rid, 0 AS n, 0::bigint AS m, r.review->>'summary' AS text
        FROM reviews AS r
        WHERE r.paper_id = p.arxiv_id AND r.parse_status <> 'failed'
          AND json_typeof(r.review) = 'object'
        UNION ALL
        SELECT r.id, f.n::int, e.m, e.value
        FROM reviews AS r
        CROSS JOIN unnest(ARRAY[{", ".join(f"'{k}'" for k in _REVIEW_LISTS)}])
            WITH ORDINALITY AS f(key, n)
        CROSS JOIN LATERAL json_array_elements_text(
            CASE WHEN json_typeof(r.review) = 'object'
                  AND json_typeof(r.review -> f.key) = 'array'
            THEN r.review -> f.key ELSE '[]'::json END) WITH ORDINALITY AS e(value, m)
        WHERE r.paper_id = p.arxiv_id AND r.parse_status <> 'failed'
    ) AS x"""

_PG_DOCUMENT = f"""
    SELECT d.*,
        setweight(to_tsvector('english', d.title), 'A')
        || setweight(to_tsvector('english', d.authors), 'B')
        || setweight(to_tsvector('english', d.abstract), 'C')
        || setweight(to_tsvector('english', d.summaries), 'C')
        || setweight(to_tsvector('english', d.reviews), 'D')
    FROM (
        SELECT p.arxiv_id, p.title,
            coalesce((SELECT string_agg(a, ', ') FROM json_array_elements_text(
                CASE WHEN json_typeof(p.authors) = 'array' THEN p.authors ELSE '[]'::json END
            ) AS a), '') AS authors,
            p.abstract,
            coalesce((SELECT string_agg(s.text, E'\\n' ORDER BY s.id) FROM summaries AS s
                      WHERE s.paper_id = p.arxiv_id), '') AS summaries,
            coalesce(({_PG_REVIEW_TEXT}), '') AS reviews
        FROM papers AS p WHERE {{where}}
    ) AS d"""

_PG_COLUMNS = "paper_id, title, authors, abstract, summaries, reviews, document"


def _upgrade_postgresql() -> None:
    op.execute(
        """CREATE TABLE search_documents (
            paper_id VARCHAR(64) PRIMARY KEY,
            title TEXT NOT NULL, authors TEXT NOT NULL, abstract TEXT NOT NULL,
            summaries TEXT NOT NULL, reviews TEXT NOT NULL,
            document TSVECTOR NOT NULL)"""
    )
    op.execute("CREATE INDEX ix_search_documents_document ON search_documents USING GIN (document)")
    # Concurrent writers of one paper's results (a summary and a review saved by two threads)
    # each rebuild its document from what they see: the per-paper lock makes the second wait
    # for the first's commit, and its next statement then reads both (READ COMMITTED).
    op.execute(
        f"""CREATE FUNCTION nightshift_search_refresh(pid varchar) RETURNS void
        LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_advisory_xact_lock({_PG_REFRESH_LOCK}, hashtext(pid));
            DELETE FROM search_documents WHERE paper_id = pid;
            INSERT INTO search_documents ({_PG_COLUMNS})
            {_PG_DOCUMENT.format(where="p.arxiv_id = pid")};
        END $$"""
    )
    op.execute(
        """CREATE FUNCTION nightshift_search_sync() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            old_id varchar;
            new_id varchar;
        BEGIN
            IF TG_TABLE_NAME = 'papers' THEN
                IF TG_OP <> 'INSERT' THEN old_id := OLD.arxiv_id; END IF;
                IF TG_OP <> 'DELETE' THEN new_id := NEW.arxiv_id; END IF;
            ELSE
                IF TG_OP <> 'INSERT' THEN old_id := OLD.paper_id; END IF;
                IF TG_OP <> 'DELETE' THEN new_id := NEW.paper_id; END IF;
            END IF;
            IF old_id IS NOT NULL AND old_id IS DISTINCT FROM new_id THEN
                PERFORM nightshift_search_refresh(old_id);
            END IF;
            IF new_id IS NOT NULL THEN
                PERFORM nightshift_search_refresh(new_id);
            END IF;
            RETURN NULL;
        END $$"""
    )
    op.execute(f"INSERT INTO search_documents ({_PG_COLUMNS}) {_PG_DOCUMENT.format(where='TRUE')}")
    events = {
        "papers": "INSERT OR DELETE OR UPDATE OF arxiv_id, title, abstract, authors",
        "summaries": "INSERT OR UPDATE OR DELETE",
        "reviews": "INSERT OR UPDATE OR DELETE",
    }
    for table, event in events.items():
        op.execute(
            f"CREATE TRIGGER search_sync_{table} AFTER {event} ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION nightshift_search_sync()"
        )
