from __future__ import annotations

import re
from datetime import UTC, date, datetime
from pathlib import Path

import pytest

from digest.sources.arxiv_api import day_query, fetch_arxiv_api, keep_latest_versions, parse_atom
from digest.sources.polite_http import SourceError
from tests.digest.sources.scripted_server import Reply

FIXTURES = Path(__file__).parent / "fixtures"
CURRENT = (FIXTURES / "arxiv_api_current_m5.atom.xml").read_text(encoding="utf-8")
LEGACY = (FIXTURES / "arxiv_api_legacy_format_cs.RO_m2.atom.xml").read_text(encoding="utf-8")
ENTRIES = re.findall(r"  <entry>.*?</entry>\n", CURRENT, re.DOTALL)
CURRENT_IDS = ["2202.12139", "2403.16981", "2409.05654", "cs/0503050", "hep-ph/0301050"]
DAY = date(2026, 3, 11)


def atom_page(entries: list[str], total: int, start: int = 0) -> str:
    """An API response holding `entries`, as arXiv pages them."""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<feed xmlns="http://www.w3.org/2005/Atom" '
        'xmlns:opensearch="http://a9.com/-/spec/opensearch/1.1/" '
        'xmlns:arxiv="http://arxiv.org/schemas/atom">\n'
        "  <id>https://arxiv.org/api/test</id>\n  <title>arXiv Query</title>\n"
        "  <updated>2026-03-12T00:00:00Z</updated>\n"
        f"  <opensearch:itemsPerPage>{len(entries)}</opensearch:itemsPerPage>\n"
        f"  <opensearch:totalResults>{total}</opensearch:totalResults>\n"
        f"  <opensearch:startIndex>{start}</opensearch:startIndex>\n"
        + "".join(entries)
        + "</feed>\n"
    )


def entry(arxiv_id: str, primary: str = "cs.CL", others: tuple[str, ...] = ()) -> str:
    categories = "".join(f'<category term="{term}"/>' for term in others)
    return (
        f"  <entry><id>http://arxiv.org/abs/{arxiv_id}</id><title>Paper {arxiv_id}</title>"
        "<updated>2026-03-11T09:30:00Z</updated><published>2026-03-11T09:30:00Z</published>"
        f"<summary>About {arxiv_id}.</summary><author><name>A. Author</name></author>"
        f'{categories}<arxiv:primary_category term="{primary}"/></entry>\n'
    )


def test_current_format():
    papers = parse_atom(CURRENT, "fixture")
    assert [p.arxiv_id for p in papers] == CURRENT_IDS
    assert [p.version for p in papers] == [1, 2, 9, 1, 2]
    first = papers[0]
    assert first.title == (
        "Testing Deep Learning Models: A First Comparative Study of Multiple Testing Techniques"
    )
    assert first.authors == ["Mohit Kumar Ahuja", "Arnaud Gotlieb", "Helge Spieker"]
    assert first.categories == ["cs.SE", "cs.LG"]
    assert first.abstract.startswith("Deep Learning (DL) has revolutionized the capabilities")
    assert first.abstract.endswith("on a classical benchmark used in VBS and discuss its results.")
    assert first.published == datetime(2022, 2, 24, 15, 5, 19, tzinfo=UTC)
    assert first.announce_type is None
    latex = papers[1]
    assert latex.categories == ["math.ST", "cs.IT", "stat.ML"]
    assert "distributions $p$ and $q$" in latex.abstract
    assert latex.published == datetime(2024, 3, 25, 17, 42, 32, tzinfo=UTC)
    assert latex.updated == datetime(2025, 5, 24, 5, 50, 33, tzinfo=UTC)
    assert latex.html_url == "https://arxiv.org/html/2403.16981v2"
    old_style = papers[4]
    assert (old_style.title, old_style.categories) == ("Statistical Test of Anarchy", ["hep-ph"])
    assert old_style.abs_url == "https://arxiv.org/abs/hep-ph/0301050"


