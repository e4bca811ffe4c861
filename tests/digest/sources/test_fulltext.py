from __future__ import annotations

from pathlib import Path

import pytest

from digest.paper import Paper
from digest.sources.fulltext import (
    FullText,
    fetch_fulltext,
    fulltext_url,
    html_to_text,
    truncate_text,
)
from tests.digest.sources.scripted_server import Reply

HTML = (Path(__file__).parent / "fixtures" / "arxiv_html_2401.01234v2.html").read_text("utf-8")
PAPER = Paper(arxiv_id="2401.01234", title="A Tiny Paper on Attention", abstract="...", version=2)
HTML_TYPE = "text/html; charset=utf-8"

EXPECTED = """A Tiny Paper on Attention

Ada Lovelace

Abstract

We study attention with cost $O(n^{2})$ in the sequence length.

1 Introduction

Transformers compute softmax attention. Each query attends to all keys.

Figure 1: Attention weights.

Keys & values are cached.

Queries are not.

$\\mathrm{softmax}(QK^{\\top})V$ (1)

2 Conclusion

Attention works."""


def test_arxiv_html_to_text():
    text = html_to_text(HTML)
    assert text == EXPECTED
    for absent in ("SCRIPT", "STYLE", "HEADER", "NAV", "FOOTER", "BIBLIOGRAPHY", "x1.png"):
        assert absent not in text


def test_math_without_alttext_uses_its_tex_annotation():
    html = (
        "<p>Let <math><semantics><mi>x</mi>"
        '<annotation encoding="application/x-tex">x_{i}</annotation></semantics></math> be.</p>'
    )
    assert html_to_text(html) == "Let $x_{i}$ be."


def test_a_page_without_article_uses_its_body():
    html = "<html><head><title>T</title></head><body><h1>Title</h1><p>One.</p><p>Two.</p></body>"
    assert html_to_text(html) == "Title\n\nOne.\n\nTwo."


def test_text_within_budget_is_untouched():
    assert truncate_text("Short.", 6) == FullText(text="Short.", truncated=False, original_chars=6)


def test_truncation_prefers_a_paragraph_boundary():
    text = "First paragraph here.\n\nSecond paragraph. It goes on and on."
    assert len(text) == 59
    assert truncate_text(text, 40) == FullText("First paragraph here.", True, 59)


def test_a_boundary_in_the_budgets_first_half_gives_way_to_a_later_one():
    text = "First paragraph here.\n\nSecond paragraph. It goes on and on."
    # The paragraph ends at 21 < 45 / 2: the sentence end at 40 keeps more text.
    assert truncate_text(text, 45) == FullText(
        "First paragraph here.\n\nSecond paragraph.", True, 59
    )
    assert truncate_text("One two three. Four five six seven eight nine ten.", 30) == FullText(
        "One two three. Four five six", True, 50
    )


def test_truncation_falls_back_to_a_space_then_a_hard_cut():
    assert truncate_text("Alpha beta gamma delta epsilon", 20) == FullText(
        "Alpha beta gamma", True, 30
    )
    assert truncate_text("x" * 50, 20) == FullText("x" * 20, True, 50)


def test_a_cut_right_at_the_budget_keeps_the_full_sentence():
    text = "Ends here. More text follows."
    assert truncate_text(text, 10) == FullText("Ends here.", True, len(text))


def test_truncation_needs_a_positive_budget():
    with pytest.raises(ValueError):
        truncate_text("text", 0)


def test_fulltext_url_is_the_papers_html_url():
    assert fulltext_url(PAPER) == PAPER.html_url == "https://arxiv.org/html/2401.01234v2"


def test_fetch_fulltext(server, client):
    server.script(Reply(body=HTML, content_type=HTML_TYPE))
    assert fetch_fulltext(client, PAPER, base_url=server.url("/html")) == EXPECTED
    [request] = server.received
    assert request.path == "/html/2401.01234v2"
    assert request.headers["Accept"].startswith("text/html")


def test_missing_html_returns_none_without_retry(server, client):
    server.script(Reply(status=404, body="No HTML for '2401.01234'", content_type=HTML_TYPE))
    assert fetch_fulltext(client, PAPER, base_url=server.url("/html")) is None
    assert len(server.received) == 1


def test_a_failing_server_returns_none(server, client):
    server.script(Reply(status=503), Reply(status=503), Reply(status=503))
    assert fetch_fulltext(client, PAPER, base_url=server.url("/html")) is None
    assert len(server.received) == 3


def test_an_empty_page_returns_none(server, client):
    server.script(Reply(body="<html><body><nav>menu</nav></body></html>", content_type=HTML_TYPE))
    assert fetch_fulltext(client, PAPER, base_url=server.url("/html")) is None
