"""Issue 19's figures and the mechanisms behind them: loop detection (and the one retry it earns
a summary), the faithfulness check, the quality figures, and `bench digest-quality` run end to
end against the scripted server."""

from __future__ import annotations

import json
import re
from datetime import date

import pytest
from bs4 import BeautifulSoup

from digest.entries import DigestEntry
from digest.faithfulness import checkable_tokens, paper_source, unsupported
from digest.instruction_echo import drop_recitals, recitals
from digest.paper import Paper
from digest.pipeline import run_digest
from digest.prompts import (
    PROMPT_VERSION,
    SUMMARY_FREQUENCY_PENALTY,
    SUMMARY_INSTRUCTIONS,
    SUMMARY_RETRY_FREQUENCY_PENALTY,
    paper_block,
    review_messages,
    summary_messages,
)
from digest.quality import measure
from digest.quality_bench import QualityBenchConfig, run_quality_bench
from digest.repetition import loops, repeated_run, repeated_sentence
from digest.review import Review
from digest.store.database import open_database
from digest.store.digest_store import DigestStore, WorkKey
from tests.digest.fault_server import Fault, FaultServer, default_responder, review_for
from tests.digest.test_pipeline import DAY, TITLES, options, write_papers

# The shape of the default model's loops on real papers (issue 19).
LOOPING = (
    "The paper proposes a new value model for reinforcement learning. This value function is "
    "designed to be flexible and can be used to evaluate the value function, which is designed "
    "to be flexible and can be used to evaluate the value function, which"
)


def test_loops_are_a_sentence_said_twice_or_a_long_run_of_words_said_again():
    text = "It works very well. Results follow. It works very well."
    assert repeated_sentence(text) == "It works very well."
    assert repeated_run(LOOPING) is not None and loops(LOOPING)
    # Shared terms and short repeats are ordinary prose.
    prose = (
        "Large language models are strong. We evaluate large language models on two tasks. "
        "Done. Done."
    )
    assert not loops(prose)


def test_faithfulness_finds_numbers_and_names_the_source_lacks():
    source = "We present LoRA-X for large language models (LLM) and improve accuracy by 12.5 %."
    summary = "LoRA-X improves accuracy by 12.5% on GLUE. The LLMs gain 2012 points in English."
    assert unsupported(summary, source) == ["GLUE", "2012", "English"]
    # A sentence's first word is not a name; a number must stand alone ("12" is not in "2012").
    assert checkable_tokens("Results improve. It gains 12 points.") == ["12"]
    assert unsupported("It gains 12 points.", "in 2012") == ["12"]
    # A hyphenated word is its names: "AI-powered" names nothing the paper must have, and
    # "BERT-style" needs only BERT (seen on real papers); with digits, the whole token.
    said = "It is an AI-powered, BERT-style and Llama-based model. GPT-4 wins."
    assert unsupported(said, "We use BERT and GPT-3 on 4 tasks.") == ["Llama-based", "GPT-4"]


def _entry(n: int, summary: str, review: Review | None = None) -> DigestEntry:
    abstract = "We test 3 tiny models on SQuAD."
    paper = Paper(f"2603.0000{n}", "Tiny Models", abstract, ["Ada Lovelace"])
    return DigestEntry(paper, "done", summary=summary, review=review)


def test_measure_counts_each_figure():
    review = Review.model_construct(  # as stored before issue 19: unchecked
        summary="It argues that the eval",
        strengths=["1.00", "Clear motivation"],
        weaknesses=["4.], ,"],
        questions=[],
        limitations=[],
        overall=3,
        confidence=4,
        decision="Accept",
        input_basis="abstract",
    )
    entries = [
        _entry(1, "Tiny Models tests 3 models on SQuAD.", review),
        _entry(2, LOOPING + " and"),
        _entry(3, "It reaches 97% on GLUE."),
    ]
    paper_ids = {"2603.00001": "length"}
    figures = measure(entries, paper_ids, {})
    assert (figures.papers, figures.done, figures.summaries) == (3, 3, 3)
    assert figures.summaries_at_token_limit == 1
    assert figures.summaries_looping == 1
    assert figures.summaries_unfinished == 1
    assert figures.summaries_unfaithful == 1  # 97%, GLUE
    assert (figures.reviews, figures.decision_contradicts_score) == (1, 1)
    assert figures.review_summaries_unfinished == 1
    assert (figures.list_items, figures.list_items_junk) == (3, 2)
    assert figures.examples["unfaithful"] == ["2603.00003: 97%, GLUE"]
    # The source is what the model was given: a full text may hold what the abstract lacks.
    full = {"2603.00003": paper_source(entries[2].paper, "It reaches 97% on GLUE and more.")}
    assert measure(entries[2:], {}, full).summaries_unfaithful == 0


