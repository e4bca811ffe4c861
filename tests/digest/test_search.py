"""Full-text search over the store, on SQLite and PostgreSQL: what is indexed, that the index
follows every write (triggers), that the migration builds it for an existing database and the
downgrade removes it, ranking, filters, and user input that is query-syntax garbage."""

from __future__ import annotations

import threading
from datetime import date

import pytest
from sqlalchemy import insert, inspect, text

from digest.paper import Paper
from digest.review import Review
from digest.search_query import MAX_QUERY_CHARS, QueryError, parse_query
from digest.store import migrate
from digest.store.database import open_database
from digest.store.digest_store import DigestStore, WorkKey, utcnow
from digest.store.schema import DigestItemRow, PaperRow, SummaryRow
from digest.store.search_index import categories, search

MONDAY, TUESDAY = date(2026, 3, 9), date(2026, 3, 10)
KEY = WorkKey("m", "p1", "abstract")


def _paper(n: int, title: str, abstract: str, authors=("A. Author",), cats=("cs.CL",), v=1):
    return Paper(f"2603.{n:05d}", title, abstract, list(authors), list(cats), version=v)


def _review(**fields) -> Review:
    base = dict(
        summary="A reviewer's summary.",
        strengths=["clear writing"],
        weaknesses=["small evaluation"],
        questions=[],
        limitations=[],
        overall=6,
        confidence=3,
        decision="Accept",
        input_basis="abstract",
    )
    return Review(**{**base, **fields})


def _found(engine, query: str, **filters) -> list[str]:
    return [hit.paper.arxiv_id for hit in search(engine, parse_query(query), **filters).hits]


@pytest.fixture
def store(db_url):
    engine = open_database(db_url)
    migrate.upgrade(engine)
    yield DigestStore(engine)
    engine.dispose()


def _publish(store: DigestStore, day: date, papers: list[Paper]) -> int:
    store.upsert_papers(papers)
    store.add_items(day, papers, "abstract")
    run_id = store.start_run(day, {}, "m", "local", "p1")
    for paper in papers:
        store.set_item(day, paper.arxiv_id, "done", run_id, None)
    return run_id


def test_every_field_is_indexed_and_ranked(store):
    sparse = _paper(1, "Sparse attention", "We prune heads.", authors=["Ada Lovelace"])
    graphs = _paper(2, "Graph retrieval", "Dense attention baselines are compared.")
    run_id = _publish(store, MONDAY, [sparse, graphs])
    store.save_summary(graphs, KEY, "Quantised embeddings shrink the index.", run_id)
    store.save_review(
        graphs, KEY, _review(weaknesses=["no ablation study"]), "ok", "{}", None, run_id
    )
    engine = store.engine
    assert _found(engine, "lovelace") == [sparse.arxiv_id]  # authors
    assert _found(engine, "prune") == [sparse.arxiv_id]  # abstract
    assert _found(engine, "quantised embeddings") == [graphs.arxiv_id]  # summary
    assert _found(engine, "ablation") == [graphs.arxiv_id]  # a review's list item
    assert _found(engine, "reviewer's summary") == [graphs.arxiv_id]  # the review's summary
    assert _found(engine, "Accept") == []  # the decision is a score, not review text
    # A title match outranks a match in the abstract; stemming: "attentions" finds both.
    assert _found(engine, "attentions") == [sparse.arxiv_id, graphs.arxiv_id]
    hit = search(engine, parse_query("ablation")).hits[0]
    assert hit.digest_date == MONDAY and hit.entry_link() == "digest-2026-03-09.html#2603.00002"
    assert ("ablation", True) in hit.snippet
    assert hit.score > 0 or engine.dialect.name == "sqlite"  # bm25 is ~0 on a tiny corpus


def test_snippets_show_latex_as_the_pages_do(store):
    _publish(
        store, MONDAY, [_paper(1, "Bounds for $\\alpha$-divergences", "We bound $x^2$ tightly.")]
    )
    (hit,) = search(store.engine, parse_query("tightly")).hits
    assert "bound x² tightly" in "".join(text for text, _ in hit.snippet)
    assert "".join(text for text, _ in hit.title) == "Bounds for α-divergences"


