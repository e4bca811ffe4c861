"""`workload stats`: numbers on a hand-computed trace, the log-normal fit, plots, the command."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from nightshift.cli import app
from workload.plots import plot_lengths
from workload.stats import fit_lognormal, ks_distance, prefix_reuse, trace_stats
from workload.trace import TraceRecord, write_trace

runner = CliRunner()

# 12 blocks; reused: 0 (2nd), 0 and 1 (3rd), 0, 1 and 3 (5th) -> 6.
TINY = [
    TraceRecord(0.0, 10, 1, [0, 1], kind="summary"),
    TraceRecord(1000.0, 20, 2, [0, 2], kind="review"),
    TraceRecord(2000.0, 30, 3, [0, 1, 3], kind="summary"),
    TraceRecord(3000.0, 40, 4, [4], kind="review"),
    TraceRecord(4000.0, 50, 5, [0, 1, 3, 5], kind="summary"),
]


def test_tiny_trace_numbers():
    stats = trace_stats(TINY)
    assert (stats.count, stats.duration_s, stats.rate_per_s) == (5, 4.0, 1.25)
    assert (stats.blocks, stats.reused_blocks, stats.prefix_reuse) == (12, 6, 0.5)
    overall = stats.overall.input
    assert (overall.min, overall.mean, overall.max) == (10, 30.0, 50)
    assert (overall.p50, overall.p90, overall.p99) == pytest.approx((30.0, 46.0, 49.6))
    assert stats.overall.output.p50 == 3.0
    summary, review = stats.kinds["summary"], stats.kinds["review"]
    assert (summary.count, review.count) == (3, 2)
    assert (summary.input.p50, summary.input.p90) == pytest.approx((30.0, 46.0))
    assert (review.input.p50, review.input.p90, review.input.p99) == pytest.approx(
        (30.0, 38.0, 39.8)
    )
    assert list(stats.kinds) == ["review", "summary"]


def test_reuse_follows_timestamps_not_file_order():
    records = [TraceRecord(5.0, 1, 1, [7]), TraceRecord(0.0, 1, 1, [7, 8])]
    assert prefix_reuse(records) == (3, 1)


def test_batch_has_no_rate():
    stats = trace_stats([TraceRecord(0.0, 5, 1), TraceRecord(0.0, 7, 1)])
    assert stats.rate_per_s is None and stats.prefix_reuse is None


def test_lognormal_fit_recovers_parameters():
    samples = np.random.default_rng(7).lognormal(5.0, 0.7, size=20_000)
    fit = fit_lognormal(samples)
    assert fit is not None and fit.n == 20_000
    assert fit.mu == pytest.approx(5.0, rel=0.02)
    assert fit.sigma == pytest.approx(0.7, rel=0.02)
    assert fit.ks < 0.015  # drawn from the fitted family: a small distance
    uniform = np.random.default_rng(7).uniform(1, 1000, size=20_000)
    assert fit_lognormal(uniform).ks > 0.05  # not log-normal: a large one


def test_ks_distance_by_hand():
    # One sample at the median: the CDF steps from 0 to 1 where the fit is 0.5.
    assert ks_distance(np.array([1.0]), 0.0, 1.0) == pytest.approx(0.5)
    assert fit_lognormal([0, 5]) is None  # one positive value: nothing to fit


def test_plots_are_png(tmp_path):
    paths = plot_lengths(TINY, tmp_path / "plots", title="tiny")
    assert [p.name for p in paths] == ["lengths_hist.png", "lengths_cdf.png"]
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000


def test_cli_table_and_json(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, TINY)
    out = tmp_path / "s.json"
    result = runner.invoke(app, ["workload", "stats", str(trace), "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "5 requests over 4.0 s, 1.250 req/s; prefix reuse 50.0% of 12 blocks" in result.output
    assert "summary in (3)" in result.output
    numbers = json.loads(out.read_text())
    assert numbers["overall"]["input"]["p90"] == pytest.approx(46.0)
    assert numbers["kinds"]["review"]["output"]["max"] == 4
    assert numbers["prefix_reuse"] == 0.5


def test_cli_bad_trace(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": -1, "output_length": 1}\n')
    result = runner.invoke(app, ["workload", "stats", str(trace)])
    assert result.exit_code == 2
    assert result.output.startswith(f"error: {trace}:1: input_length must be an integer from 1")
    trace.write_text("\n")
    assert (
        "the trace has no requests" in runner.invoke(app, ["workload", "stats", str(trace)]).output
    )