# The two kinds of unfaithful summary the default model wrote most (issue 19), verbatim.
ECHOED = (
    "SiDiaC-v.2.0: Sinhala Diachronic Corpus Version 2.0 Title: SiDiaC-v.2.0: Sinhala Diachronic "
    "Corpus Version 2.0 Authors: Nevidu Jayatilleke, Nisansa de Silva Categories: cs.CL"
)
VENUE = "The paper, published in the Journal of Artificial Intelligence Research, explores PRF."


def test_the_prompt_shows_the_paper_as_plain_text_without_label_words():
    """Issue 19: in 5 of 9 unfaithful summaries the default model copied the prompt's labels
    ("Title", "Authors", "Categories", "Abstract") into the summary. The paper is its title
    line and its text; no label word, and no metadata a summary has no use for."""
    paper = Paper("2603.00001", "Tiny Models", "We test tiny models.", ["Ada Lovelace"], ["cs.CL"])
    blocks = {
        "abstract": paper_block(paper, "abstract", paper.abstract),
        "fulltext": paper_block(paper, "fulltext", "1 Introduction\nWe test.", truncated=True),
    }
    assert blocks["abstract"] == "Tiny Models\n\nWe test tiny models."
    assert blocks["fulltext"] == "Tiny Models\n\n1 Introduction\nWe test.\n[…]"
    label = re.compile(r"\b(?:Title|Authors?|Categories|Abstract|arXiv|Full text|Task)\s*:")
    for basis, block in blocks.items():
        for message in summary_messages(block):
            assert not label.search(message["content"]), message["content"]
        # The review shares the paper (one cached prefix); its task keeps its own words.
        assert review_messages(block, basis)[1]["content"].startswith(f"{block}\n\n")
        assert "Ada Lovelace" not in block and "cs.CL" not in block
    # The bench counts summaries that still copy labels, or name a venue.
    figures = measure([_entry(1, ECHOED), _entry(2, VENUE), _entry(3, "Tiny Models work.")], {}, {})
    assert (figures.summaries_with_labels, figures.summaries_naming_a_venue) == (1, 1)
    assert figures.examples["labels"] == ["2603.00001: Title:, Authors:, Categories:"]


def test_a_looping_summary_is_asked_once_more_under_a_stronger_penalty(tmp_path, sqlite_url):
    faults = [Fault("text", text=LOOPING, match=TITLES[0], times=1)]
    with FaultServer(faults=faults) as stub:
        report = run_digest(options(tmp_path, sqlite_url, stub.base_url))
        summaries = [r for r in stub.requests if "response_format" not in r]
    assert report.status == "succeeded"
    first = [r for r in summaries if TITLES[0] in r["messages"][1]["content"]]
    assert [r["frequency_penalty"] for r in first] == [
        SUMMARY_FREQUENCY_PENALTY,
        SUMMARY_RETRY_FREQUENCY_PENALTY,
    ]
    assert len(summaries) == len(TITLES) + 1  # only the looping one was asked again
    store = DigestStore(open_database(sqlite_url))
    assert not loops(store.load_digest(DAY).entries[0].summary)
    # Both calls are recorded: the first one's tokens were spent too.
    calls = [c for c in store.calls(report.run_id) if c.kind == "summary"]
    assert len(calls) == len(TITLES) + 1 and report.calls == len(calls) + len(TITLES)


def test_bench_digest_quality_runs_the_digest_and_counts(tmp_path):
    papers = write_papers(tmp_path / "papers.jsonl")
    low = json.dumps(review_for(TITLES[1]) | {"overall": 2, "decision": "Accept"})
    faults = [
        Fault("text", text="It beats GPT-5 by 40 points.", match=TITLES[0], times=1),
        Fault("text", text=low, match=TITLES[1], times=2),  # its summary, then its review
    ]
    with FaultServer(faults=faults) as stub:
        cfg = QualityBenchConfig(
            papers=str(papers),
            num_papers=3,
            endpoint=stub.base_url,
            model="stub-model",
            work_dir=str(tmp_path / "work"),
            json_out=str(tmp_path / "quality.json"),
        )
        lines: list[str] = []
        result = run_quality_bench(cfg, echo=lines.append)
    figures = json.loads((tmp_path / "quality.json").read_text())["figures"]
    assert figures == result["figures"]
    assert (figures["papers"], figures["summaries"], figures["reviews"]) == (3, 3, 3)
    assert figures["summaries_unfaithful"] == 2  # GPT-5 and 40; the JSON "summary" of paper 2
    assert figures["decision_contradicts_score"] == 0  # the score decided: Reject
    assert any(line.startswith("summaries with facts not in the paper") for line in lines)
    assert (tmp_path / "work" / "out" / f"digest-{date(2026, 3, 31)}.html").is_file()