def test_older_line_wrapped_format():
    papers = parse_atom(LEGACY, "legacy")
    assert [(p.arxiv_id, p.version) for p in papers] == [("2510.14968", 1), ("2510.14827", 1)]
    rdd = papers[0]
    assert rdd.title == (
        "RDD: Retrieval-Based Demonstration Decomposer for Planner Alignment in Long-Horizon Tasks"
    )
    assert rdd.abstract.startswith(
        "To tackle long-horizon tasks, recent hierarchical vision-language-action (VLAs) frameworks"
    )
    assert rdd.abstract.endswith("Code and more results are available at rdd-neurips.github.io.")
    assert "\n" not in rdd.abstract and "  " not in rdd.abstract
    assert rdd.categories == ["cs.RO", "cs.AI", "cs.CV", "cs.LG", "cs.SY", "eess.SY"]
    assert rdd.authors == ["Mingxuan Yan", "Yuping Wang", "Zechun Liu", "Jiachen Li"]
    assert rdd.published == datetime(2025, 10, 16, 17, 59, 37, tzinfo=UTC)
    assert papers[1].categories == ["cs.RO"]


def test_primary_category_comes_first_without_duplicates():
    page = atom_page([entry("2603.00001v1", primary="cs.LG", others=("cs.CL", "cs.LG"))], 1)
    [paper] = parse_atom(page, "page")
    assert paper.categories == ["cs.LG", "cs.CL"]


def test_a_new_version_is_the_same_paper():
    entries = [entry("2603.00001v1"), entry("2603.00002v1"), entry("2603.00001v3")]
    papers = parse_atom(atom_page(entries, 3), "page")
    assert [(p.arxiv_id, p.version) for p in papers] == [("2603.00001", 3), ("2603.00002", 1)]
    assert keep_latest_versions(reversed(papers))[1].version == 3


def test_an_old_style_id_with_version():
    [paper] = parse_atom(atom_page([entry("math/0211159v2", primary="math.GT")], 1), "page")
    assert (paper.arxiv_id, paper.version, paper.categories) == ("math/0211159", 2, ["math.GT"])


def test_api_error_entry_raises_with_its_summary():
    error = (
        "  <entry><id>http://arxiv.org/api/errors#incorrect_id_format_for_1234.1234v1</id>"
        "<title>Error</title><summary>incorrect id format for 1234.1234v1</summary>"
        '<link href="http://arxiv.org/api/errors#incorrect_id_format_for_1234.1234v1"/></entry>\n'
    )
    with pytest.raises(SourceError) as caught:
        parse_atom(atom_page([error], 1), "https://export.arxiv.org/api/query")
    assert str(caught.value) == (
        "https://export.arxiv.org/api/query: arXiv API error: incorrect id format for 1234.1234v1"
    )


def test_malformed_xml_raises_naming_the_origin():
    with pytest.raises(SourceError, match=r"^page-7: malformed feed \(.*\)$"):
        parse_atom('<?xml version="1.0"?><feed xmlns="http://www.w3.org/2005/Atom"><titl', "page-7")


def test_html_instead_of_a_feed_raises():
    with pytest.raises(SourceError, match="^page: not an Atom or RSS feed$"):
        parse_atom("<html><body><h1>Rate exceeded.</h1></body></html>", "page")
    with pytest.raises(SourceError, match="^page: not an Atom or RSS feed$"):
        parse_atom("", "page")


def test_a_damaged_feed_keeps_the_entries_it_could_read():
    damaged = atom_page([entry("2603.00001v1")], 1).replace("</feed>\n", "")
    assert [p.arxiv_id for p in parse_atom(damaged, "page")] == ["2603.00001"]


def test_empty_page_has_no_papers():
    assert parse_atom(atom_page([], 0), "page") == []


def test_day_query():
    assert day_query(["cs.CL", "cs.LG"], DAY) == (
        "(cat:cs.CL OR cat:cs.LG) AND submittedDate:[202603110000 TO 202603112359]"
    )