def test_phrases_need_their_words_in_order(store):
    _publish(store, MONDAY, [_paper(1, "Knowledge graphs for QA", "Text.")])
    engine = store.engine
    assert _found(store.engine, '"knowledge graphs"') == ["2603.00001"]
    assert _found(engine, '"graphs knowledge"') == []
    assert _found(engine, "graphs knowledge") == ["2603.00001"]  # words: any order
    assert _found(engine, "knowledge missing") == []  # every word must match


def test_the_index_follows_reruns_new_versions_and_redo(store):
    paper = _paper(1, "Original title", "Abstract.")
    run_id = _publish(store, MONDAY, [paper])
    store.save_review(paper, KEY, None, "failed", "garbled verbatim reply", "bad json", run_id)
    engine = store.engine
    # A reply that did not validate is not on the public page: not searchable either.
    assert _found(engine, "garbled") == [] and _found(engine, "original") == [paper.arxiv_id]
    # The rerun's review replaces the failed one, and its prose is found.
    store.save_review(paper, KEY, _review(strengths=["rigorous proofs"]), "ok", "{}", None, run_id)
    assert _found(engine, "rigorous") == [paper.arxiv_id]
    with store.engine.connect() as conn:  # one document per paper, whatever was rewritten
        assert conn.execute(text("SELECT count(*) FROM search_documents")).scalar_one() == 1
    store.save_summary(paper, KEY, "Mentions tokenisers.", run_id)
    store.save_summary(paper, WorkKey("other-model", "p1", "abstract"), "Mentions GPUs.", run_id)
    assert _found(engine, "tokenisers") == _found(engine, "gpus") == [paper.arxiv_id]
    # --redo drops this model's results: they leave the index; the other model's stay.
    store.forget_results(paper.arxiv_id, "m", "p1")
    assert _found(engine, "tokenisers") == [] and _found(engine, "rigorous") == []
    assert _found(engine, "gpus") == [paper.arxiv_id]
    # A new version's metadata replaces the old one's.
    store.upsert_papers([_paper(1, "Revised heading", "Abstract.", v=2)])
    assert _found(engine, "original") == [] and _found(engine, "revised") == [paper.arxiv_id]


def test_the_migration_builds_the_index_and_the_downgrade_removes_it(db_url):
    engine = open_database(db_url)
    migrate.upgrade(engine)
    store = DigestStore(engine)
    run_id = _publish(store, MONDAY, [_paper(1, "Stored before", "Alpha.")])
    migrate.downgrade(engine, "0004")  # as a database from before search
    tables = set(inspect(engine).get_table_names())
    assert not {t for t in tables if t.startswith("search")}, tables
    with engine.begin() as conn:  # written at 0004: no trigger may be left to fail it
        conn.execute(insert(PaperRow.__table__).values(**_row(_paper(2, "Written at 0004", "B."))))
        conn.execute(
            insert(DigestItemRow.__table__).values(
                digest_date=TUESDAY,
                paper_id="2603.00002",
                position=0,
                status="done",
                input_basis="abstract",
            )
        )
        conn.execute(
            insert(SummaryRow.__table__).values(
                paper_id="2603.00002",
                paper_version=1,
                model="m",
                prompt_version="p1",
                input_basis="abstract",
                text="Backfilled summary words.",
                run_id=run_id,
                created_at=utcnow(),
            )
        )
    migrate.upgrade(engine)
    assert _found(engine, "stored") == ["2603.00001"]
    assert _found(engine, "backfilled") == ["2603.00002"]
    migrate.downgrade(engine, "base")
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    engine.dispose()


def _row(paper: Paper) -> dict:
    now = utcnow()
    return dict(
        arxiv_id=paper.arxiv_id,
        version=paper.version,
        title=paper.title,
        abstract=paper.abstract,
        authors=paper.authors,
        categories=paper.categories,
        first_seen_at=now,
        last_seen_at=now,
    )