def test_the_source_is_what_the_summary_prompt_showed():
    paper = Paper("2603.00001", "Tiny Models", "We test tiny models.", ["Ada Lovelace"], ["cs.CL"])
    said = "Tiny Models by Lovelace (arXiv 2603.00001v1, cs.CL) are tested."
    # Today's prompt shows the title and the text only: the author, id and category in a
    # summary came from somewhere else (the model cannot have read them there).
    assert unsupported(said, paper_source(paper)) == [
        "Lovelace",
        "arXiv",
        "2603.00001v1",
        "cs.CL",
    ]
    # A store written under a prompt that showed them is checked against them.
    assert unsupported(said, paper_source(paper, prompt_version="2026-11-29.2")) == []
    assert unsupported(said, paper_source(paper, prompt_version="2026-12-05.4")) != []


def test_a_sentence_reciting_the_instructions_is_dropped_and_counted(tmp_path):
    """Found on real papers: "In three or four sentences, explain what problem ..." came back as
    a summary's sentence. It is dropped before the summary is stored; a store written before
    that is counted by the quality figures."""
    recital = "In three or four plain sentences, the paper explains what problem it addresses."
    summary = f"Tiny models are tested on two tasks. {recital} They work well on both."
    assert recitals(summary, SUMMARY_INSTRUCTIONS, "Tiny models are tested.") == [
        "in three or four"
    ]
    # The paper's own words are not a recital, even where the instructions share them.
    assert recitals(summary, SUMMARY_INSTRUCTIONS, f"We write {recital}") == []
    assert drop_recitals(summary, SUMMARY_INSTRUCTIONS, "") == (
        "Tiny models are tested on two tasks. They work well on both."
    )
    assert drop_recitals(recital, SUMMARY_INSTRUCTIONS, "") == recital  # nothing else to say
    papers = write_papers(tmp_path / "papers.jsonl")
    reciting = Fault("text", text=summary, match="In three or four plain sentences", times=-1)
    with FaultServer(faults=[reciting]) as stub:
        figures = _bench_two(papers, stub, tmp_path / "a")["figures"]
    assert figures["summaries"] == 2 and figures["summaries_reciting_instructions"] == 0
    store = DigestStore(open_database(f"sqlite:///{tmp_path / 'a' / 'quality.db'}"))
    digest = store.load_digest(date(2026, 3, 31))
    assert [e.summary for e in digest.entries] == [
        "Tiny models are tested on two tasks. They work well on both."
    ] * 2
    # As an earlier digest stored it (before recitals were dropped): counted.
    key = WorkKey(digest.model, digest.prompt_version, "abstract")
    row = store.summary("2603.00001", key)
    with store.session() as s, s.begin():
        s.get(type(row), row.id).text = summary
    cfg = QualityBenchConfig(work_dir=str(tmp_path / "a"), measure_only=True)
    figures = run_quality_bench(cfg, echo=lambda _: None)["figures"]
    assert figures["summaries_reciting_instructions"] == 1
    assert figures["examples"]["recital"] == ["2603.00001: in three or four"]


def _bench_two(papers, stub: FaultServer, work_dir) -> dict:
    """bench digest-quality over the first two papers of `papers` against the stub."""
    cfg = QualityBenchConfig(
        papers=str(papers),
        num_papers=2,
        endpoint=stub.base_url,
        model="stub-model",
        work_dir=str(work_dir),
    )
    return run_quality_bench(cfg, echo=lambda _: None)


def test_measure_only_counts_a_store_as_it_was_written(tmp_path):
    papers = write_papers(tmp_path / "papers.jsonl")
    junk = json.dumps(review_for(TITLES[0]) | {"strengths": ["1.00", "4.], ,"]})
    with FaultServer(faults=[Fault("text", text=junk, match=TITLES[0], times=2)]) as stub:
        _bench_two(papers, stub, tmp_path / "a")
    # A review stored before issue 19 kept its junk; today's validation would drop it, the
    # measurement must not.
    store = DigestStore(open_database(f"sqlite:///{tmp_path / 'a' / 'quality.db'}"))
    key = store.load_digest(date(2026, 3, 31))
    row = store.review("2603.00001", WorkKey(key.model, key.prompt_version, "abstract"))
    with store.session() as s, s.begin():
        s.get(type(row), row.id).review = row.review | {"strengths": ["1.00", "Clear aims"]}
    cfg = QualityBenchConfig(work_dir=str(tmp_path / "a"), measure_only=True)
    result = run_quality_bench(cfg, echo=lambda _: None)
    figures = result["figures"]
    assert figures["papers"] == 2 and figures["list_items_junk"] == 1
    # What the run cost, from the calls the store recorded (no loop: one summary each).
    calls = result["calls"]
    assert (calls["calls"], calls["summary_calls"], calls["review_calls"]) == (4, 2, 2)
    assert calls["prompt_tokens"] > 0 and calls["completion_tokens"] > 0
    assert result["prompt_version"] == PROMPT_VERSION
    alone = QualityBenchConfig(work_dir=str(tmp_path / "missing"), measure_only=True)
    with pytest.raises(ValueError, match="is not there"):
        run_quality_bench(alone, echo=lambda _: None)


