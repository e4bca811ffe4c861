"""The replay client against a stub with known delays: it must recover them, and it must report
short outputs, HTTP errors, overlong requests and cancellations without stopping."""

from __future__ import annotations

import json
import statistics

import pytest
from typer.testing import CliRunner

from nightshift.cli import app
from tests.workload.delay_server import DelayServer
from workload.prompt_tokens import TokenPrompts
from workload.replay import ReplayConfig, replay
from workload.trace import TraceRecord, write_trace

# A client never sees a delay shorter than the server imposed (EARLY covers clock granularity);
# connecting and scheduling make what it sees a little longer (SLACK, one-sided, enough for a
# 2-core machine loaded by other work). Gaps between chunks carry neither: a tight two-sided TOL.
EARLY = 0.002
SLACK = 0.15
TOL = 0.02


def within(value: float, expected: float) -> bool:
    return expected - EARLY <= value <= expected + SLACK


def _trace(outputs: list[int], timestamps: list[float] | None = None) -> list[TraceRecord]:
    stamps = timestamps or [0.0] * len(outputs)
    return [TraceRecord(t, 20 + i, n) for i, (t, n) in enumerate(zip(stamps, outputs))]


def _run(server: DelayServer, trace: list[TraceRecord], **kwargs) -> dict:
    config = ReplayConfig(server.base_url, server.model, **kwargs)
    return replay(trace, config, TokenPrompts(32000).prompt)


def test_recovers_ttft_itl_tpot_e2e():
    with DelayServer(ttft_s=0.2, itl_s=0.05) as server:
        result = _run(server, _trace([6, 6, 6]), mode="concurrency", concurrency=3)
    s = result["summary"]
    assert s["requests"]["completed"] == 3 and s["failures"] == {}
    for r in result["requests"]:
        assert within(r["ttft_s"], 0.2), r
        assert r["itl_mean_s"] == pytest.approx(0.05, abs=TOL)
        assert r["tpot_s"] == pytest.approx(0.05, abs=TOL)
        assert within(r["e2e_s"], 0.2 + 0.05 * 5), r
        assert r["output_received"] == 6 and not r["output_mismatch"]
        assert r["chunks"] == 6 and r["prompt_tokens"] == r["input_length"]
    assert s["itl_s"]["count"] == 15 and s["itl_s"]["median"] == pytest.approx(0.05, abs=TOL)
    assert s["peak_concurrency"] == 3
    assert s["output_tokens"] == 18
    assert s["output_throughput"] == pytest.approx(18 / s["duration_s"])
    assert s["duration_s"] == pytest.approx(max(r["end_s"] for r in result["requests"]), abs=1e-5)


def test_batch_concurrency_cap_serialises_and_makespan_adds_up():
    with DelayServer(ttft_s=0.05, itl_s=0.02) as server:
        result = _run(server, _trace([3, 3, 3, 3]), mode="batch", concurrency=2)
    s = result["summary"]
    assert s["peak_concurrency"] == 2
    # two waves of 0.05 + 2 * 0.02 s each (one wave if the cap were ignored)
    assert within(s["makespan_s"], 2 * 0.09)
    starts = sorted(r["start_s"] for r in result["requests"])
    assert starts[2] >= min(r["end_s"] for r in result["requests"]) - 1e-3


def test_trace_mode_respects_scaled_timestamps():
    stamps = [0.0, 400.0, 1000.0, 200.0]  # ms; sent in timestamp order
    with DelayServer(ttft_s=0.0, itl_s=0.0) as server:
        result = _run(server, _trace([1, 1, 1, 1], stamps), mode="trace", time_scale=2.0)
        arrivals = server.arrivals
    starts = [r["start_s"] for r in result["requests"]]
    for start, stamp in zip(starts, stamps):
        assert within(start, stamp / 1000 / 2), starts
    # the server saw them at the same spacing
    seen = sorted(t for t, _ in arrivals)
    gaps = [b - a for a, b in zip(seen, seen[1:])]
    assert gaps == pytest.approx([0.1, 0.1, 0.3], abs=SLACK)


