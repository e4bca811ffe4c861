"""workload/metrics.py on hand-made records: exact values of vLLM's benchmark definitions."""

from __future__ import annotations

import pytest

from workload.metrics import (
    RequestRecord,
    distribution,
    meets_slo,
    parse_slo,
    peak_concurrency,
    summarize,
    throughput_timeline,
)


def rec(
    index: int,
    start: float,
    chunks: list[float],
    end: float | None = None,
    out: int | None = None,
    inp: int = 10,
    expected: int | None = None,
    error: str | None = None,
) -> RequestRecord:
    n = len(chunks) if out is None else out
    return RequestRecord(
        index=index,
        input_length=inp,
        output_expected=n if expected is None else expected,
        start_s=start,
        end_s=chunks[-1] if end is None and chunks else end,
        chunk_times=list(chunks),
        output_received=n,
        error_kind=error,
        error=error and f"{error} happened",
    )


def test_distribution_matches_numpy_linear_percentiles():
    d = distribution([4.0, 1.0, 3.0, 2.0])
    assert d["mean"] == 2.5
    assert d["median"] == 2.5
    assert d["p90"] == pytest.approx(3.7)
    assert d["p99"] == pytest.approx(3.97)
    assert d["count"] == 4
    assert distribution([]) == {"mean": None, "median": None, "p90": None, "p99": None, "count": 0}


def test_per_request_ttft_itl_tpot_e2e():
    r = rec(0, start=1.0, chunks=[1.5, 1.6, 1.8, 1.9], end=2.0)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.2, 0.1])
    assert r.e2e_s == pytest.approx(1.0)
    assert r.tpot_s == pytest.approx((1.0 - 0.5) / 3)


def test_tpot_undefined_for_one_token_and_excluded_from_the_summary():
    one = rec(0, start=0.0, chunks=[0.3])
    two = rec(1, start=0.0, chunks=[0.2, 0.4])
    assert one.tpot_s is None and one.itl == []
    assert two.tpot_s == pytest.approx(0.2)
    s = summarize([one, two])
    assert s["tpot_s"]["count"] == 1 and s["tpot_s"]["mean"] == pytest.approx(0.2)
    assert s["ttft_s"]["count"] == 2 and s["ttft_s"]["mean"] == pytest.approx(0.25)
    assert s["itl_s"]["count"] == 1


def test_throughputs_over_the_duration_count_completed_requests_only():
    records = [
        rec(0, start=0.0, chunks=[0.5, 1.0, 2.0], inp=100),  # 3 tokens, ends at 2.0
        rec(1, start=1.0, chunks=[1.5, 2.0, 3.0, 4.0, 4.0], inp=50),  # 5 tokens, ends at 4.0
        rec(2, start=0.0, chunks=[], end=0.5, out=0, inp=70, error="http_500"),
    ]
    s = summarize(records)
    assert s["duration_s"] == 4.0 and s["makespan_s"] == 4.0
    assert s["requests"] == {"total": 3, "sent": 3, "completed": 2, "failed": 1, "not_sent": 0}
    assert s["failures"] == {"http_500": 1}
    assert s["input_tokens"] == 150 and s["output_tokens"] == 8
    assert s["request_throughput"] == pytest.approx(2 / 4)
    assert s["output_throughput"] == pytest.approx(8 / 4)
    assert s["total_token_throughput"] == pytest.approx(158 / 4)


def test_makespan_from_first_send_to_last_end():
    s = summarize([rec(0, 0.5, [1.0, 2.0]), rec(1, 1.0, [3.0, 3.5])], not_sent=2)
    assert s["duration_s"] == 3.5 and s["makespan_s"] == 3.0
    assert s["requests"]["total"] == 4 and s["requests"]["not_sent"] == 2


def test_peak_concurrency():
    records = [
        rec(0, 0.0, [2.0]),
        rec(1, 1.0, [3.0]),
        rec(2, 2.0, [4.0]),  # starts as 0 ends: they do not overlap
        rec(3, 2.5, [3.0]),
        RequestRecord(4, 10, 1),  # never sent
    ]
    assert peak_concurrency(records) == 3
    assert peak_concurrency([rec(0, 0.0, [1.0]), rec(1, 1.0, [2.0])]) == 1
    assert peak_concurrency([]) == 0


def test_goodput_counts_requests_meeting_every_slo():
    records = [
        rec(0, 0.0, [0.1, 0.15, 0.2]),  # ttft 100 ms, tpot 50 ms, e2e 200 ms: good
        rec(1, 0.0, [0.3, 0.35, 0.4]),  # ttft 300 ms: misses ttft
        rec(2, 0.0, [0.1, 0.3, 0.5]),  # tpot 200 ms: misses tpot
        rec(3, 0.0, [0.2]),  # one token: tpot undefined, violates nothing: good
        rec(4, 0.0, [], end=0.1, out=0, error="timeout"),  # failed: never good
    ]
    slo = {"ttft": 250.0, "tpot": 100.0}
    assert [meets_slo(r, slo) for r in records] == [True, False, False, True, False]
    g = summarize(records, slo_ms=slo)["goodput"]
    assert g["requests"] == 2
    assert g["fraction"] == pytest.approx(2 / 5)
    assert g["request_rate"] == pytest.approx(2 / 0.5)
    assert summarize(records, slo_ms={"e2e": 150})["goodput"]["requests"] == 0
    assert summarize(records)["goodput"] is None


def test_output_mismatch_is_flagged():
    short = rec(0, 0.0, [0.1, 0.2], expected=5)
    exact = rec(1, 0.0, [0.1, 0.2])
    assert short.output_mismatch and not exact.output_mismatch
    s = summarize([short, exact])
    assert s["output_mismatch"] == 1 and s["output_expected"] == 7 and s["output_tokens"] == 4
    assert short.to_json()["output_mismatch"] is True


def test_timeline_spreads_tokens_over_chunks():
    # 4 tokens in 2 chunks (2 each) at 0.5 s and 1.5 s; 1 token at 1.2 s.
    records = [rec(0, 0.0, [0.5, 1.5], out=4), rec(1, 0.0, [1.2], out=1)]
    assert throughput_timeline(records) == [2.0, 3.0]
    assert throughput_timeline(records, bin_s=0.5) == [0.0, 4.0, 2.0, 4.0]
    assert throughput_timeline([]) == []


def test_record_json_layout():
    data = rec(3, 1.0, [1.25, 1.5, 2.0], end=2.0).to_json()
    assert data["index"] == 3
    assert data["ttft_s"] == 0.25 and data["e2e_s"] == 1.0
    assert data["itl_mean_s"] == 0.375 and data["itl_max_s"] == 0.5
    assert data["tpot_s"] == 0.375 and data["chunks"] == 3
    assert data["error"] is None and data["cached_tokens"] is None


def test_parse_slo():
    assert parse_slo("ttft:500, tpot:50,e2e:2e4") == {"ttft": 500.0, "tpot": 50.0, "e2e": 20000.0}
    for bad in ("ttft", "itl:5", "ttft:abc", "e2e:-1", ""):
        with pytest.raises(ValueError):
            parse_slo(bad)