def test_fetch_pages_through_all_results(server, make_client):
    client = make_client(min_interval_s=0.1)
    server.script(
        Reply(body=atom_page(ENTRIES[0:2], total=5, start=0)),
        Reply(body=atom_page(ENTRIES[2:4], total=5, start=2)),
        Reply(body=atom_page(ENTRIES[4:5], total=5, start=4)),
        Reply(body="unused"),
    )
    papers = fetch_arxiv_api(
        client, ["cs.CL", "cs.LG"], DAY, None, base_url=server.url("/api/query"), page_size=2
    )
    assert [p.arxiv_id for p in papers] == CURRENT_IDS
    assert [r.path for r in server.received] == ["/api/query"] * 3
    assert [r.query["start"] for r in server.received] == [["0"], ["2"], ["4"]]
    assert [r.query["max_results"] for r in server.received] == [["2"]] * 3
    first = server.received[0]
    assert first.query["search_query"] == [
        "(cat:cs.CL OR cat:cs.LG) AND submittedDate:[202603110000 TO 202603112359]"
    ]
    assert first.query["sortBy"] == ["submittedDate"]
    assert first.headers["Accept"].startswith("application/atom+xml")
    assert "nightshift" in first.headers["User-Agent"]
    assert min(server.gaps()) >= 0.08  # the interval, less the jitter of arrival times


def test_fetch_stops_at_max_papers(server, client):
    server.script(
        Reply(body=atom_page(ENTRIES[0:2], total=5, start=0)),
        Reply(body=atom_page(ENTRIES[2:3], total=5, start=2)),
        Reply(body="unused"),
    )
    papers = fetch_arxiv_api(client, ["cs.CL"], DAY, 3, base_url=server.url("/q"), page_size=2)
    assert [p.arxiv_id for p in papers] == CURRENT_IDS[:3]
    assert [r.query["max_results"] for r in server.received] == [["2"], ["1"]]
    assert [r.query["start"] for r in server.received] == [["0"], ["2"]]


def test_fetch_of_a_day_without_papers(server, client):
    server.script(Reply(body=atom_page([], total=0)), Reply(body="unused"))
    assert fetch_arxiv_api(client, ["cs.CL"], DAY, None, base_url=server.url("/q")) == []
    assert len(server.received) == 1


def test_fetch_retries_a_throttled_page(server, client):
    server.script(Reply(status=503), Reply(body=atom_page(ENTRIES[:1], total=1)))
    papers = fetch_arxiv_api(client, ["cs.CL"], DAY, None, base_url=server.url("/q"))
    assert [p.arxiv_id for p in papers] == CURRENT_IDS[:1]
    assert [r.query["start"] for r in server.received] == [["0"], ["0"]]


def test_fetch_reports_the_api_error_of_a_bad_request(server, client):
    error = (
        "  <entry><id>http://arxiv.org/api/errors#start_must_be_non-negative</id>"
        "<title>Error</title><summary>start must be non-negative</summary></entry>\n"
    )
    server.script(Reply(status=400, body=atom_page([error], 1)))
    with pytest.raises(SourceError, match="arXiv API error: start must be non-negative$"):
        fetch_arxiv_api(client, ["cs.CL"], DAY, None, base_url=server.url("/q"))


def test_fetch_of_a_malformed_page_names_the_url(server, client):
    server.script(Reply(body='<?xml version="1.0"?>\n<feed><title>arXiv</titel></feed>'))
    url = server.url("/q")
    with pytest.raises(SourceError, match=rf"^{re.escape(url)} \(start=0\): malformed feed"):
        fetch_arxiv_api(client, ["cs.CL"], DAY, None, base_url=url)


def test_fetch_keeps_the_status_error_of_a_bad_request_without_a_feed(server, client):
    server.script(Reply(status=400, body="Bad Request", content_type="text/plain"))
    with pytest.raises(SourceError, match=r"HTTP 400 Bad Request: Bad Request$"):
        fetch_arxiv_api(client, ["cs.CL"], DAY, None, base_url=server.url("/q"))


def test_fetch_stops_at_a_page_the_api_left_empty(server, client, caplog):
    server.script(
        Reply(body=atom_page(ENTRIES[0:2], total=5, start=0)),
        Reply(body=atom_page([], total=5, start=2)),
        Reply(body="unused"),
    )
    papers = fetch_arxiv_api(client, ["cs.CL"], DAY, None, base_url=server.url("/q"), page_size=2)
    assert [p.arxiv_id for p in papers] == CURRENT_IDS[:2]
    assert len(server.received) == 2
    assert "empty page at start=2 of 5 results" in caplog.text


def test_a_wrong_encoding_declaration_is_not_an_error():
    page = atom_page([], 0).replace('encoding="UTF-8"', 'encoding="us-ascii"')
    assert parse_atom(page.replace("arXiv Query", "arXiv Query é").encode("utf-8"), "page") == []