def test_goodput_with_slos():
    # e2e: 0.05 + 0.1 (2 tokens) = 0.15 s; 0.05 + 0.1 * 7 (8 tokens) = 0.75 s
    with DelayServer(ttft_s=0.05, itl_s=0.1) as server:
        result = _run(server, _trace([2, 8, 2, 8, 2]), slo_ms={"e2e": 450.0, "ttft": 300.0})
    g = result["summary"]["goodput"]
    assert g["requests"] == 3 and g["fraction"] == pytest.approx(3 / 5)
    assert g["request_rate"] == pytest.approx(3 / result["summary"]["duration_s"])


def test_short_outputs_are_flagged_with_and_without_usage():
    for usage in (True, False):
        with DelayServer(ttft_s=0.0, itl_s=0.0, short={5: 3}, usage=usage) as server:
            result = _run(server, _trace([5, 4]))
        short, exact = result["requests"]
        assert short["output_expected"] == 5 and short["output_received"] == 3
        assert short["output_mismatch"] and not exact["output_mismatch"]
        assert exact["output_received"] == 4
        assert result["summary"]["output_mismatch"] == 1
        assert (short["prompt_tokens"] is None) == (not usage)


def test_http_500_is_a_failed_request_and_the_replay_goes_on():
    with DelayServer(ttft_s=0.0, itl_s=0.0, fail={7: 500}) as server:
        result = _run(server, _trace([3, 7, 3]), mode="concurrency", concurrency=1)
        assert len(server.arrivals) == 3
    ok1, failed, ok2 = result["requests"]
    assert failed["error_kind"] == "http_500"
    assert "500" in failed["error"] and "injected failure 500" in failed["error"]
    assert failed["ttft_s"] is None and failed["e2e_s"] is not None
    assert ok1["error"] is None and ok2["error"] is None
    s = result["summary"]
    assert s["requests"]["completed"] == 2 and s["requests"]["failed"] == 1
    assert s["failures"] == {"http_500": 1}


def test_requests_longer_than_max_model_len_are_not_sent():
    with DelayServer(ttft_s=0.0, itl_s=0.0, max_model_len=25) as server:
        result = _run(server, _trace([2, 10]))  # 20 + 2 fits, 21 + 10 does not
        assert len(server.arrivals) == 1
    fits, too_long = result["requests"]
    assert fits["error"] is None
    assert too_long["error_kind"] == "too_long" and "max_model_len 25" in too_long["error"]
    assert result["config"]["server_max_model_len"] == 25


def test_max_duration_stops_sending_and_cancels_after_the_grace():
    stamps = [0.0, 100.0, 5000.0, 6000.0]  # the last two come after the deadline
    with DelayServer(ttft_s=0.0, itl_s=0.0) as server:
        result = _run(server, _trace([1, 1, 1, 1], stamps), mode="trace", max_duration_s=0.5)
    s = result["summary"]["requests"]
    assert s == {"total": 4, "sent": 2, "completed": 2, "failed": 0, "not_sent": 2}
    with DelayServer(ttft_s=2.0, itl_s=0.0) as server:
        result = _run(server, _trace([1, 1]), max_duration_s=0.1, grace_s=0.2)
    assert [r["error_kind"] for r in result["requests"]] == ["cancelled", "cancelled"]
    # cancelled at max duration + grace, long before the 2 s answer
    assert all(within(r["end_s"], 0.3) for r in result["requests"])


def test_poisson_mode_sends_at_the_drawn_times():
    with DelayServer(ttft_s=0.0, itl_s=0.0) as server:
        result = _run(server, _trace([1] * 6), mode="poisson", rate=20.0, seed=1)
    from workload.replay import poisson_offsets

    expected = poisson_offsets(6, 20.0, 1.0, seed=1)
    starts = [r["start_s"] for r in result["requests"]]
    assert all(within(start, t) for start, t in zip(starts, expected)), (starts, expected)


