"""`workload synth`: counts, determinism, kinds, export's sharing structure, recorded medians."""

from __future__ import annotations

import statistics
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from typer.testing import CliRunner

from nightshift.cli import app
from workload.export import Call, export_trace
from workload.synth import SynthError, common_prefix, recorded_papers, synth_trace
from workload.trace import TraceRecord, UnwritableRecord, read_trace, write_trace

runner = CliRunner()
BLOCK = 16
SYSTEM = 40  # tokens every call shares: 2 full blocks at 16
SUMMARY_TASK, REVIEW_TASK = 50, 145


def _source(papers: int = 120, seed: int = 3) -> list[TraceRecord]:
    """An export of a night with concurrent papers: summary then review, each measured hit."""
    rng = np.random.default_rng(seed)
    t0 = datetime(2026, 3, 2, tzinfo=UTC)
    calls = []
    for i in range(papers):
        paper = int(rng.lognormal(6.0, 0.5))
        for kind, task, out, delay in (
            ("summary", SUMMARY_TASK, int(rng.integers(60, 200)), 0),
            ("review", REVIEW_TASK, int(rng.integers(300, 700)), 30),
        ):
            calls.append(
                Call(
                    started_at=t0 + timedelta(seconds=i * 7 + delay),
                    run_id=1,
                    paper_id=f"p{i}",
                    kind=kind,
                    model="m",
                    prompt_version="v1",
                    input_basis="abstract",
                    prompt_tokens=SYSTEM + paper + task,
                    completion_tokens=out,
                    cached_tokens=(SYSTEM + paper) // BLOCK * BLOCK if kind == "review" else 32,
                )
            )
    calls.sort(key=lambda c: c.started_at)
    return export_trace(calls, block_size=BLOCK)


def test_counts_kinds_and_determinism():
    source = _source()
    records, note = synth_trace(source, 300, seed=1, block_size=BLOCK)
    assert len(records) == 600
    assert [r.kind for r in records] == ["summary", "review"] * 300
    assert {(r.source, r.model, r.timestamp) for r in records} == {("synth", "m", 0.0)}
    assert note == "300 papers resampled from 120 recorded (summary, review)"
    again, _ = synth_trace(source, 300, seed=1, block_size=BLOCK)
    assert [r.to_json() for r in again] == [r.to_json() for r in records]
    other, _ = synth_trace(source, 300, seed=2, block_size=BLOCK)
    assert [r.input_length for r in other] != [r.input_length for r in records]


def test_every_recorded_paper_is_found():
    source = _source()
    papers = recorded_papers(
        source, ["summary", "review"], common_prefix([r.hash_ids for r in source])
    )
    assert len(papers) == 120
    assert all(rev.input_length - summ.input_length == 95 for summ, rev in papers)


def test_papers_matched_by_length_when_blocks_show_no_sharing():
    # Reviews are 95 tokens longer than their summary (96 for a full-text basis); one summary
    # has no review (its review failed).
    summaries = [TraceRecord(float(t), n, 1, kind="summary") for t, n in enumerate([300, 410, 520])]
    reviews = [
        TraceRecord(10.0, 506, 2, kind="review"),
        TraceRecord(11.0, 395, 2, kind="review"),
        TraceRecord(12.0, 615, 2, kind="review"),
    ]
    extra = TraceRecord(13.0, 800, 1, kind="summary")
    papers = recorded_papers([*summaries, *reviews, extra], ["summary", "review"], 0)
    assert sorted((s.input_length, r.input_length) for s, r in papers) == [
        (300, 395),
        (410, 506),
        (520, 615),
    ]


