from __future__ import annotations

from pathlib import Path

import pytest

from digest.sources.arxiv_rss import fetch_arxiv_rss, parse_rss
from digest.sources.polite_http import SourceError
from tests.digest.sources.scripted_server import Reply

FEED = (Path(__file__).parent / "fixtures" / "arxiv_rss_cs.CL+cs.LG.xml").read_bytes()
RSS_TYPE = "application/rss+xml; charset=utf-8"


def rss(*items: str) -> str:
    return (
        "<?xml version='1.0' encoding='UTF-8'?>\n"
        '<rss xmlns:arxiv="http://arxiv.org/schemas/atom" '
        'xmlns:dc="http://purl.org/dc/elements/1.1/" version="2.0"><channel>'
        "<title>cs.CL updates on arXiv.org</title><link>http://rss.arxiv.org/rss/cs.CL</link>"
        "<description>cs.CL updates</description>" + "".join(items) + "</channel></rss>"
    )


def test_keeps_new_announcements_only():
    papers = parse_rss(FEED, "feed", include_cross=False)
    assert [p.arxiv_id for p in papers] == ["2603.11039", "2603.11027", "2603.10913"]
    assert {p.announce_type for p in papers} == {"new"}
    assert [p.version for p in papers] == [1, 1, 1]


def test_includes_cross_lists_when_asked_but_never_replacements():
    papers = parse_rss(FEED, "feed", include_cross=True)
    assert [(p.arxiv_id, p.announce_type) for p in papers] == [
        ("2603.11039", "new"),
        ("2603.11027", "new"),
        ("2603.11048", "cross"),
        ("2603.10913", "new"),
    ]


def test_fields_of_an_announcement():
    graphs, judge, comic, embed = parse_rss(FEED, "feed", include_cross=True)
    assert graphs.title == "Instruction set for the representation of graphs"
    assert graphs.authors == ["Ezequiel Lopez-Rubio", "Mario Pascual-Gonzalez"]
    assert graphs.categories == ["cs.CL", "cs.AI", "cs.DS"]
    assert graphs.abstract.startswith("We present IsalGraph, a method for representing")
    assert graphs.abstract.endswith("and graph-conditioned language modelling")
    # The abstract follows "Abstract:"; its paragraph break becomes one space.
    assert judge.abstract.startswith("The paradigm of LLM-as-a-judge relies on a critical")
    assert "objective evaluation. We present two complementary findings" in judge.abstract
    assert "(Spearman $ρ= 0.99$)" in judge.abstract
    assert comic.categories[0] == "cs.CV"
    assert len(embed.authors) == 6 and embed.authors[-1] == "Siva Reddy"
    assert graphs.published is None


def test_type_falls_back_to_the_description_and_text_stays_plain():
    item = (
        "<item><title>Less &lt; More</title><link>https://arxiv.org/abs/2603.00001</link>"
        "<description>arXiv:2603.00001v2 Announce Type: new \n"
        "Abstract: If x&lt;y and y&gt;z then &amp; holds.</description>"
        '<guid isPermaLink="false">oai:arXiv.org:2603.00001v2</guid>'
        "<category>cs.CL</category><dc:creator>Ann Lee, Bo Chen</dc:creator></item>"
    )
    [paper] = parse_rss(rss(item), "feed", include_cross=False)
    assert (paper.arxiv_id, paper.version, paper.announce_type) == ("2603.00001", 2, "new")
    assert paper.title == "Less < More"
    assert paper.abstract == "If x<y and y>z then & holds."


def test_an_empty_announcement_day_has_no_papers():
    assert parse_rss(rss(), "feed", include_cross=True) == []


def test_a_broken_feed_raises_naming_it():
    with pytest.raises(SourceError, match=r"^https://rss\.arxiv\.org/rss/cs\.CL: malformed feed"):
        parse_rss(b"<rss><channel><title>x</titel>", "https://rss.arxiv.org/rss/cs.CL", False)


def test_fetch_asks_for_all_categories_in_one_request(server, client):
    server.script(Reply(body=FEED, content_type=RSS_TYPE), Reply(body="unused"))
    papers = fetch_arxiv_rss(client, ["cs.CL", "cs.LG"], False, 2, base_url=server.url("/rss"))
    assert [p.arxiv_id for p in papers] == ["2603.11039", "2603.11027"]
    [request] = server.received
    assert request.path == "/rss/cs.CL+cs.LG"
    assert request.headers["Accept"].startswith("application/rss+xml")
    assert "nightshift" in request.headers["User-Agent"]


def test_fetch_of_an_unknown_feed_raises(server, client):
    server.script(Reply(status=404, body="not found"))
    with pytest.raises(SourceError, match="HTTP 404"):
        fetch_arxiv_rss(client, ["cs.XX"], False, None, base_url=server.url("/rss"))