def test_cli_writes_the_result_and_plots(tmp_path, monkeypatch):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, _trace([3, 4, 5, 1]))
    out = tmp_path / "result.json"
    monkeypatch.setenv("STUB_KEY", "sekrit")
    with DelayServer(ttft_s=0.02, itl_s=0.01, api_key="sekrit") as server:
        args = ["workload", "replay", str(trace), "--base-url", server.base_url]
        args += ["--model", "stub", "--mode", "concurrency", "--concurrency", "2"]
        args += ["--slo", "ttft:500,tpot:100", "--api-key-env", "STUB_KEY"]
        args += ["--plots", str(tmp_path / "plots"), "-o", str(out)]
        run = CliRunner().invoke(app, args)
        bodies = [b for _, b in server.arrivals]
    assert run.exit_code == 0, run.output
    result = json.loads(out.read_text())
    assert set(result) == {"config", "summary", "requests"}
    assert result["config"]["mode"] == "concurrency" and result["config"]["prompt_mode"] == "tokens"
    assert result["summary"]["requests"]["completed"] == 4
    assert result["summary"]["goodput"]["requests"] == 4
    assert [r["output_received"] for r in result["requests"]] == [3, 4, 5, 1]
    assert sorted(len(b["prompt"]) for b in bodies) == [20, 21, 22, 23]
    assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "throughput.png").stat().st_size > 1000
    assert "TTFT" in run.output and "goodput" in run.output
    assert statistics.median(r["ttft_s"] for r in result["requests"]) < 0.5


def test_cli_rejects_bad_arguments(tmp_path):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, _trace([3]))
    fine_blocks = tmp_path / "blocks16.jsonl"  # 2 blocks of 16 for 20 tokens: not 512-token ones
    write_trace(fine_blocks, [TraceRecord(0, 20, 3, hash_ids=[0, 1])])
    tail = ["--base-url", "http://127.0.0.1:9/v1", "--model", "m", "-o", str(tmp_path / "r.json")]
    for path, extra, words in (
        (trace, ["--mode", "concurrency"], "concurrency"),
        (trace, ["--slo", "ttft"], "SLO"),
        (trace, ["--prompt-mode", "text"], "--tokenizer"),
        (trace, ["--api-key-env", "NIGHTSHIFT_TEST_UNSET_KEY"], "NIGHTSHIFT_TEST_UNSET_KEY"),
        (fine_blocks, [], "--block-size"),
    ):
        run = CliRunner().invoke(app, ["workload", "replay", str(path), *tail, *extra])
        assert run.exit_code == 2 and words in run.output, run.output


def test_cli_cuts_prompts_at_the_traces_block_size(tmp_path):
    """A trace exported with --block-size 16 says so; replay then shares 16 tokens where two
    records share one hash_id, not 512 (the whole prompt here). --block-size 512 overrides it,
    and the 16-token ids no longer fit: refused before a request is sent."""
    trace = tmp_path / "blocks16.jsonl"
    write_trace(trace, [TraceRecord(0, 40, 1, [0, 1, 2], block_size=16),
                        TraceRecord(0, 40, 1, [0, 3, 4], block_size=16)])  # fmt: skip
    out = tmp_path / "r.json"
    with DelayServer(ttft_s=0.0, itl_s=0.0) as server:
        args = ["workload", "replay", str(trace), "--base-url", server.base_url]
        run = CliRunner().invoke(app, [*args, "--model", "stub", "-o", str(out)])
        prompts = sorted(b["prompt"] for _, b in server.arrivals)
    assert run.exit_code == 0, run.output
    a, b = prompts
    assert a[:16] == b[:16] and a[16:32] != b[16:32]
    assert json.loads(out.read_text())["config"]["block_size"] == 16
    tail = ["--model", "m", "-o", str(out), "--block-size", "512"]
    args = ["workload", "replay", str(trace), "--base-url", "http://127.0.0.1:9/v1", *tail]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 2 and "do not fit 512-token blocks" in refused.output


def test_unreachable_server_is_a_failed_run(tmp_path):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, _trace([3, 2]))
    out = tmp_path / "r.json"
    args = ["workload", "replay", str(trace), "--base-url", "http://127.0.0.1:9/v1"]
    run = CliRunner().invoke(app, [*args, "--model", "m", "-o", str(out)])
    assert run.exit_code == 1
    result = json.loads(out.read_text())
    assert result["summary"]["failures"] == {"connection": 2}