def test_filters_entry_dates_and_browsing(store):
    cl = _paper(1, "Parsing news", "Text.", cats=["cs.CL"])
    ir = _paper(2, "Parsing queries", "Text.", cats=["cs.IR", "cs.CL"])
    _publish(store, MONDAY, [cl])
    _publish(store, TUESDAY, [ir, cl])  # cl again: republished, its entry stays on Monday
    engine = store.engine
    assert sorted(_found(engine, "parsing")) == ["2603.00001", "2603.00002"]
    assert _found(engine, "parsing", category="cs.IR") == ["2603.00002"]
    assert _found(engine, "parsing", day=MONDAY) == ["2603.00001"]
    (hit,) = search(engine, parse_query("news")).hits
    assert hit.digest_date == MONDAY and hit.dates == [MONDAY, TUESDAY]
    browsed = search(engine, None, category="cs.CL")
    assert [h.paper.arxiv_id for h in browsed.hits] == ["2603.00001", "2603.00002"]
    assert [h.paper.arxiv_id for h in search(engine, None, category="cs.IR").hits] == ["2603.00002"]
    assert search(engine, None, day=MONDAY, limit=1).total == 1
    assert search(engine, parse_query("parsing"), limit=1, offset=1).total == 2
    assert len(search(engine, parse_query("parsing"), limit=1, offset=1).hits) == 1
    assert categories(engine) == [("cs.CL", 2), ("cs.IR", 1)]
    # A stored paper that no digest lists has no page to link: not found.
    store.upsert_papers([_paper(3, "Parsing unlisted", "Text.")])
    assert "2603.00003" not in _found(engine, "parsing")


def test_for_you_filter(store):
    """Papers a reader profile picked ("for you" reasons on a digest's item)."""
    picked = _paper(1, "Parsing news", "Text.")
    other = _paper(2, "Parsing queries", "Text.")
    store.upsert_papers([picked, other])
    ranking = {picked.arxiv_id: (2.0, ['mentions "parsing"']), other.arxiv_id: (0.1, [])}
    store.add_items(MONDAY, [picked, other], "abstract", ranking=ranking)
    engine = store.engine
    assert _found(engine, "parsing", for_you=True) == [picked.arxiv_id]
    assert [h.paper.arxiv_id for h in search(engine, None, for_you=True).hits] == ["2603.00001"]
    store.upsert_papers([_paper(3, "Parsing more", "Text.")])
    store.add_items(TUESDAY, [_paper(3, "Parsing more", "Text.")], "abstract")  # no profile
    assert search(engine, None, for_you=True).total == 1
    assert search(engine, parse_query("parsing")).total == 3


GARBAGE = [
    '"',
    '""',
    '"""',
    "*",
    "NEAR(",
    "NEAR(a b",
    "-",
    "-parsing",
    "parsing*",
    "a OR b",
    "NOT",
    "AND",
    "title:parsing",
    "^parsing",
    "(",
    ")",
    "{x}",
    'parsing"news',
    '"unbalanced phrase',
    "'; DROP TABLE papers; --",
    "数据 解析",
    "🙂",
    "e\u0301",
    "\x00parsing",
    "\\",
    "%_",
    ":",
    "parsing & news | !x <-> y",
    "x" * MAX_QUERY_CHARS,
]


def test_query_syntax_garbage_is_searched_as_text_or_refused_clearly(store):
    _publish(store, MONDAY, [_paper(1, "Parsing news", "数据 解析 text.")])
    for typed in GARBAGE:  # one store for all: a migration per case would be slow
        try:
            query = parse_query(typed)
        except QueryError as exc:
            assert str(exc), typed  # a message for the user
            continue
        results = search(store.engine, query)  # never a database error
        assert results.total == len(results.hits) <= 1, typed


def test_garbage_that_still_names_words_finds_them(store):
    _publish(store, MONDAY, [_paper(1, "Parsing news", "Text.")])
    for typed in ("-parsing", "parsing*", "(parsing)", "\x00parsing", 'parsing"news', "^parsing:"):
        assert _found(store.engine, typed) == ["2603.00001"], typed