def test_a_full_text_summary_is_checked_against_the_full_text(tmp_path, db_url):
    """Issue 19: the check read the abstract even for a summary made from the full text, so a
    fact from the full text was marked unverified. It reads the text the model was given: the
    full text as truncated for the prompt (a fact past the cut is not in it)."""
    from tests.digest.sources.scripted_server import Reply, ScriptedServer

    filler = "The method is described in detail below. " * 10
    html = (
        "<html><body><article><p>Our model reaches 87.5% on SuperGLUE.</p>"
        f"<p>{filler}</p><p>Later sections compare it with GPT-7.</p></article></body></html>"
    )
    faults = [
        Fault("text", text="It reaches 87.5% on SuperGLUE.", match=TITLES[0]),
        Fault("text", text="It reaches 87.5% on SuperGLUE and beats GPT-7.", match=TITLES[1]),
    ]
    with ScriptedServer() as arxiv, FaultServer(faults=faults) as stub:
        arxiv.script(*[Reply(html, content_type="text/html")] * 2)
        run = options(
            tmp_path,
            db_url,
            stub.base_url,
            source=str(write_papers(tmp_path / "two.jsonl", TITLES[:2])),
            input_mode="fulltext",
            arxiv_html_url=arxiv.url("/html"),
            max_input_chars=200,
        )
        report = run_digest(run)
    assert report.papers_done == 2
    assert report.unverified == [("2603.00002", ["GPT-7"])]
    digest = DigestStore(open_database(db_url)).load_digest(DAY)
    first, second = digest.entries
    assert first.input_basis == "fulltext" and "SuperGLUE" in first.source_text
    assert "SuperGLUE" not in first.paper.abstract and "GPT-7" not in second.source_text
    page = BeautifulSoup((tmp_path / "out" / f"digest-{DAY}.html").read_text(), "html.parser")
    assert page.find("article", id="2603.00001").find(class_="unverified") is None
    note = page.find("article", id="2603.00002").find("p", class_="unverified-note").get_text()
    assert "It names GPT-7, which the full text does not contain" in note
    markdown = (tmp_path / "out" / f"digest-{DAY}.md").read_text()
    assert markdown.count("(unverified)") == 1
    # The bench counts the same way, from the same store.
    assert measure(digest.entries, {}, {}).summaries_unfaithful == 1


def test_a_reviewer_summary_copying_the_title_is_not_published(tmp_path):
    """Found on 50 real papers: 10 reviews gave the paper's title (cut short with "…") as the
    reviewer's summary; the page showed it under "Reviewer's summary". It is stored empty and
    the page shows none; a store written before is counted."""
    papers = write_papers(tmp_path / "papers.jsonl", TITLES[2:4])
    titled = {"summary": f"{TITLES[2]}", "strengths": ["strengths ia", "Clear benchmark design"]}
    reply = json.dumps(review_for(TITLES[2]) | titled)

    def responder(body: dict) -> str:
        said = default_responder(body)
        return reply if said == json.dumps(review_for(TITLES[2])) else said

    with FaultServer(responder=responder) as stub:
        figures = _bench_two(papers, stub, tmp_path / "a")["figures"]
    assert figures["reviews"] == 2 and figures["review_summaries_title_or_none"] == 1
    assert figures["list_items_junk"] == 0  # "strengths ia" was dropped before storing
    store = DigestStore(open_database(f"sqlite:///{tmp_path / 'a' / 'quality.db'}"))
    first, second = store.load_digest(date(2026, 3, 31)).entries
    assert first.review.summary == "" and first.review.strengths == ["Clear benchmark design"]
    assert second.review.summary == review_for(TITLES[3])["summary"]
    page = BeautifulSoup(
        (tmp_path / "a" / "out" / "digest-2026-03-31.html").read_text(), "html.parser"
    )
    assert page.text.count("Reviewer's summary") == 1  # the second paper's only
    md = (tmp_path / "a" / "out" / "digest-2026-03-31.md").read_text()
    assert md.count("Reviewer's summary") == 1
