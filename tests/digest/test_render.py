"""Rendered outputs: escaping, LaTeX, scores, failed papers, the Atom feed, the index, atomic
writes and byte-for-byte determinism."""

from __future__ import annotations

import html
import os
from datetime import date, datetime
from pathlib import Path

import feedparser
import pytest
from bs4 import BeautifulSoup

from digest.entries import DailyDigest, DigestEntry
from digest.paper import Paper
from digest.render import write_atomic, write_outputs
from digest.render.environment import escape_markdown
from digest.review import Review

EVIL = "<script>alert(1)</script> and <b>bold</b> & co"
LATEX = [r"$x^2 < y$", r"$\alpha_i$", r"$$\sum_{i=1}^n a_{i} > 0$$", r"\mathcal{O}(n)"]
LATEX_TEXT = "We show " + " then ".join(LATEX) + "."
RAW_REPLY = '{"overall": 11, "note": "<script>alert(2)</script>"}\n  second line'
DAY = date(2024, 1, 15)


def make_review(**overrides: object) -> Review:
    fields: dict[str, object] = dict(
        summary="The reviewer's summary: " + LATEX_TEXT,
        strengths=["Clear " + EVIL, "# not a heading"],
        weaknesses=[],
        questions=["Why *this* and _that_?"],
        limitations=["Only English"],
        soundness=3,
        presentation=None,
        contribution=2,
        overall=7,
        confidence=4,
        decision="Accept",
        input_basis="abstract",
    )
    fields.update(overrides)
    return Review(**fields)


def make_digest(day: date = DAY, hour: int = 2) -> DailyDigest:
    good = Paper(
        "2401.01234",
        "A title with " + EVIL + " and $O(n^2)$",
        "Abstract. " + LATEX_TEXT + "\n- a line that looks like a list",
        ["Ada Lovelace", "Alan Turing"],
        ["cs.CL", "cs.LG"],
        version=2,
    )
    unparsed = Paper("2401.05678", "The unparsed one", "Short.", ["Grace Hopper"], ["cs.LG"])
    failed = Paper("hep-th/9901001", "The failed one", "Short.", ["Emmy Noether"], ["hep-th"])
    pending = Paper("2401.09999", "The pending one", "Short.", ["Kurt Goedel"], ["cs.LO"])
    return DailyDigest(
        digest_date=day,
        model="default",
        prompt_version="review-v1",
        generated_at=datetime(day.year, day.month, day.day, hour, 5, 0),
        entries=[
            DigestEntry(good, "done", summary="Summary: " + LATEX_TEXT, review=make_review()),
            DigestEntry(unparsed, "done", review_raw=RAW_REPLY, review_parse_status="failed"),
            DigestEntry(failed, "failed", error="timeout <after> 3 tries"),
            DigestEntry(pending, "pending"),
        ],
    )


@pytest.fixture
def rendered(tmp_path: Path) -> dict[str, str]:
    paths = write_outputs(tmp_path, make_digest(), [make_digest()])
    return {path.name: path.read_text(encoding="utf-8") for path in paths}


def soup(text: str) -> BeautifulSoup:
    return BeautifulSoup(text, "html.parser")


def article(page: str, arxiv_id: str) -> BeautifulSoup:
    found = soup(page).find("article", id=arxiv_id)
    assert found is not None
    return found


def test_writes_the_four_files(tmp_path: Path) -> None:
    paths = write_outputs(tmp_path, make_digest(), [make_digest()])
    names = ["digest-2024-01-15.html", "digest-2024-01-15.md", "feed.xml", "index.html"]
    assert [p.name for p in paths] == names
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


def test_html_page_is_self_contained(rendered: dict[str, str]) -> None:
    page = soup(rendered["digest-2024-01-15.html"])
    assert page.find("script") is None
    assert page.find("style") is not None
    assert not page.find_all(src=True)
    external = [a["href"] for a in page.find_all(href=True) if a["href"].startswith("http")]
    arxiv = ("https://arxiv.org/abs/", "https://arxiv.org/pdf/")
    assert all(href.startswith(arxiv) for href in external)


