"""Two runs started at the same moment on a fresh database (two timers, two schedulers): one runs,
the other says the lock is held, in one line. Neither trips over the other's migration."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.digest.conftest import fresh_database
from tests.digest.fault_server import Fault, FaultServer
from tests.digest.test_pipeline import DAY, write_papers

# `nightshift ARGS...` once per trial, each started when the test creates that trial's go file,
# so that both processes reach the database within a millisecond of each other. One process
# serves every trial (the imports are the slow part); `{trial}` in ARGS is the trial's number.
LAUNCHER = """
import os, sys, time
from nightshift.cli import app
import digest.pipeline
prefix, trials, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
for trial in range(trials):
    go = f"{prefix}{trial}"
    open(f"{go}.ready{os.getpid()}", "w").close()
    while not os.path.exists(go):
        time.sleep(0.001)
    sys.argv = ["nightshift", *(a.format(trial=trial) for a in args)]
    try:
        app()
    except SystemExit as exc:
        print(f"@@exit {exc.code or 0}", file=sys.stderr, flush=True)
"""
TRIALS = 3


def _wait_for(files: Path, pattern: str, n: int, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 60
    while len(list(files.glob(pattern))) < n:
        assert time.monotonic() < deadline, f"waiting for {pattern}"
        if any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            raise AssertionError([p.communicate() for p in procs])
        time.sleep(0.005)


def _trials(stderr: str) -> list[tuple[int, str]]:
    """(exit code, stderr) per trial from a launcher's stderr."""
    out, lines = [], []
    for line in stderr.splitlines(keepends=True):
        if line.startswith("@@exit "):
            out.append((int(line.split()[1]), "".join(lines)))
            lines = []
        else:
            lines.append(line)
    return out


def test_two_runs_on_a_fresh_database_one_runs_one_says_the_lock_is_held(tmp_path, db_url):
    papers = write_papers(tmp_path / "papers.jsonl")
    urls = [fresh_database(db_url, tmp_path / f"trial{n}.db") for n in range(TRIALS)]
    db = urls[0].replace("trial0", "trial{trial}")
    # Slow answers, so the first run still holds the lock when the second asks for it.
    with FaultServer(faults=[Fault("hang", delay_s=0.2, times=-1)]) as stub:
        args = [
            "digest", "run", "--date", DAY.isoformat(), "--source", str(papers),
            "--endpoint", stub.base_url, "--model", "stub-model", "--db", db,
            "--out", str(tmp_path / "out{trial}"),
        ]  # fmt: skip
        cmd = [sys.executable, "-c", LAUNCHER, str(tmp_path / "go"), str(TRIALS), *args]
        procs = [
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        try:
            for trial in range(TRIALS):
                _wait_for(tmp_path, f"go{trial}.ready*", 2, procs)
                if trial:
                    fresh_database(db_url, tmp_path / f"trial{trial}.db")
                (tmp_path / f"go{trial}").touch()
            outputs = [p.communicate(timeout=120) for p in procs]
        finally:
            for p in procs:
                p.kill()
    per_process = [_trials(err) for _, err in outputs]
    assert all(len(t) == TRIALS for t in per_process), outputs
    for trial, results in enumerate(zip(*per_process, strict=True)):
        assert sorted(code for code, _ in results) == [0, 1], (trial, results)
        (loser,) = [err for code, err in results if code == 1]
        assert loser.count("\n") == 1, loser
        assert loser.startswith("error: another digest run holds the lock"), loser
