"""Ranking inside the digest run: with a reader profile, --max-papers takes the top of the
ranking and the model calls go to the best papers first; the papers below the cut are listed at
the bottom of the page, so that over a simulated fortnight of arXiv nights (the fake arXiv of
test_nightly_selection.py) every announced paper is still listed exactly once and none waits.
Without a profile nothing changes (test_nightly_selection.py, test_pipeline.py)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from datetime import date

from digest.pipeline import run_digest
from digest.profile import ReaderProfile, TaggedPaper
from digest.render import html_page, markdown_page
from digest.store.database import open_database
from digest.store.digest_store import DigestStore
from tests.digest.fault_server import FaultServer
from tests.digest.sources.announcing_arxiv import AnnouncingArxiv
from tests.digest.test_nightly_selection import _expected, _listings, _nights, _utc, fortnight
from tests.digest.test_pipeline import DAY, TITLES, options, write_papers

TOPIC = "speculative decoding with draft models for fast inference"
OTHER = "protein folding with graph networks"


def _profile() -> ReaderProfile:
    liked = [
        TaggedPaper("Faster speculative decoding", "Draft models propose tokens; fast inference."),
        TaggedPaper("Speculative decoding at scale", "Draft models verified in one pass."),
    ]
    return ReaderProfile(keywords=["speculative decoding"], tags={"liked": liked})


def test_ranked_nights_list_every_paper_once_and_summarise_the_top(tmp_path, db_url):
    papers = fortnight()
    for n, paper in enumerate(papers):
        paper.topic = TOPIC if n % 3 == 0 else OTHER
    topical = {p.arxiv_id for p in papers if p.topic == TOPIC}
    with AnnouncingArxiv(papers) as arxiv, FaultServer() as stub:
        runs = _nights(
            tmp_path, db_url, arxiv, stub, selection="new", max_papers=2, profile=_profile()
        )
    listed = _listings(db_url)
    # No paper lost, none twice: those below the cut are listed too, at the bottom.
    assert set(listed) == _expected(papers, runs[-1])
    assert [pid for pid, n in listed.items() if n > 1] == []
    store = DigestStore(open_database(db_url))
    # Nothing waits for a later night: the watermark is where it is without --max-papers.
    assert store.watermark("arxiv:cs.CL,cs.LG") == _utc(date(2026, 3, 10), 17)
    below_total = 0
    for day in store.digest_dates(None):
        items = store.items(day)
        status = Counter(item.status for item, _ in items)
        assert set(status) <= {"done", "below_cut"}, (day, status)
        assert status["done"] == min(2, len(items)), (day, status)
        # The summarised ones are the best ranked of the night: topical papers first.
        night_topical = [p.arxiv_id for _, p in items if p.arxiv_id in topical]
        done = {p.arxiv_id for item, p in items if item.status == "done"}
        assert set(night_topical[:2]) <= done, (day, night_topical, done)
        scores = [item.rank_score for item, _ in items]
        assert None not in scores and scores == sorted(scores, reverse=True)
        digest = store.load_digest(day)
        assert digest is not None
        assert {e.paper.arxiv_id for e in digest.for_you} == set(night_topical) & done
        page = (tmp_path / "out" / html_page.file_name(day)).read_text()
        for entry in digest.below_cut:
            below_total += 1
            assert f'<li id="{entry.paper.arxiv_id}">' in page
        if digest.below_cut:
            assert "Also new, not summarised" in page
        if digest.for_you:
            assert page.index('id="for-you"') < page.index('id="papers"')
            assert "For you: mentions “speculative decoding”" in page
    assert below_total > 0  # the cut did fall
    # A run's report counts them apart from failures.
    assert all(r.papers_failed == 0 for r in store.runs_for(store.digest_dates(1)[0]))


def test_model_calls_go_to_the_best_ranked_first_and_max_papers_takes_the_top(tmp_path, sqlite_url):
    titles = [*TITLES, "Speculative Decoding with Tiny Draft Models"]
    source = write_papers(tmp_path / "ranked.jsonl", titles)
    profile = ReaderProfile(keywords=["speculative decoding", "draft models"])
    profile.add_keywords(["long contexts"])
    with FaultServer() as stub:
        run = options(
            tmp_path,
            sqlite_url,
            stub.base_url,
            source=str(source),
            concurrency=1,
            max_papers=3,
            profile=profile,
        )
        report = run_digest(run)
        assert (report.status, report.exit_code) == ("succeeded", 0)
        assert (report.papers_done, report.papers_failed, report.papers_below_cut) == (3, 0, 2)
        assert "3 done, 0 failed, 2 below --max-papers" in "\n".join(report.lines())
        # One paper in flight at a time: the order of the calls is the ranking's.
        asked = [body["messages"][1]["content"] for body in stub.requests]
        assert "Speculative Decoding" in asked[0] and "Speculative Decoding" in asked[1]
        assert "Long Contexts" in asked[2] and "Long Contexts" in asked[3]
        assert len(asked) == 6
        # A rerun calls nothing and leaves the cut where it was.
        again = run_digest(run)
        assert (again.calls, again.papers_below_cut, again.status) == (0, 2, "succeeded")
        assert len(stub.requests) == 6
        # --redo summarises one paper from below the cut, on request.
        redo = run_digest(replace(run, redo=("2603.00004",)))
        assert (redo.calls, redo.papers_done, redo.papers_below_cut) == (2, 4, 1)
    store = DigestStore(open_database(sqlite_url))
    digest = store.load_digest(DAY)
    assert digest is not None
    assert [e.paper.title for e in digest.for_you] == [titles[4], titles[0]]
    assert [e.paper.arxiv_id for e in digest.rest] == ["2603.00002", "2603.00004"]
    assert [e.paper.arxiv_id for e in digest.below_cut] == ["2603.00003"]
    assert digest.failed == []
    markdown = (tmp_path / "out" / markdown_page.file_name(DAY)).read_text()
    assert markdown.index("## For you") < markdown.index("## Other papers")
    assert markdown.index("## Other papers") < markdown.index("## Also new, not summarised")
    assert "**For you:** mentions “speculative decoding”" in markdown


def test_a_backfill_with_a_profile_fills_the_cut_once(tmp_path, sqlite_url):
    """--max-papers counts what the date already lists: a second run with more papers in the
    source adds them below the cut once the date has its N."""
    with FaultServer() as stub:
        first = options(
            tmp_path,
            sqlite_url,
            stub.base_url,
            source=str(write_papers(tmp_path / "a.jsonl", TITLES[:2])),
            max_papers=3,
            profile=ReaderProfile(keywords=["benchmark"]),
        )
        assert run_digest(first).papers_done == 2
        more = write_papers(tmp_path / "b.jsonl", TITLES, first=1)
        second = run_digest(
            options(
                tmp_path,
                sqlite_url,
                stub.base_url,
                source=str(more),
                max_papers=3,
                profile=ReaderProfile(keywords=["benchmark"]),
            )
        )
    assert (second.papers_done, second.papers_below_cut) == (3, 1)
    store = DigestStore(open_database(sqlite_url))
    status = {p.arxiv_id: item.status for item, p in store.items(DAY)}
    # Of the two new papers, the benchmark one (ranked first) takes the last place.
    assert status == {
        "2603.00001": "done",
        "2603.00002": "done",
        "2603.00003": "done",
        "2603.00004": "below_cut",
    }


def test_each_run_reads_the_profile_file_again(tmp_path, sqlite_url):
    """`digest schedule` keeps its options for weeks: each night reads the profile file again,
    so a change counts from the next night; a broken file keeps the profile read at start; a
    removed one means no ranking."""
    from datetime import timedelta

    from digest.profile import save_profile

    path = tmp_path / "profile.json"
    save_profile(path, ReaderProfile(keywords=["benchmark"]))
    store = DigestStore(open_database(sqlite_url))

    def night(day: date) -> list[str]:
        run_digest(
            options(
                tmp_path,
                sqlite_url,
                stub.base_url,
                digest_date=day,
                profile=ReaderProfile(keywords=["scaling laws"]),  # as read at start
                profile_path=path,
            )
        )
        digest = store.load_digest(day)
        assert digest is not None
        return [e.paper.title for e in digest.for_you]

    with FaultServer() as stub:
        assert night(DAY) == [TITLES[2]]  # the file, not the profile read at start
        save_profile(path, ReaderProfile(keywords=["tokenizer-free"]))
        assert night(DAY + timedelta(days=1)) == [TITLES[3]]
        path.write_text("{broken")
        assert night(DAY + timedelta(days=2)) == [TITLES[1]]
        path.unlink()
        assert night(DAY + timedelta(days=3)) == []
    unranked = store.items(DAY + timedelta(days=3))
    assert [item.rank_score for item, _ in unranked] == [None] * 4


def test_liked_papers_are_not_negatives_of_their_own_tag(tmp_path, sqlite_url, monkeypatch):
    """A liked paper comes from the store, whose recent papers are the classifiers' background
    (negatives): it must be left out of it, and tonight's papers too (they are ranked)."""
    import digest.pipeline as pipeline

    seen: list[list[str]] = []
    real = pipeline.rank_papers

    def spy(papers, profile, background, embed):
        seen.append(background)
        return real(papers, profile, background, embed)

    monkeypatch.setattr(pipeline, "rank_papers", spy)
    with FaultServer() as stub:
        first = options(tmp_path, sqlite_url, stub.base_url)
        run_digest(first)  # stores 2603.00001-4 without a profile
        store = DigestStore(open_database(sqlite_url))
        liked = store.papers(["2603.00002"])["2603.00002"]
        profile = ReaderProfile(
            tags={"liked": [TaggedPaper(liked.title, liked.abstract, "2603.00002")]}
        )
        later = write_papers(tmp_path / "later.jsonl", ["Tokenizer-free models, again"], first=9)
        run_digest(
            options(
                tmp_path,
                sqlite_url,
                stub.base_url,
                digest_date=date(2026, 3, 11),
                source=str(later),
                profile=profile,
            )
        )
    (background,) = seen
    titles = {text.split(". ")[0] for text in background}
    assert titles == {TITLES[0], TITLES[2], TITLES[3]}  # not the liked one, not tonight's