def test_paper_text_is_escaped_everywhere(rendered: dict[str, str]) -> None:
    for name, text in rendered.items():
        assert "<script" not in text, name
        assert "<b>bold" not in text, name
    page = rendered["digest-2024-01-15.html"]
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    good = article(page, "2401.01234")
    assert good.find("b", string="bold") is None
    assert EVIL in good.h3.get_text()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in rendered["digest-2024-01-15.md"]


# Issue 19: LaTeX showed raw on the page (and `\textbf` lost its `\t` on the way). The page is
# read without a TeX renderer: formulas become their Unicode text, commands go.
LATEX_AS_TEXT = ["x² < y", "αᵢ", "Σᵢ₌₁ⁿ aᵢ > 0", "O(n)"]


def test_latex_is_rendered_as_text_in_html(rendered: dict[str, str]) -> None:
    good = article(rendered["digest-2024-01-15.html"], "2401.01234")
    text = good.get_text()
    for formula in LATEX_AS_TEXT:
        assert formula in text
    assert good.h3.get_text().endswith("and O(n²)")
    assert "$" not in text and "\\" not in text


def test_latex_is_rendered_as_text_in_markdown(rendered: dict[str, str]) -> None:
    text = html.unescape(rendered["digest-2024-01-15.md"])
    for formula in LATEX_AS_TEXT:
        assert formula in text
    assert "$" not in text and "\\mathcal" not in text


def test_markdown_keeps_markup_out_of_paper_text(rendered: dict[str, str]) -> None:
    md = rendered["digest-2024-01-15.md"]
    assert r"Why \*this\* and \_that\_?" in md
    assert r"- \# not a heading" in md
    assert "\n- a line that looks like a list" not in md  # abstract line breaks collapsed


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("# x", r"\# x"),
        ("1. a", r"1\. a"),
        ("2401.01234", "2401.01234"),
        ("- a", r"\- a"),
        ("-1 is negative", "-1 is negative"),
        ("a_b and $a_b$", r"a\_b and $a_b$"),
        (r"\alpha and \_", r"\alpha and \\\_"),
        ("$$a<b$$ & $c$", "$$a&lt;b$$ &amp; $c$"),
        ("[x](javascript:y)", r"\[x\](javascript:y)"),
    ],
)
def test_escape_markdown(text: str, expected: str) -> None:
    assert escape_markdown(text) == expected


def test_scores_and_missing_sub_scores(rendered: dict[str, str]) -> None:
    scores = article(rendered["digest-2024-01-15.html"], "2401.01234").find("ul", class_="scores")
    items = [" ".join(li.get_text().split()) for li in scores.find_all("li")]
    assert items == [
        "Overall 7/10",
        "Confidence 4/5",
        "Soundness 3/4",
        "Presentation n/a",
        "Contribution 2/4",
        "Decision Accept",
    ]
    md = rendered["digest-2024-01-15.md"]
    assert "**Overall** 7/10" in md and "**Presentation** n/a" in md
    assert "**Decision:** Accept" in md


def test_review_lists_summary_and_basis(rendered: dict[str, str]) -> None:
    good = article(rendered["digest-2024-01-15.html"], "2401.01234")
    text = good.get_text()
    for heading in ("Strengths", "Weaknesses", "Questions", "Limitations"):
        assert heading in text
    assert "Only English" in text and "None given." in text
    assert "Summary: We show" in text and "The reviewer's summary" in text
    assert "Input: abstract" in text
    assert "Ada Lovelace, Alan Turing" in text and "cs.CL" in text
    assert good.h3.a["href"] == "https://arxiv.org/abs/2401.01234"


def test_an_unparsed_reply_stays_off_the_public_page(rendered: dict[str, str]) -> None:
    # Issue 19: operational text (errors, raw replies, the prompt version) is for the run
    # report; readers see the summary, or that the paper is not summarised yet.
    unparsed = article(rendered["digest-2024-01-15.html"], "2401.05678")
    assert unparsed.pre is None and "overall" not in unparsed.get_text()
    md = rendered["digest-2024-01-15.md"]
    assert "Review unparsed" not in md and "alert(2)" not in md


