"""Kill -9 half-way, start again: the rest is done, nothing twice, and the digest equals an
uninterrupted run's."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from sqlalchemy import func, select

from digest.store.database import open_database
from digest.store.digest_store import DigestStore
from digest.store.schema import ModelCallRow
from tests.digest.fault_server import Fault, FaultServer
from tests.digest.test_pipeline import DAY, write_papers

TITLES = [f"Paper number {n} on resumable batch jobs" for n in range(1, 7)]


def _run_cli(db_url: str, out: Path, papers: Path, base_url: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "nightshift.cli",
        "digest",
        "run",
        "--date",
        DAY.isoformat(),
        "--source",
        str(papers),
        "--endpoint",
        base_url,
        "--model",
        "stub-model",
        "--concurrency",
        "1",
        "--db",
        db_url,
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _ok_calls(db_url: str) -> int:
    with open_database(db_url).connect() as conn:
        query = select(func.count()).select_from(ModelCallRow).where(ModelCallRow.status == "ok")
        try:
            return conn.execute(query).scalar_one()
        except Exception:  # the table does not exist yet
            return 0


def _page(out: Path) -> str:
    html = (out / f"digest-{DAY}.html").read_text()
    return re.sub(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d(:\d\d)?(\.\d+)?(\+00:00|Z| UTC)?", "T", html)


def test_kill_and_resume_matches_an_uninterrupted_run(tmp_path):
    papers = write_papers(tmp_path / "papers.jsonl", TITLES)
    killed_db = f"sqlite:///{tmp_path / 'killed.db'}"
    clean_db = f"sqlite:///{tmp_path / 'clean.db'}"
    # Every answer takes a little while, so the kill lands mid-run.
    with FaultServer(faults=[Fault("hang", delay_s=0.3, times=-1)]) as stub:
        proc = _run_cli(killed_db, tmp_path / "out-killed", papers, stub.base_url)
        deadline = time.monotonic() + 120
        while _ok_calls(killed_db) < 5 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        done_before = _ok_calls(killed_db)
        assert 5 <= done_before < 12, "the kill must land half-way"

        resumed = _run_cli(killed_db, tmp_path / "out-killed", papers, stub.base_url)
        output = resumed.communicate(timeout=120)[0].decode()
        assert resumed.returncode == 0, output
        assert "succeeded" in output
        clean = _run_cli(clean_db, tmp_path / "out-clean", papers, stub.base_url)
        output = clean.communicate(timeout=120)[0].decode()
        assert clean.returncode == 0, output

    store = DigestStore(open_database(killed_db))
    ok = [(c.paper_id, c.kind) for c in store.calls() if c.status == "ok"]
    assert len(ok) == 12 and len(set(ok)) == 12, "every summary and review exactly once"
    assert [r.status for r in store.runs_for(DAY)] == ["interrupted", "succeeded"]
    clean_store = DigestStore(open_database(clean_db))
    resumed_digest, clean_digest = store.load_digest(DAY), clean_store.load_digest(DAY)
    assert [(e.paper.arxiv_id, e.summary, e.review) for e in resumed_digest.entries] == [
        (e.paper.arxiv_id, e.summary, e.review) for e in clean_digest.entries
    ]
    assert _page(tmp_path / "out-killed") == _page(tmp_path / "out-clean")