def test_papers_published_before_neither_take_the_cut_nor_fall_below_it(tmp_path, sqlite_url):
    """Found from outside: with a profile and --max-papers, papers an earlier night already
    summarised used up the N places (though they cost no model call), and those ranked below
    the cut were listed "not summarised" without their summary."""
    earlier = DAY.replace(day=DAY.day - 1)
    with FaultServer() as stub:
        old = write_papers(tmp_path / "old.jsonl", TITLES[:2])
        run_digest(
            options(tmp_path, sqlite_url, stub.base_url, source=str(old), digest_date=earlier)
        )
        assert len(stub.requests) == 4
        titles = [*TITLES, "Speculative Decoding with Tiny Draft Models"]
        night = options(
            tmp_path,
            sqlite_url,
            stub.base_url,
            source=str(write_papers(tmp_path / "all.jsonl", titles)),
            max_papers=2,
            profile=_profile(),
        )
        report = run_digest(night)
        assert len(stub.requests) == 4 + 4  # two new papers summarised and reviewed
    assert (report.papers_done, report.papers_below_cut) == (4, 1)
    digest = DigestStore(open_database(sqlite_url)).load_digest(DAY)
    again = {e.paper.arxiv_id: e for e in digest.entries if e.also_in == earlier}
    assert sorted(again) == ["2603.00001", "2603.00002"]
    assert all(e.status == "done" and e.summary for e in again.values())
    # The cut falls among the new papers: the speculative-decoding one is in.
    assert "2603.00005" not in {e.paper.arxiv_id for e in digest.below_cut}
    assert len(digest.below_cut) == 1