def test_failed_and_pending_papers_are_listed(rendered: dict[str, str]) -> None:
    page = soup(rendered["digest-2024-01-15.html"])
    heading = page.find("h2", id="not-processed")
    assert heading is not None
    ids = [a["id"] for a in heading.find_all_next("article")]
    assert ids == ["hep-th/9901001", "2401.09999"]
    failed = article(rendered["digest-2024-01-15.html"], "hep-th/9901001")
    assert "Not summarised yet" in failed.get_text()
    md = rendered["digest-2024-01-15.md"]
    not_processed = md.split("## Not processed", 1)[1]
    assert "The failed one" in not_processed and "The pending one" in not_processed
    assert "Not summarised yet" in not_processed


def test_no_error_text_or_prompt_version_on_the_public_pages(rendered: dict[str, str]) -> None:
    for name in ("digest-2024-01-15.html", "digest-2024-01-15.md"):
        assert "timeout" not in rendered[name] and "3 tries" not in rendered[name]
        assert "review-v1" not in rendered[name] and "prompt" not in rendered[name]


def test_contents_pdf_links_and_dark_mode(rendered: dict[str, str]) -> None:
    page = soup(rendered["digest-2024-01-15.html"])
    toc = page.find("nav", class_="toc")
    links = [(a["href"], a.get_text()) for a in toc.find_all("a")]
    assert [href for href, _ in links] == [
        "#2401.01234",
        "#2401.05678",
        "#hep-th/9901001",
        "#2401.09999",
    ]
    assert links[0][1].endswith("and O(n²)")  # the title as the page shows it
    assert all(page.find(id=href[1:]) is not None for href, _ in links)
    good = article(rendered["digest-2024-01-15.html"], "2401.01234")
    assert good.find("a", string="PDF")["href"] == "https://arxiv.org/pdf/2401.01234v2"
    assert "(https://arxiv.org/pdf/2401.01234v2)" in rendered["digest-2024-01-15.md"]
    assert "prefers-color-scheme: dark" in page.style.get_text()
    assert page.find("meta", attrs={"name": "color-scheme"})["content"] == "light dark"


def test_a_summary_with_facts_the_abstract_lacks_is_marked_unverified(tmp_path: Path) -> None:
    digest = make_digest()
    digest.entries[0].summary = "It beats GPT-5 by 40 points on $x^2 < y$."
    paths = write_outputs(tmp_path, digest, [digest])
    pages = {path.name: path.read_text(encoding="utf-8") for path in paths}
    good = article(pages["digest-2024-01-15.html"], "2401.01234")
    assert good.find("span", class_="unverified").get_text() == "unverified"
    note = good.find("p", class_="unverified-note").get_text()
    assert "GPT-5, 40" in note and "abstract does not contain" in note
    assert "**Summary (unverified):**" in pages["digest-2024-01-15.md"]
    # The fixture's own summary only repeats the abstract: no mark.
    plain = write_outputs(tmp_path / "plain", make_digest(), [make_digest()])[0].read_text()
    assert "unverified" not in article(plain, "2401.01234").get_text()


def test_feed_parses_with_one_entry_per_day(tmp_path: Path) -> None:
    recent = [make_digest(date(2024, 1, d)) for d in (15, 14, 12)]
    for n in (2, 1, 0):  # the days in turn, each run rendering its page and the recent ones
        write_outputs(tmp_path, recent[n], recent[n:], site_url="https://example.org/digest/")
    feed = feedparser.parse((tmp_path / "feed.xml").read_bytes())
    assert not feed.bozo, feed.get("bozo_exception")
    assert [e.link for e in feed.entries] == [
        f"https://example.org/digest/digest-2024-01-{d}.html" for d in (15, 14, 12)
    ]
    assert feed.entries[0].id == "https://example.org/digest/digest-2024-01-15.html"
    assert "The unparsed one" in feed.entries[0].summary
    assert "<script" not in feed.entries[0].summary
    assert "O(n²)" in feed.entries[0].summary  # LaTeX as text, as on the page


