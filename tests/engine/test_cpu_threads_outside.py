"""--threads and OMP_NUM_THREADS tried from outside with absurd counts: torch's OpenMP pool
crashes the process (SIGSEGV, or libgomp "Out of memory allocating ... bytes") on counts in the
tens of thousands, so such a count must be one line and exit 2, not a dead server."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cpu_threads import MAX_THREADS, CpuBudget, check_threads, choose_threads

ROOT = Path(__file__).resolve().parents[2]
BUDGET = CpuBudget(cpus=(0, 1), physical_cores=2, quota=None)


@pytest.mark.parametrize("count", [MAX_THREADS + 1, 100_000, 2**31 - 1])
def test_an_absurd_thread_count_is_refused(count):
    with pytest.raises(ValueError, match=f"--threads must be at most {MAX_THREADS}"):
        check_threads(count)
    with pytest.raises(ValueError):
        choose_threads(count, environ={}, budget=BUDGET)


def test_the_largest_count_passes_with_its_warning_path():
    assert check_threads(MAX_THREADS) == MAX_THREADS
    choice = choose_threads(MAX_THREADS, environ={}, budget=BUDGET)
    assert choice.above_budget


def test_an_absurd_omp_num_threads_is_ignored(caplog):
    with caplog.at_level(logging.WARNING):
        choice = choose_threads(None, environ={"OMP_NUM_THREADS": "100000"}, budget=BUDGET)
    assert (choice.threads, choice.source) == (2, "available cores")
    assert "OMP_NUM_THREADS='100000'" in caplog.text


@pytest.mark.parametrize(
    "command",
    [["serve", "--threads", "100000"], ["generate", "hi", "--threads", "99999999999"]],
)
def test_the_command_line_says_one_line_and_exits_2(command):
    result = subprocess.run(
        [sys.executable, "-m", "nightshift.cli", *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"at most {MAX_THREADS}" in lines[0], result.stderr
