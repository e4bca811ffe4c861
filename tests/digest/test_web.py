"""`nightshift digest serve` and `digest search` from outside, as users run them: a real server
process over a store the test fills (SQLite; PostgreSQL too when configured), raw HTTP for the
pages and for every kind of bad parameter, and the command line's exit codes."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from urllib.parse import quote

import httpx
import pytest

from digest.render import write_pages
from digest.store import migrate
from digest.store.database import open_database
from tests.digest.web_view_server import (
    MONDAY,
    NIGHTSHIFT,
    TUESDAY,
    digest_serve,
    fill_store,
    wait_exit,
)


@pytest.fixture
def served(db_url):
    store = fill_store(db_url)
    with digest_serve(db_url) as server, httpx.Client(base_url=server.url, timeout=10) as http:
        yield store, server, http
    store.engine.dispose()


def test_dates_day_pages_search_and_categories(served, tmp_path):
    store, server, http = served
    assert server.url.startswith("http://127.0.0.1:")  # loopback unless told
    index = http.get("/")
    assert index.status_code == 200 and "text/html" in index.headers["content-type"]
    assert index.text.index(str(TUESDAY)) < index.text.index(str(MONDAY))  # newest first
    assert 'href="digest-2026-03-09.html"' in index.text and "2 reviewed" in index.text
    assert 'href="search?category=cs.IR"' in index.text
    # A date's page is the published page itself, byte for byte.
    day = http.get(f"/digest-{MONDAY}.html")
    published = write_pages(tmp_path, store.load_digest(MONDAY))[0]  # what `digest render` writes
    assert day.status_code == 200 and day.text == published.read_text(encoding="utf-8")
    assert "Tokenisers for &lt;b&gt;code&lt;/b&gt; &amp; math" in day.text
    hits = http.get("/search", params={"q": "ablation 2603.00003"})
    assert hits.status_code == 200
    assert 'href="digest-2026-03-10.html#2603.00003"' in hits.text
    assert "<mark>ablation</mark>" in hits.text and "1 paper," in hits.text
    # The category filter, with and without words; the date filter.
    by_cat = http.get("/search", params={"category": "cs.CL"}).text
    assert "2603.00001" in by_cat and "2603.00003" in by_cat and "2603.00002" not in by_cat
    assert (
        "2603.00003" not in http.get("/search", params={"q": "ablation", "date": str(MONDAY)}).text
    )
    # "For you": offered where a reader profile picked papers, and a filter of its own.
    assert 'name="for_you"' in index.text and "For you (1)" in index.text
    for_you = http.get("/search", params={"for_you": "1"}).text
    assert "2603.00001" in for_you and "2603.00002" not in for_you and "for you" in for_you
    feed = http.get("/feed.xml")
    assert feed.status_code == 200 and feed.headers["content-type"] == "application/atom+xml"
    assert "digest-2026-03-10.html" in feed.text


BAD = [
    "/search?q=%22",
    "/search?q=*",
    "/search?q=-",
    "/search?q=%00",
    "/search?q=" + "x" * 2000,
    "/search?q=a&limit=abc",
    "/search?q=a&limit=0",
    "/search?q=a&limit=100000",
    "/search?q=a&page=-1",
    "/search?q=a&page=99999999999999999999999",
    "/search?date=2026-02-30",
    "/search?date=yesterday",
    "/search?for_you=maybe",
    "/search?category=" + "c" * 500,
    # Found from outside: a NUL in the category was a 500 on PostgreSQL (a DataError).
    "/search?category=%00",
    "/search?q=graphs&category=cs.%00IR",
    "/digest-2026-13-01.html",
    "/digest-2031-01-01.html",
    "/digest-..%2F..%2Fetc%2Fpasswd.html",
    "/nope",
]


def test_bad_parameters_are_4xx_pages_never_500(served):
    _, _, http = served
    for path in BAD:
        response = http.get(path)
        assert 400 <= response.status_code < 500, (path, response.status_code)
        assert "text/html" in response.headers["content-type"], path
        assert 'role="alert"' in response.text, path
    # Garbage that still has words is searched as text: a page, not an error.
    for q in ("NEAR(graphs", '"knowledge graphs', "graphs*", "-graphs", "数据", "e\u0301"):
        response = http.get("/search?q=" + quote(q))
        assert response.status_code == 200, q
    assert http.post("/search", data={"q": "x"}).status_code == 405


def test_a_page_past_the_last_links_back_to_the_last(served):
    """Found from outside: page 50 of 3 hits said "3 papers." with a Previous link to page 49,
    as empty, and so on down."""
    _, _, http = served
    past = http.get("/search", params={"q": "ablation", "limit": 1, "page": 50})
    assert past.status_code == 200 and "3 papers." in past.text
    assert 'rel="prev" href="search?q=ablation&amp;page=3&amp;limit=1"' in past.text
    assert 'rel="next"' not in past.text
    middle = http.get("/search", params={"q": "ablation", "limit": 1, "page": 2}).text
    assert 'rel="prev" href="search?q=ablation&amp;page=1&amp;limit=1"' in middle
    assert 'rel="next" href="search?q=ablation&amp;page=3&amp;limit=1"' in middle


def test_random_parameters_never_give_a_500(sqlite_url):
    """Fuzz: any text in any parameter is a page (200) or a 4xx page, never a server error."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)
    numbers = st.one_of(st.integers(-(10**20), 10**20).map(str), text)
    fill_store(sqlite_url).engine.dispose()
    with digest_serve(sqlite_url) as server, httpx.Client(base_url=server.url, timeout=10) as http:

        @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(q=text, category=text, day=text, page=numbers, limit=numbers, for_you=text)
        def check(q, category, day, page, limit, for_you):
            params = {"q": q, "category": category, "date": day, "page": page}
            params.update(limit=limit, for_you=for_you)
            response = http.get("/search", params=params)
            assert response.status_code in (200, 400), (params, response.status_code)
            assert "text/html" in response.headers["content-type"]

        check()
        assert server.proc.poll() is None


