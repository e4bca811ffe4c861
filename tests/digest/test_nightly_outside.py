"""The nightly digest tried from outside, as its operator runs it: the real command line in a
child process against a fake arXiv and a stub model server on loopback, killed with SIGKILL
mid-run, then the next night. (Defects found that way, kept as tests.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, date, datetime, timedelta
from datetime import time as clock
from pathlib import Path

from sqlalchemy import select

from digest.store.database import open_database
from digest.store.schema import DigestItemRow
from tests.digest.fault_server import FaultServer
from tests.digest.sources.announcing_arxiv import AnnouncingArxiv, FakePaper, Version

ROOT = Path(__file__).resolve().parents[2]

# `nightshift digest run` with the clock's "yesterday" pinned to argv[1], so that two nights can
# run one after the other.
NIGHT = """
import sys
from datetime import date
from nightshift import digest_commands
night = date.fromisoformat(sys.argv.pop(1))
real = digest_commands._digest_date
digest_commands._digest_date = lambda value, source: night if value is None else real(value, source)
from nightshift.cli import run
sys.argv[0] = "nightshift"
run()
"""


def _night(
    day: date, arxiv: AnnouncingArxiv, stub: FaultServer, db_url: str, out: Path
) -> subprocess.Popen:
    env = dict(os.environ, NIGHTSHIFT_ARXIV_API_URL=arxiv.url(), NIGHTSHIFT_HOME=str(out.parent))
    command = [sys.executable, "-c", NIGHT, day.isoformat(), "-v", "digest", "run"]
    command += ["--categories", "cs.CL", "--db", db_url, "--out", str(out)]
    command += ["--endpoint", stub.base_url, "--model", "stub-model"]
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _items(db_url: str) -> list[tuple[str, date, str]]:
    with open_database(db_url).connect() as conn:
        rows = conn.execute(
            select(DigestItemRow.paper_id, DigestItemRow.digest_date, DigestItemRow.status)
        )
        return [tuple(row) for row in rows]


def test_a_night_killed_mid_run_is_published_by_the_next_night(tmp_path, db_url):
    """kill -9 during the model calls, after the night listed its papers (and moved the
    watermark): the next night used to skip those papers as "already in other digests" and
    they stayed pending under a date with no page, for ever, while the log said it was
    "resuming their work". The next night now publishes them, each once."""
    today = datetime.now(UTC).date()
    killed_night, next_night = today - timedelta(days=2), today - timedelta(days=1)
    at = datetime.combine(killed_night, clock(1), tzinfo=UTC)
    papers = [
        FakePaper(f"2612.0010{n}", ["cs.CL"], [Version(at + timedelta(minutes=n), at)])
        for n in range(3)
    ]
    out = tmp_path / "digests"
    with AnnouncingArxiv(papers) as arxiv, FaultServer() as stub:
        arxiv.now = datetime.now(UTC)
        stub.add_fault("hang", times=-1, delay_s=60)
        child = _night(killed_night, arxiv, stub, db_url, out)
        deadline = time.monotonic() + 60
        while not stub.requests and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.05)
        assert stub.requests, child.communicate()[0]
        os.kill(child.pid, signal.SIGKILL)
        child.communicate(timeout=30)
        assert {(pid, status) for pid, _, status in _items(db_url)} == {
            (p.arxiv_id, "pending") for p in papers
        }

        stub._faults.clear()  # the model answers again
        child = _night(next_night, arxiv, stub, db_url, out)
        log = child.communicate(timeout=120)[0]
        assert child.returncode == 0, log
    items = _items(db_url)
    assert Counter(pid for pid, _, _ in items) == Counter(p.arxiv_id for p in papers), items
    assert {status for _, _, status in items} == {"done"}, items
    assert {day for _, day, _ in items} == {next_night}
    assert "taken into this digest" in log and killed_night.isoformat() in log
    page = (out / f"digest-{next_night.isoformat()}.md").read_text()
    assert all(p.arxiv_id in page for p in papers)
