"""A small digest store filled by the test, and a real `nightshift digest serve` on a free
loopback port over it (the web view tests drive it with httpx and headless Chromium)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from digest.paper import Paper
from digest.review import Review
from digest.store import migrate
from digest.store.database import open_database
from digest.store.digest_store import DigestStore, WorkKey

MONDAY, TUESDAY = date(2026, 3, 9), date(2026, 3, 10)
KEY = WorkKey("m", "p1", "abstract")
NIGHTSHIFT = Path(sys.executable).with_name("nightshift")
_URL_RE = re.compile(r"digest web view on (http://\S+/)")

PAPERS = {
    MONDAY: [
        Paper(
            "2603.00001",
            "Sparse attention for long contexts",
            "We prune attention heads in transformers.",
            ["Ada Lovelace"],
            ["cs.CL"],
        ),
        Paper(
            "2603.00002",
            "Tokenisers for <b>code</b> & math",
            "Byte-level models read $x^2$ as typed.",
            ["Alan Turing"],
            ["cs.LG"],
        ),
    ],
    TUESDAY: [
        Paper(
            "2603.00003",
            "Retrieval over knowledge graphs",
            "A graph index for retrieval-augmented generation.",
            ["Grace Hopper"],
            ["cs.IR", "cs.CL"],
        ),
    ],
}


def fill_store(url: str) -> DigestStore:
    """Two digests: Monday (two papers, one "for you"), Tuesday (one), each paper with a
    summary and a review."""
    engine = open_database(url)
    migrate.upgrade(engine)
    store = DigestStore(engine)
    for day, papers in PAPERS.items():
        store.upsert_papers(papers)
        # A reader profile picked Monday's first paper ("for you").
        ranking = {"2603.00001": (3.0, ['mentions "attention"'])} if day == MONDAY else None
        store.add_items(day, papers, "abstract", ranking=ranking)
        run_id = store.start_run(day, {}, "m", "local", "p1")
        for paper in papers:
            store.save_summary(paper, KEY, f"The summary of {paper.arxiv_id}.", run_id)
            review = Review(
                summary="The reviewer's view.",
                strengths=[f"a careful ablation in {paper.arxiv_id}"],
                weaknesses=["few baselines"],
                questions=[],
                limitations=[],
                overall=6,
                confidence=3,
                decision="Accept",
                input_basis="abstract",
            )
            store.save_review(paper, KEY, review, "ok", "{}", None, run_id)
            store.set_item(day, paper.arxiv_id, "done", run_id, None)
        store.finish_run(run_id, "succeeded", content_hash=f"hash-{day}")
    return store


@dataclass(slots=True)
class ServeProcess:
    proc: subprocess.Popen
    url: str


@contextmanager
def digest_serve(db_url: str, *extra: str) -> Iterator[ServeProcess]:
    """`nightshift digest serve --port 0` (it binds first, then prints the address it serves)."""
    proc = subprocess.Popen(
        [str(NIGHTSHIFT), "digest", "serve", "--port", "0", "--db", db_url, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        match = _URL_RE.search(line)
        if match is None:
            proc.kill()
            raise AssertionError(f"digest serve did not start: {line!r} {proc.stderr.read()!r}")
        yield ServeProcess(proc, match.group(1))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_exit(proc: subprocess.Popen, seconds: float = 10.0) -> int:
    deadline = time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc.wait(0.1)