def test_feed_without_site_url_uses_stable_tag_ids(tmp_path: Path) -> None:
    first = make_digest()
    write_outputs(tmp_path, first, [])  # today's digest is added when `recent` lacks it
    before = feedparser.parse((tmp_path / "feed.xml").read_bytes())
    assert not before.bozo
    assert [e.link for e in before.entries] == ["digest-2024-01-15.html"]
    rerun = make_digest(hour=9)  # re-rendered later: same id, new `updated`
    write_outputs(tmp_path, rerun, [rerun])
    after = feedparser.parse((tmp_path / "feed.xml").read_bytes())
    assert after.entries[0].id == before.entries[0].id
    assert after.entries[0].id.startswith("tag:")
    assert after.entries[0].updated != before.entries[0].updated


def test_index_lists_pages_newest_first(tmp_path: Path) -> None:
    (tmp_path / "digest-2023-12-31.html").write_text("old page")
    (tmp_path / "digest-2024-99-99.html").write_text("not a date")
    (tmp_path / "notes.html").write_text("unrelated")
    for day in (date(2024, 1, 14), date(2024, 1, 16), date(2024, 1, 15)):
        write_outputs(tmp_path, make_digest(day), [make_digest(day)])
    index = soup((tmp_path / "index.html").read_text())
    hrefs = [a["href"] for a in index.find("main").find_all("a")]
    assert hrefs == [
        "digest-2024-01-16.html",
        "digest-2024-01-15.html",
        "digest-2024-01-14.html",
        "digest-2023-12-31.html",
    ]
    assert index.find("a", href="feed.xml") is not None


def test_writes_are_atomic(tmp_path: Path) -> None:
    write_outputs(tmp_path, make_digest(), [make_digest()])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    target = tmp_path / "feed.xml"
    before = target.read_bytes()
    with pytest.raises(UnicodeEncodeError):
        write_atomic(target, "half written \ud800")  # fails midway through the write
    assert target.read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert os.stat(target).st_mode & 0o777 == 0o644


def test_rendering_is_deterministic(tmp_path: Path) -> None:
    outputs = []
    for name in ("a", "b"):
        paths = write_outputs(tmp_path / name, make_digest(), [make_digest()])
        outputs.append([p.read_bytes() for p in paths])
    assert outputs[0] == outputs[1]
    again = write_outputs(tmp_path / "a", make_digest(), [make_digest()])
    assert [p.read_bytes() for p in again] == outputs[0]


def test_feed_shows_latex_as_text(tmp_path: Path) -> None:
    write_outputs(tmp_path, make_digest(), [make_digest()])
    feed = feedparser.parse((tmp_path / "feed.xml").read_bytes())
    summary = feed.entries[0].summary
    assert "and O(n²)" in summary and "x² &lt; y" in summary
    assert "$O(n^2)$" not in summary


def test_a_paper_summarised_but_not_reviewed_says_so(tmp_path: Path) -> None:
    """Found from outside: a failed paper with a summary (its review did not validate) showed
    "Not summarised yet" right above its summary."""
    digest = make_digest()
    digest.entries[2].summary = "It has a summary."
    outputs = {p.name: p.read_text() for p in write_outputs(tmp_path, digest, [digest])}
    failed = article(outputs["digest-2024-01-15.html"], "hep-th/9901001").get_text()
    assert "Not reviewed yet" in failed and "Not summarised" not in failed
    assert "It has a summary." in failed
    md = outputs["digest-2024-01-15.md"].split("## Not processed", 1)[1]
    assert "Not reviewed yet" in md and md.count("Not summarised yet") == 1  # the pending one


def test_authors_listed_below_the_cut_show_latex_as_text(tmp_path: Path) -> None:
    digest = make_digest()
    below = Paper("2401.07777", "Below", "Short.", [r"Kurt G\"odel", "Emmy Noether"], ["cs.LO"])
    digest.entries.append(DigestEntry(below, "below_cut"))
    outputs = {p.name: p.read_text() for p in write_outputs(tmp_path, digest, [digest])}
    for name in ("digest-2024-01-15.html", "digest-2024-01-15.md"):
        assert "Kurt Gödel" in outputs[name] and r"G\"odel" not in outputs[name], name