def test_sharing_structure_matches_export():
    records, _ = synth_trace(_source(), 50, seed=4, block_size=BLOCK)
    system = records[0].hash_ids[:2]  # 40 shared tokens: two full blocks
    assert all(r.hash_ids[:2] == system for r in records)
    for i in range(0, len(records), 2):
        summary, review = records[i], records[i + 1]
        # the paper's prefix: system + paper tokens, in whole blocks
        assert (
            common_prefix([summary.hash_ids, review.hash_ids])
            == (summary.input_length - SUMMARY_TASK) // BLOCK
        )
        assert len(summary.hash_ids) == -(-summary.input_length // BLOCK)
    firsts = [r.hash_ids[2] for r in records[::2]]
    assert len(set(firsts)) == 50  # different papers share nothing past the system blocks


def test_medians_close_to_the_source():
    source = _source(papers=400)
    records, _ = synth_trace(source, 4000, seed=5, block_size=BLOCK)
    for kind in ("summary", "review"):
        for attr in ("input_length", "output_length"):
            recorded = statistics.median(getattr(r, attr) for r in source if r.kind == kind)
            drawn = statistics.median(getattr(r, attr) for r in records if r.kind == kind)
            assert drawn == pytest.approx(recorded, rel=0.05), (kind, attr)


def test_poisson_arrivals():
    records, _ = synth_trace(_source(), 2000, seed=6, rate=2.0, block_size=BLOCK)
    stamps = [r.timestamp for r in records[::2]]
    assert stamps[0] == 0.0
    assert all(r.timestamp == s for r, s in zip(records[1::2], stamps))
    assert np.mean(np.diff(stamps)) == pytest.approx(500.0, rel=0.1)


def test_trace_without_kinds_resamples_requests():
    source = [TraceRecord(float(i), 70 + i, 10 + i, [2 * i, 2 * i + 1]) for i in range(50)]
    records, note = synth_trace(source, 30, seed=0, block_size=64)
    assert len(records) == 30 and note.startswith("30 requests resampled from 50")
    lengths = {(r.input_length, r.output_length) for r in source}
    assert all((r.input_length, r.output_length) in lengths and r.kind is None for r in records)
    assert len({h for r in records for h in r.hash_ids}) == 2 * 30  # nothing shared


def test_unpaired_kinds_fall_back_to_lognormal():
    rng = np.random.default_rng(0)
    source = []
    for i in range(200):
        source.append(TraceRecord(0.0, int(rng.integers(100, 400)), 50 + i, kind="summary"))
        source.append(TraceRecord(0.0, int(rng.integers(20_000, 40_000)), 300, kind="review"))
    records, note = synth_trace(source, 100, seed=0)
    assert "log-normal" in note and len(records) == 200
    reviews = [r.input_length for r in records if r.kind == "review"]
    assert 15_000 < statistics.median(reviews) < 45_000


def test_errors():
    source = _source(papers=5)
    with pytest.raises(SynthError, match="--papers"):
        synth_trace(source, 0)
    with pytest.raises(SynthError, match="--rate"):
        synth_trace(source, 3, rate=0.0, block_size=BLOCK)
    with pytest.raises(SynthError, match="not 512-token blocks"):
        synth_trace(source, 3, block_size=512)  # overriding the source's 16
    with pytest.raises(SynthError, match="--block-size must be from 1"):
        synth_trace(source, 3, block_size=0)


def test_the_source_block_size_is_read_from_it_and_carried():
    """An export at 16 tokens a block is synthesized at 16 without being told, and the output
    says 16: read as 512-token blocks its shared system blocks would cover 1024 tokens."""
    records, _ = synth_trace(_source(papers=20), 10, seed=0)
    assert {r.block_size for r in records} == {BLOCK}
    assert all(len(r.hash_ids) == -(-r.input_length // BLOCK) for r in records)
    assert records == synth_trace(_source(papers=20), 10, seed=0, block_size=BLOCK)[0]


def test_cli(tmp_path):
    like, out = tmp_path / "like.jsonl", tmp_path / "out.jsonl"
    write_trace(like, _source(papers=20))
    args = ["workload", "synth", "--like", str(like), "--papers", "7", "-o", str(out)]
    result = runner.invoke(app, [*args, "--block-size", "16", "--seed", "3", "--rate", "0.5"])
    assert result.exit_code == 0, result.output
    assert len(read_trace(out)) == 14
    assert {r.block_size for r in read_trace(out)} == {16}
    assert runner.invoke(app, args).exit_code == 0  # the source says 16
    bad = runner.invoke(app, [*args, "--block-size", "512"])
    assert bad.exit_code == 2 and bad.output.startswith(f"error: {like}:1: ")
    assert "not 512-token blocks" in bad.output


def test_arrivals_past_the_format_bound_are_refused():
    source = _source(papers=5)
    with pytest.raises(SynthError, match="--rate 1e-300 is too low"):
        synth_trace(source, 3, rate=1e-300, block_size=BLOCK)
    with pytest.raises(SynthError, match="--seed"):
        synth_trace(source, 3, seed=-1, block_size=BLOCK)
    with pytest.raises(SynthError, match="--papers must be from 1 to 100,000"):
        synth_trace(source, 10**11, block_size=BLOCK)


def test_write_trace_refuses_a_record_its_reader_would(tmp_path):
    out = tmp_path / "out.jsonl"
    good = TraceRecord(0.0, 10, 1, [0])
    for bad in (TraceRecord(1e300, 10, 1, [0]), TraceRecord(0.0, 0, 1), TraceRecord(0.0, 10, -1)):
        with pytest.raises(UnwritableRecord, match="record 2 would not be a valid trace"):
            write_trace(out, [good, bad])
        assert not out.exists() and not list(tmp_path.iterdir())
