from __future__ import annotations

from datetime import date
from pathlib import Path

import pytest

from digest.sources import SourceUnreachable, load_papers
from tests.digest.sources.scripted_server import Reply, refused_url

FIXTURES = Path(__file__).parent / "fixtures"
DAY = date(2026, 3, 11)
ARGS = dict(categories=["cs.CL", "cs.LG"], day=DAY)


def test_arxiv_source_queries_the_api(server, client):
    server.script(Reply(body=(FIXTURES / "arxiv_api_current_m5.atom.xml").read_bytes()))
    papers = load_papers(
        "arxiv", **ARGS, max_papers=2, client=client, api_url=server.url("/api/query")
    )
    assert [p.arxiv_id for p in papers] == ["2202.12139", "2403.16981"]
    assert server.received[0].query["search_query"] == [
        "(cat:cs.CL OR cat:cs.LG) AND submittedDate:[202603110000 TO 202603112359]"
    ]


def test_rss_source_reads_the_announcement_feed(server, client):
    server.script(Reply(body=(FIXTURES / "arxiv_rss_cs.CL+cs.LG.xml").read_bytes()))
    papers = load_papers(
        "rss",
        **ARGS,
        max_papers=None,
        client=client,
        include_cross=True,
        rss_url=server.url("/rss"),
    )
    assert len(papers) == 4
    assert server.received[0].path == "/rss/cs.CL+cs.LG"


def test_any_other_source_is_a_file():
    papers = load_papers(str(FIXTURES / "papers_cs_2026-03_m3.json"), **ARGS, max_papers=None)
    assert [p.arxiv_id for p in papers] == ["2603.11048", "2603.11039", "2603.11027"]


def test_without_a_client_one_is_made_with_the_default_config(server):
    server.script(Reply(body=(FIXTURES / "arxiv_api_current_m5.atom.xml").read_bytes()))
    papers = load_papers("arxiv", **ARGS, max_papers=None, api_url=server.url("/api/query"))
    assert len(papers) == 5
    assert server.received[0].headers["User-Agent"].startswith("nightshift-digest/")


def test_no_network_is_source_unreachable(make_client):
    client = make_client(max_retries=0)
    with pytest.raises(SourceUnreachable):
        load_papers("arxiv", **ARGS, max_papers=None, client=client, api_url=refused_url())


@pytest.mark.parametrize("source", ["arxiv", "rss"])
def test_feeds_need_categories(client, source):
    with pytest.raises(ValueError, match="no arXiv categories"):
        load_papers(source, categories=[], day=DAY, max_papers=None, client=client)


def test_categories_filter_a_file_when_given():
    path = str(FIXTURES / "papers_cs_2026-03_m3.json")
    every = load_papers(path, categories=None, day=DAY, max_papers=None)
    assert len(every) == 3  # no --categories: the whole file
    cv = load_papers(path, categories=["cs.CV"], day=DAY, max_papers=None)
    assert [p.arxiv_id for p in cv] == ["2603.11048"]  # cross-lists count, as on arXiv
    some = load_papers(path, categories=["cs.DS", "cs.CV"], day=DAY, max_papers=1)
    assert [p.arxiv_id for p in some] == ["2603.11048"]  # --max-papers after the filter
    later = load_papers(path, categories=["cs.DS"], day=DAY, max_papers=1)
    assert [p.arxiv_id for p in later] == ["2603.11039"]
    assert load_papers(path, categories=["math.AG"], day=DAY, max_papers=None) == []
