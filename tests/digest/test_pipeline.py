"""The digest run end to end: a local paper file in, a fault-injecting OpenAI-compatible stub (or
our real server with a tiny model) for the model, SQLite and PostgreSQL for the store."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import date, timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select

from digest.pipeline import RunOptions, run_digest
from digest.prompts import SUMMARY_TASK, SYSTEM
from digest.sources.polite_http import PoliteHttpConfig
from digest.store.database import open_database
from digest.store.digest_store import DigestStore
from digest.store.schema import ModelCallRow, ReviewRow, SummaryRow
from tests.digest.fault_server import Fault, FaultServer

DAY = date(2026, 3, 10)
TITLES = [
    "Sparse Attention for <script>alert(1)</script> Long Contexts",
    "Scaling Laws for $\\alpha$-Divergence Training",
    "A Benchmark for Paper Reviewing Agents",
    "Tokenizer-Free Language Models",
]


def write_papers(path: Path, titles: list[str] = TITLES, first: int = 1) -> Path:
    """A JSONL source of papers 2603.{first:05d}, ... with these titles."""
    with path.open("w") as f:
        for n, title in enumerate(titles, first):
            paper = {
                "id": f"2603.{n:05d}v1",
                "title": title,
                "abstract": f"We study {title.lower()}. Our method improves $x^2 < y$ by 3%.",
                "authors": ["Ada Lovelace", "Alan Turing"],
                "categories": ["cs.CL", "cs.LG"],
            }
            f.write(json.dumps(paper) + "\n")
    return path


def options(tmp_path: Path, db_url: str, base_url: str, **overrides) -> RunOptions:
    fields = dict(
        digest_date=DAY,
        out_dir=tmp_path / "out",
        source=str(write_papers(tmp_path / "papers.jsonl")),
        endpoint=base_url,
        model="stub-model",
        concurrency=2,
        db_url=db_url,
        http=PoliteHttpConfig(min_interval_s=0.0, max_retries=1, backoff_s=0.01),
        chat_retries=2,
        chat_backoff_s=0.01,
        chat_read_timeout_s=5.0,
    )
    fields.update(overrides)
    return RunOptions(**fields)


def count(db_url: str, table) -> int:
    with open_database(db_url).connect() as conn:
        return conn.execute(select(func.count()).select_from(table)).scalar_one()


def test_run_stores_everything_then_a_rerun_calls_nothing(tmp_path, db_url):
    with FaultServer() as stub:
        first = run_digest(options(tmp_path, db_url, stub.base_url))
        assert (first.status, first.exit_code) == ("succeeded", 0)
        assert (first.papers_total, first.papers_done, first.calls) == (4, 4, 8)
        assert len(stub.requests) == 8
        # Summary and review of a paper share the system text and the paper; the task is last.
        by_title: dict[str, list[str]] = {}
        for body in stub.requests:
            assert body["messages"][0] == {"role": "system", "content": SYSTEM}
            user = body["messages"][1]["content"]
            by_title.setdefault(user.split("\n")[0], []).append(user)
        for summary, review in (sorted(v, key=len) for v in by_title.values()):
            prefix = summary[: summary.index(SUMMARY_TASK)]
            assert review.startswith(prefix) and len(prefix) > 100
        assert all(b["stream"] and b["temperature"] == 0.0 for b in stub.requests)
        reviews = [b for b in stub.requests if "response_format" in b]
        assert len(reviews) == 4
        assert all(b["frequency_penalty"] == 0.5 for b in reviews)
        summaries = [b for b in stub.requests if b not in reviews]
        assert all(b["frequency_penalty"] == 0.3 for b in summaries)  # issue 19: loops

        html_before = (tmp_path / "out" / f"digest-{DAY}.html").read_bytes()
        second = run_digest(options(tmp_path, db_url, stub.base_url))
        assert len(stub.requests) == 8, "a rerun must not call the model again"
        assert (second.status, second.calls, second.papers_done) == ("succeeded", 0, 4)

    assert count(db_url, SummaryRow) == 4 and count(db_url, ReviewRow) == 4
    assert count(db_url, ModelCallRow) == 8
    store = DigestStore(open_database(db_url))
    calls = store.calls()
    assert {c.kind for c in calls} == {"summary", "review"}
    for call in calls:
        assert call.status == "ok" and call.attempts == 1 and call.model == "stub-model"
        assert call.prompt_tokens > 50 and call.completion_tokens > 5
        assert call.ttft_s is not None and 0 <= call.ttft_s <= call.latency_s
        assert call.endpoint == stub.base_url and call.prompt_version
    digest = store.load_digest(DAY)
    assert [e.paper.title for e in digest.entries] == TITLES
    assert all(e.review is not None and e.review_parse_status == "ok" for e in digest.entries)
    assert all(e.summary.count(".") == 3 for e in digest.entries)
    html = (tmp_path / "out" / f"digest-{DAY}.html").read_bytes()
    assert b"<script>alert(1)</script>" not in html
    # The pages depend only on stored data: the rerun rewrote them identically.
    assert html.replace(b"\n", b"") != b"" and _without_times(html) == _without_times(html_before)


def _without_times(page: bytes) -> bytes:
    import re

    return re.sub(rb"\d{4}-\d\d-\d\d[ T]\d\d:\d\d(:\d\d)?(\.\d+)?(\+00:00|Z| UTC)?", b"T", page)


def test_a_failing_paper_is_marked_and_the_rerun_finishes_it(tmp_path, db_url):
    broken = TITLES[2]
    with FaultServer(faults=[Fault("status", status=500, match=broken, times=-1)]) as stub:
        report = run_digest(options(tmp_path, db_url, stub.base_url))
        assert (report.status, report.exit_code) == ("partial", 3)
        assert (report.papers_done, report.papers_failed) == (3, 1)
        assert report.failed[0][0] == "2603.00003" and "500" in report.failed[0][1]
        attempts = [b for b in stub.requests if broken in json.dumps(b)]
        assert len(attempts) == 3  # first try + 2 retries, then the paper is given up
    store = DigestStore(open_database(db_url))
    errors = [c for c in store.calls() if c.status == "error"]
    assert len(errors) == 1 and errors[0].attempts == 3 and "500" in errors[0].error
    html = (tmp_path / "out" / f"digest-{DAY}.html").read_text()
    assert "Not processed" in html and "2603.00003" in html

    with FaultServer() as healthy:
        again = run_digest(options(tmp_path, db_url, healthy.base_url))
        assert len(healthy.requests) == 2  # only the failed paper's summary and review
    assert (again.status, again.papers_done, again.exit_code) == ("succeeded", 4, 0)
    assert [r.status for r in store.runs_for(DAY)] == ["partial", "succeeded"]


def test_an_unparsed_review_fails_the_paper_and_a_rerun_asks_again(tmp_path, db_url):
    faults = [Fault("invalid_review", match=TITLES[1], times=-1)]
    with FaultServer(faults=faults) as stub:
        report = run_digest(options(tmp_path, db_url, stub.base_url))
    assert (report.status, report.exit_code) == ("partial", 3)
    assert report.failed[0][0] == "2603.00002" and "review unparsed" in report.failed[0][1]
    store = DigestStore(open_database(db_url))
    entry = store.load_digest(DAY).entries[1]
    assert entry.status == "failed" and entry.review is None
    assert entry.review_parse_status == "failed"
    assert "cannot produce a structured review" in entry.review_raw  # kept for reading
    html = (tmp_path / "out" / f"digest-{DAY}.html").read_text()
    # Listed under "Not processed"; the raw reply is for the operator, not the public page.
    assert html.index("Not processed") < html.index('<article id="2603.00002"')
    assert "<pre>" not in html and "unparsed" not in html

    with FaultServer() as healthy:
        again = run_digest(options(tmp_path, db_url, healthy.base_url))
        # Only the review is asked for again: the summary stands.
        (request,) = healthy.requests
        assert TITLES[1] in request["messages"][1]["content"] and "response_format" in request
    assert (again.status, again.exit_code, again.papers_done) == ("succeeded", 0, 4)
    entry = store.load_digest(DAY).entries[1]
    assert entry.status == "done" and entry.review_parse_status == "ok"
    assert count(db_url, ReviewRow) == 4  # the unparsed reply was replaced, not duplicated


def test_redo_asks_again_for_one_paper(tmp_path, db_url):
    with FaultServer() as stub:
        run_digest(options(tmp_path, db_url, stub.base_url))
    before = {s.paper_id: s.run_id for s in _rows(db_url, SummaryRow)}
    with FaultServer() as stub:
        report = run_digest(options(tmp_path, db_url, stub.base_url, redo=("2603.00003",)))
        asked = [b for b in stub.requests if TITLES[2] in json.dumps(b)]
        assert len(stub.requests) == len(asked) == 2  # its summary and review, nothing else
    assert (report.status, report.papers_done) == ("succeeded", 4)
    after = {s.paper_id: s.run_id for s in _rows(db_url, SummaryRow)}
    assert after["2603.00003"] == report.run_id != before["2603.00003"]
    assert {k: v for k, v in after.items() if k != "2603.00003"} == {
        k: v for k, v in before.items() if k != "2603.00003"
    }
    assert count(db_url, SummaryRow) == count(db_url, ReviewRow) == 4

    from digest.pipeline import RedoError

    with pytest.raises(RedoError, match="2603.99999"):
        run_digest(options(tmp_path, db_url, "http://127.0.0.1:9/v1", redo=("2603.99999",)))


def _rows(db_url: str, table) -> list:
    with open_database(db_url).connect() as conn:
        return list(conn.execute(select(table)))


def test_retry_log_lines_name_the_paper_and_the_call(tmp_path, sqlite_url, caplog):
    faults = [
        Fault("status", status=503, match=TITLES[2], times=1),
        Fault("reject_response_format", times=1),
    ]
    with FaultServer(faults=faults) as stub:
        report = run_digest(options(tmp_path, sqlite_url, stub.base_url, concurrency=1))
    assert report.status == "succeeded"
    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == 1 and retries[0].startswith("2603.00003 summary: attempt 1 failed")
    assert "HTTP 503" in retries[0]
    (rejected,) = [r.getMessage() for r in caplog.records if "response_format" in r.getMessage()]
    assert rejected.startswith("2603.00001 review: server rejected response_format")


def test_server_without_json_schema_gets_plain_requests(tmp_path, sqlite_url):
    with FaultServer(faults=[Fault("reject_response_format", times=-1)]) as stub:
        report = run_digest(options(tmp_path, sqlite_url, stub.base_url, concurrency=1))
        # One rejected request teaches the client; later reviews go without response_format.
        with_format = [b for b in stub.requests if "response_format" in b]
        assert len(with_format) == 1
    assert report.papers_done == 4
    digest = DigestStore(open_database(sqlite_url)).load_digest(DAY)
    assert all(e.review is not None for e in digest.entries)


def test_bad_endpoint_options_fail_before_any_work(tmp_path, sqlite_url):
    from digest.endpoint import EndpointError

    with pytest.raises(EndpointError, match="--model is required"):
        run_digest(options(tmp_path, sqlite_url, "http://127.0.0.1:9/v1", model=None))
    with pytest.raises(EndpointError, match="OPENAI_KEY_FOR_TEST"):
        run_digest(
            options(
                tmp_path, sqlite_url, "http://127.0.0.1:9/v1", api_key_env="OPENAI_KEY_FOR_TEST"
            )
        )


def test_an_empty_summary_fails_the_paper_not_the_run(tmp_path, sqlite_url):
    faults = [Fault("text", text="   ", match=TITLES[0], times=1)]
    with FaultServer(faults=faults) as stub:
        report = run_digest(options(tmp_path, sqlite_url, stub.base_url))
    assert (report.papers_done, report.papers_failed) == (3, 1)
    assert report.failed == [("2603.00001", "the model returned an empty summary")]


def test_arxiv_source_and_full_text_with_abstract_fallback(tmp_path, sqlite_url):
    from tests.digest.sources.scripted_server import Reply, ScriptedServer

    fixtures = Path(__file__).parent / "sources" / "fixtures"
    atom = (fixtures / "arxiv_api_current_m5.atom.xml").read_bytes()
    html = (fixtures / "arxiv_html_2401.01234v2.html").read_text()
    with ScriptedServer() as arxiv, FaultServer() as stub:
        # The listing, then one HTML page per paper in listing order: the first two have one,
        # the others answer 404 and fall back to their abstract.
        arxiv.script(
            Reply(atom),
            Reply(html, content_type="text/html"),
            Reply(html, content_type="text/html"),
            *[Reply(b"", 404)] * 3,
        )
        run = options(
            tmp_path,
            sqlite_url,
            stub.base_url,
            source="arxiv",
            input_mode="fulltext",
            categories=["cs.CL"],
            arxiv_api_url=arxiv.url("/api/query"),
            arxiv_html_url=arxiv.url("/html"),
            max_input_chars=200,
        )
        report = run_digest(run)
        paths = [r.path for r in arxiv.received]
        prompts = [b["messages"][1]["content"] for b in stub.requests]
    assert report.papers_done == 5 and report.calls == 10
    assert paths[0] == "/api/query" and paths[1] == "/html/2202.12139v1"
    assert paths[5] == "/html/hep-ph/0301050v2"
    digest = DigestStore(open_database(sqlite_url)).load_digest(DAY)
    assert [e.input_basis for e in digest.entries] == ["fulltext"] * 2 + ["abstract"] * 3
    assert all(e.review.input_basis == e.input_basis for e in digest.entries)
    # The full text, cut where the budget ends (a mark, not words), for 2 papers' summary and
    # review; the abstract for the other 3.
    assert sum("\n[…]\n\n" in p for p in prompts) == 4
    abstracts = [e.paper.abstract for e in digest.entries[2:]]
    assert sum(any(f"\n\n{a}\n\n" in p for a in abstracts) for p in prompts) == 6
    # A rerun reads the stored text: arXiv is asked only for the listing.
    with ScriptedServer() as arxiv, FaultServer() as stub:
        arxiv.script(Reply(atom))
        run.arxiv_api_url, run.arxiv_html_url = arxiv.url("/api/query"), arxiv.url("/html")
        run.endpoint = stub.base_url
        again = run_digest(run)
        assert len(arxiv.received) == 1 and stub.requests == []
    assert again.papers_done == 5


def test_endpoint_down_all_night_fails_the_run_but_publishes_the_list(tmp_path, sqlite_url):
    with FaultServer(faults=[Fault("status", status=502, times=-1)]) as stub:
        report = run_digest(options(tmp_path, sqlite_url, stub.base_url))
    assert (report.status, report.exit_code, report.papers_failed) == ("failed", 1, 4)
    html = (tmp_path / "out" / f"digest-{DAY}.html").read_text()
    assert all(f"2603.0000{n}" in html for n in range(1, 5))


def test_a_day_without_papers_publishes_an_empty_digest(tmp_path, sqlite_url):
    # A --categories filter that matches none of the file's papers is a quiet night; an empty
    # file is a bad file (tests/digest/test_cli.py).
    papers = write_papers(tmp_path / "papers.jsonl")
    with FaultServer() as stub:
        opts = options(tmp_path, sqlite_url, stub.base_url, source=str(papers))
        opts.categories = ["q-bio.NC"]
        report = run_digest(opts)
        assert stub.requests == []
    assert (report.status, report.papers_total, report.exit_code) == ("succeeded", 0, 0)
    assert (tmp_path / "out" / f"digest-{DAY}.html").exists()


def test_full_text_is_cut_to_fit_the_servers_context(tmp_path, sqlite_url):
    from digest.pipeline import CHARS_PER_TOKEN, PROMPT_OVERHEAD_TOKENS
    from digest.prompts import REVIEW_MAX_TOKENS
    from digest.store.schema import FullTextRow
    from tests.digest.sources.scripted_server import Reply, ScriptedServer

    paragraph = "Attention layers read the cache. " * 8
    html = "<html><body><article>" + f"<p>{paragraph}</p>" * 40 + "</article></body></html>"
    papers = write_papers(tmp_path / "one.jsonl", TITLES[:1])
    with ScriptedServer() as arxiv, FaultServer(model="stub-model", max_model_len=1800) as stub:
        arxiv.script(Reply(html, content_type="text/html"))
        run = options(
            tmp_path,
            sqlite_url,
            stub.base_url,
            source=str(papers),
            input_mode="fulltext",
            arxiv_html_url=arxiv.url("/html"),
        )
        assert run_digest(run).papers_done == 1
    room = (1800 - REVIEW_MAX_TOKENS - PROMPT_OVERHEAD_TOKENS) * CHARS_PER_TOKEN
    with DigestStore(open_database(sqlite_url)).session() as s:
        (row,) = s.query(FullTextRow).all()
    assert row.truncated and row.original_chars > 10_000 and room - 300 < len(row.text) <= room


def test_max_papers_on_a_file_moves_on_past_published_papers(tmp_path, db_url):
    """Found from outside: with a file source, --max-papers N took the file's first N papers
    although an earlier night had published them (no model call, the same N every night; with
    --republished skip, an empty digest while the rest of the file waited forever)."""
    first_day, second_day, third_day = DAY, DAY + timedelta(days=1), DAY + timedelta(days=2)
    more = [*TITLES, "Sparse Mixtures of Experts", "Retrieval for Long Documents"]
    with FaultServer() as stub:
        old = write_papers(tmp_path / "old.jsonl", TITLES[:3])
        run_digest(options(tmp_path, db_url, stub.base_url, source=str(old)))
        source = str(write_papers(tmp_path / "all.jsonl", more))
        night = options(tmp_path, db_url, stub.base_url, source=source, max_papers=2)
        second = run_digest(replace(night, digest_date=second_day))
        assert (second.calls, second.papers_done) == (4, 5)  # 3 published (marked) + 2 new
        assert run_digest(replace(night, digest_date=second_day)).calls == 0  # a rerun: same
        third = run_digest(replace(night, digest_date=third_day, republished="skip"))
        assert (third.calls, third.papers_done) == (2, 1)  # the last new one
    store = DigestStore(open_database(db_url))
    listed = {day: [p.arxiv_id for _, p in store.items(day)] for day in (second_day, third_day)}
    assert listed[second_day] == [f"2603.{n:05d}" for n in range(1, 6)]
    assert listed[third_day] == ["2603.00006"]
    digest = store.load_digest(second_day)
    assert [e.also_in for e in digest.entries[:3]] == [first_day] * 3