def test_parse_query():
    assert [(t.text, t.phrase) for t in parse_query('a "b  c" d-e').terms] == [
        ("a", False),
        ("b c", True),
        ("d-e", False),
    ]
    assert parse_query('say "x"" y').fts5() == '"say" AND "x" AND "y"'
    for bad in ("", "   ", '"', "* - (", "x" * (MAX_QUERY_CHARS + 1), " ".join(["w"] * 33)):
        with pytest.raises(QueryError):
            parse_query(bad)


def test_concurrent_writers_of_one_paper_both_reach_the_index(db_url):
    """PostgreSQL, READ COMMITTED: a summary and a review of one paper committed by two
    transactions at once; each trigger rebuilds the document, the later one must see both."""
    if not db_url.startswith("postgresql"):
        pytest.skip("SQLite has one writer at a time")
    engine = open_database(db_url)
    migrate.upgrade(engine)
    store = DigestStore(engine)
    paper = _paper(1, "Title", "Abstract.")
    run_id = _publish(store, MONDAY, [paper])
    first = engine.connect()
    first.execute(
        insert(SummaryRow.__table__).values(
            paper_id=paper.arxiv_id,
            paper_version=1,
            model="m",
            prompt_version="p1",
            input_basis="abstract",
            text="Summary about lemmas.",
            run_id=run_id,
            created_at=utcnow(),
        )
    )
    second = threading.Thread(
        target=store.save_summary,
        args=(paper, WorkKey("m2", "p1", "abstract"), "Summary about theorems.", run_id),
    )
    second.start()
    second.join(1.0)
    assert second.is_alive()  # waits for the first writer's document
    first.commit()
    first.close()
    second.join(10)
    assert _found(engine, "lemmas") == _found(engine, "theorems") == [paper.arxiv_id]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM search_documents")).scalar_one() == 1
    engine.dispose()


def test_a_real_run_is_searchable_and_links_to_its_published_entries(tmp_path, db_url):
    """`digest run` (a stub model) fills the index through the store's ordinary writes; every
    hit's link names an entry that the published page has."""
    from digest.pipeline import run_digest
    from tests.digest.fault_server import FaultServer
    from tests.digest.test_pipeline import DAY, options

    with FaultServer() as stub:
        report = run_digest(options(tmp_path, db_url, stub.base_url))
    assert report.exit_code == 0
    engine = open_database(db_url)
    from_summaries = search(engine, parse_query('"focused problem"'))  # the stub's summaries
    from_reviews = search(engine, parse_query("limited baselines"))  # its reviews' weaknesses
    assert from_summaries.total == from_reviews.total == 4
    by_title = search(engine, parse_query("tokenizer-free"))
    assert [h.paper.title for h in by_title.hits] == ["Tokenizer-Free Language Models"]
    page = (tmp_path / "out" / f"digest-{DAY}.html").read_text(encoding="utf-8")
    for hit in from_reviews.hits:
        name, anchor = hit.entry_link().split("#")
        assert name == f"digest-{DAY}.html" and f'id="{anchor}"' in page
    engine.dispose()


def test_an_arxiv_id_finds_its_paper(store):
    """Found from outside: `digest search 2603.00002` found nothing (an id is not an indexed
    word). Any spelling of the id finds the paper; filters still apply."""
    papers = [_paper(1, "Sparse attention", "We prune heads."), _paper(2, "Graphs", "Text.")]
    _publish(store, MONDAY, papers)
    engine = store.engine
    spellings = (
        "2603.00002",
        "2603.00002v3",
        "arXiv:2603.00002",
        "https://arxiv.org/abs/2603.00002v1",
    )
    for spelling in spellings:
        assert _found(engine, spelling) == ["2603.00002"], spelling
    assert _found(engine, "2603.00002", day=TUESDAY) == []
    assert _found(engine, "2603.09999") == []  # an id the store does not have
    assert _found(engine, '"2603.00002"') == []  # a quoted phrase is text, as typed
    assert parse_query("2603.00002 graphs").paper_id is None  # an id among words is a word
