"""What the feed announces, from real runs: only pages that exist, only digests that reviewed a
paper, and nothing new when a rerun changed nothing."""

from __future__ import annotations

import shutil
import time
import xml.etree.ElementTree as ET
from datetime import timedelta
from pathlib import Path

from typer.testing import CliRunner

from digest.pipeline import run_digest
from nightshift.cli import app
from tests.digest.fault_server import Fault, FaultServer
from tests.digest.test_pipeline import DAY, TITLES, options, write_papers

ATOM = "{http://www.w3.org/2005/Atom}"
runner = CliRunner()


def feed_entries(out: Path) -> list[tuple[str, str]]:
    """(title, link) of each feed entry; every link must name a file in `out`."""
    root = ET.parse(out / "feed.xml").getroot()
    entries = []
    for entry in root.findall(f"{ATOM}entry"):
        link = entry.find(f"{ATOM}link").get("href")
        assert (out / link).is_file(), f"the feed links {link}, which does not exist"
        entries.append((entry.find(f"{ATOM}title").text, link))
    return entries


def test_render_restores_every_date_and_the_feed_links_only_pages_that_exist(tmp_path, db_url):
    out = tmp_path / "out"
    with FaultServer() as stub:
        for day in (DAY - timedelta(days=1), DAY):
            run_digest(options(tmp_path, db_url, stub.base_url, digest_date=day))
    assert len(feed_entries(out)) == 2
    shutil.rmtree(out)  # the output folder is lost; the database is not

    render = ["digest", "render", "--db", db_url, "--out", str(out)]
    result = runner.invoke(app, [*render, "--date", DAY.isoformat()])
    assert result.exit_code == 0, result.output
    assert [link for _, link in feed_entries(out)] == [f"digest-{DAY}.html"]

    result = runner.invoke(app, [*render, "--all"])
    assert result.exit_code == 0, result.output
    days = [DAY, DAY - timedelta(days=1)]
    assert [link for _, link in feed_entries(out)] == [f"digest-{d}.html" for d in days]
    assert all((out / f"digest-{d}.md").is_file() for d in days)
    index = (out / "index.html").read_text()
    assert all(f'href="digest-{d}.html"' in index for d in days)

    both = runner.invoke(app, [*render, "--all", "--date", DAY.isoformat()])
    assert both.exit_code == 2 and "exclude each other" in both.output


def test_a_night_with_the_endpoint_down_is_not_announced(tmp_path, db_url):
    out = tmp_path / "out"
    before = DAY - timedelta(days=1)
    with FaultServer() as stub:
        run_digest(options(tmp_path, db_url, stub.base_url, digest_date=before))
    others = str(write_papers(tmp_path / "others.jsonl", ["Another paper"], first=100))
    down = run_digest(
        options(tmp_path, db_url, "http://127.0.0.1:9/v1", chat_retries=0, source=others)
    )
    assert (down.status, down.papers_done) == ("failed", 0)
    assert (out / f"digest-{DAY}.html").is_file()  # the page lists what failed
    assert feed_entries(out) == [("Paper digest 2026-03-09: 4 papers", f"digest-{before}.html")]


def test_a_paper_published_earlier_is_marked_or_skipped(tmp_path, db_url):
    out = tmp_path / "out"
    before = DAY - timedelta(days=1)
    # The second night's source repeats two papers of the first (a replacement, a cross-list).
    first = write_papers(tmp_path / "first.jsonl", ["Old one", "Old two"], first=1)
    second = tmp_path / "second.jsonl"
    second.write_text(
        first.read_text() + write_papers(tmp_path / "new.jsonl", ["New one"], 3).read_text()
    )
    with FaultServer() as stub:
        run_digest(options(tmp_path, db_url, stub.base_url, digest_date=before, source=str(first)))
        calls = len(stub.requests)
        run_digest(options(tmp_path, db_url, stub.base_url, source=str(second)))
        assert len(stub.requests) - calls == 2  # only the new paper: the others' results stand
    html = (out / f"digest-{DAY}.html").read_text()
    link = f'Also in the <a href="digest-{before}.html#2603.00001">digest of {before}</a>.'
    assert link in html and html.count("Also in the") == 2
    assert (
        f"Also in the [digest of {before}](digest-{before}.md)."
        in (out / f"digest-{DAY}.md").read_text()
    )
    assert f"also in {before}" in (out / "feed.xml").read_text()
    assert "Also in the" not in (out / f"digest-{before}.html").read_text()

    later = DAY + timedelta(days=1)
    third = tmp_path / "third.jsonl"
    third.write_text(
        second.read_text() + write_papers(tmp_path / "newest.jsonl", ["Newest"], 4).read_text()
    )
    with FaultServer() as stub:
        run = options(tmp_path, db_url, stub.base_url, digest_date=later, source=str(third))
        run.republished = "skip"
        report = run_digest(run)
        assert len(stub.requests) == 2
    # The three published before are left out; the new one is listed, unmarked.
    assert (report.papers_total, report.papers_done) == (1, 1)
    page = (out / f"digest-{later}.html").read_text()
    assert "Newest" in page and "Old one" not in page and "Also in the" not in page


def test_a_rerun_that_changes_nothing_leaves_the_feed_as_it_was(tmp_path, db_url):
    out = tmp_path / "out"
    faults = [Fault("status", status=400, match=TITLES[0], times=1)]  # one paper fails once
    with FaultServer(faults=faults) as stub:
        run_digest(options(tmp_path, db_url, stub.base_url))
        partial = {name: (out / name).read_bytes() for name in ("feed.xml", f"digest-{DAY}.html")}
        time.sleep(1.1)  # the feed's times have whole seconds
        fixed = run_digest(options(tmp_path, db_url, stub.base_url))  # retries the failed one
        assert fixed.status == "succeeded"
        done = {name: (out / name).read_bytes() for name in partial}
        assert done["feed.xml"] != partial["feed.xml"]  # a change is news: a later `updated`
        time.sleep(1.1)
        again = run_digest(options(tmp_path, db_url, stub.base_url))
        assert again.calls == 0
    assert {name: (out / name).read_bytes() for name in partial} == done
    result = runner.invoke(app, ["digest", "render", "--db", db_url, "--out", str(out)])
    assert result.exit_code == 0
    assert {name: (out / name).read_bytes() for name in partial} == done