def test_the_view_cannot_write_the_store(served, db_url):
    store, server, _ = served
    # The server's connections are read-only: try through the same settings it uses.
    from sqlalchemy import text

    from digest.web.read_only_database import make_read_only

    engine = make_read_only(open_database(db_url, create=False))
    with pytest.raises(Exception, match="(?i)read.?only"):
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM search_documents"))
    engine.dispose()
    assert server.proc.poll() is None


def test_serve_stops_on_sigterm_with_exit_0(served):
    _, server, http = served
    assert http.get("/").status_code == 200
    server.proc.send_signal(signal.SIGTERM)
    assert wait_exit(server.proc) == 0


def test_serve_refuses_what_it_cannot_serve(tmp_path, sqlite_url):
    missing = tmp_path / "none.db"
    done = _run("serve", "--db", f"sqlite:///{missing}")
    assert done.returncode == 2 and "no database file" in done.stderr and not missing.exists()
    engine = open_database(sqlite_url)
    migrate.upgrade(engine, "0004")  # a database from before search
    engine.dispose()
    done = _run("serve", "--db", sqlite_url)
    assert done.returncode == 2 and "nightshift db upgrade" in done.stderr
    assert "Traceback" not in done.stderr
    fill_store(sqlite_url).engine.dispose()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        done = _run("serve", "--db", sqlite_url, "--port", port)
    assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in done.stderr


def test_search_command(db_url, tmp_path):
    fill_store(db_url).engine.dispose()
    done = _run("search", "--db", db_url, "ablation", "2603.00003")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "2026-03-10  2603.00003  Retrieval over knowledge graphs"
    assert "digest-2026-03-10.html#2603.00003" in done.stdout
    as_json = _run(
        "search", "--db", db_url, "--json", "--site-url", "https://d.example/x", '"few baselines"'
    )
    result = json.loads(as_json.stdout)
    assert result["total"] == 3 and len(result["results"]) == 3
    first = result["results"][0]
    assert (
        first["link"]
        == f"https://d.example/x/digest-{first['digest_date']}.html#{first['paper_id']}"
    )
    assert first["matches"] and "few baselines" in first["snippet"]
    limited = json.loads(
        _run("search", "--db", db_url, "--json", "--limit", "1", "ablation").stdout
    )
    assert limited["total"] == 3 and len(limited["results"]) == 1
    cat = json.loads(
        _run("search", "--db", db_url, "--json", "--category", "cs.LG", "summary").stdout
    )
    assert [r["paper_id"] for r in cat["results"]] == ["2603.00002"]
    # FTS5 syntax is text here: NEAR( is the word "near", found nowhere.
    assert _run("search", "--db", db_url, "NEAR(").stdout == "no papers found\n"
    for garbage in ('"', "*", "-", "", "\u00a0"):
        done = _run("search", "--db", db_url, garbage)
        assert done.returncode == 2 and done.stderr.startswith("error: "), garbage
        assert "Traceback" not in done.stderr
    assert _run("search", "--db", db_url, "--date", "2026-02-30", "x").returncode == 2
    assert _run("search", "--db", db_url, "zyzzyva").stdout.strip() == "no papers found"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(NIGHTSHIFT), "digest", *args], capture_output=True, text=True, timeout=60
    )
