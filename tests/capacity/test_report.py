"""The planner's answers and the report built from them, on a small trace."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from capacity.gpus import find_gpu
from capacity.memory import plan_memory
from capacity.model_specs import load_model_spec
from capacity.planner import PlanSettings, api_cost, plan_gpu
from capacity.report import build_report, render
from capacity.simulate import Load
from nightshift.cli import app
from workload.trace import TraceRecord, write_trace


def _trace(papers: int = 6) -> list[TraceRecord]:
    records = []
    for p in range(papers):
        records.append(TraceRecord(0, 400 + 10 * p, 120, [100 + p], kind="summary"))
        records.append(TraceRecord(0, 460 + 10 * p, 300, [100 + p], kind="review"))
    return records


def test_plan_memory_cost_and_deadline():
    spec, gpu = load_model_spec("Llama-3.1-8B"), find_gpu("4090")
    settings = PlanSettings(max_num_seqs=64, max_num_batched_tokens=2048)
    plan = plan_gpu(spec, _trace(), gpu, 1, settings)
    expected = plan_memory(
        spec,
        gpu.memory_bytes,
        dtype="bf16",
        max_num_batched_tokens=2048,
        max_num_seqs=64,
        max_model_len=1024,
    )
    assert plan.memory.num_blocks == expected.num_blocks
    assert plan.sim is not None and plan.replicas == 1
    assert all(r.finish_s is not None for r in plan.sim.requests)
    assert plan.cost_per_night == pytest.approx(plan.sim.makespan_s / 3600 * gpu.price_per_hour)
    assert "datasheet estimate" in plan.basis
    # A deadline shorter than one GPU's makespan needs more replicas, each within the deadline.
    deadline = plan.sim.makespan_s / 2.5
    split = plan_gpu(
        spec,
        _trace(),
        gpu,
        1,
        PlanSettings(max_num_seqs=64, max_num_batched_tokens=2048, deadline_s=deadline),
    )
    assert split.replicas >= 3 and split.replica_makespan_s <= deadline
    assert split.gpus == split.replicas


def test_enforce_eager_trades_graph_memory_for_slower_steps(tmp_path):
    spec, gpu = load_model_spec("Llama-3.1-8B"), find_gpu("H100")
    settings = PlanSettings(max_num_seqs=64, max_num_batched_tokens=2048)
    graphs = plan_gpu(spec, _trace(), gpu, 1, settings)
    eager = plan_gpu(spec, _trace(), gpu, 1, replace(settings, enforce_eager=True))
    assert eager.memory.overheads.cuda_graph_bytes == 0 < graphs.memory.overheads.cuda_graph_bytes
    assert eager.memory.num_blocks > graphs.memory.num_blocks
    assert eager.coefficients.t_layer > graphs.coefficients.t_layer
    assert eager.sim.makespan_s > graphs.sim.makespan_s
    path = tmp_path / "t.jsonl"
    write_trace(path, _trace())
    out = tmp_path / "r.html"
    args = ["capacity", "report", "--model", "Llama-3.1-8B", "--gpus", "H100", "--trace", str(path)]
    result = CliRunner().invoke(app, [*args, "--enforce-eager", "-o", str(out)])
    assert result.exit_code == 0, result.output


def test_what_does_not_fit_says_why():
    plan = plan_gpu(load_model_spec("Llama-3.1-70B"), _trace(), find_gpu("L4"), 1, PlanSettings())
    assert plan.memory is None and plan.sim is None and "weights" in plan.error


def test_api_cost_is_tokens_times_prices():
    trace = _trace(2)
    tokens_in = sum(r.input_length for r in trace)
    tokens_out = sum(r.output_length for r in trace)
    cost = api_cost(trace, PlanSettings(api_price_in=0.15, api_price_out=0.6))
    assert cost == pytest.approx((tokens_in * 0.15 + tokens_out * 0.6) / 1e6)
    assert api_cost(trace, PlanSettings()) is None


def test_report_files_label_every_figure(tmp_path):
    spec = load_model_spec("Llama-3.1-8B")
    gpus = [find_gpu("4090"), find_gpu("H100")]
    settings = PlanSettings(
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        deadline_s=600,
        api_price_in=0.15,
        api_price_out=0.6,
    )
    report = build_report(spec, _trace(), "a test trace", gpus, [1, 2], settings)
    paths = render(report, tmp_path / "plan.html")
    html = (tmp_path / "plan.html").read_text()
    md = (tmp_path / "plan.md").read_text()
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)
    assert html.count("datasheet estimate") >= 4 and "pending a gpu measurement" in html.lower()
    assert "data:image/png;base64," in html and "plan-scaling.png" in md
    blocks = report.plans[0].memory.num_blocks
    assert "| RTX 4090 | 1 | 24 | 23.52 |" in md and f"| {blocks} |" in md
    assert "RTX 4090: torch: total capacity 23.52 GiB" in md and "23.52" in html
    assert "cloud API" in md and len(report.scaling["RTX 4090"]) == 5
    assert all(not math.isnan(m) for _, m in report.scaling["H100-SXM"])
    _check_tables(md)


def _check_tables(md: str) -> None:
    """Every Markdown table row has its header's number of cells (a renderer drops a row
    or a column otherwise)."""
    width = None
    for number, line in enumerate(md.splitlines(), 1):
        if not line.startswith("|"):
            width = None
            continue
        cells = line.replace("\\|", "").count("|") - 1
        width = cells if width is None else width
        assert cells == width, (number, line)


def test_every_report_table_is_well_formed(tmp_path):
    """Tables with plans that fit and one that does not (its row is mostly empty cells)."""
    spec = load_model_spec("Llama-3.1-70B")
    settings = PlanSettings(max_num_seqs=16, max_num_batched_tokens=1024, api_price_in=0.1)
    report = build_report(spec, _trace(4), "t", [find_gpu("H100")], [1, 2], settings)
    assert report.plans[0].memory is None and report.plans[1].memory is not None
    render(report, tmp_path / "plan.html")
    _check_tables((tmp_path / "plan.md").read_text())


def test_report_command(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, _trace(3))
    result = CliRunner().invoke(
        app,
        [
            "capacity",
            "report",
            "--model",
            "Qwen2.5-7B",
            "--trace",
            str(trace),
            "--gpus",
            "L4,A100-80GB",
            "--papers",
            "4",
            "--deadline",
            "1h",
            "--api-price-per-mtok",
            "0.1,0.4",
            "-o",
            str(tmp_path / "r.html"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r.md").exists() and "Qwen2.5-7B" in (tmp_path / "r.md").read_text()
    bad = CliRunner().invoke(
        app,
        [
            "capacity",
            "report",
            "--model",
            "Qwen2.5-7B",
            "--gpus",
            "A100",
            "-o",
            str(tmp_path / "x.html"),
        ],
    )
    assert bad.exit_code == 2 and "A100" in bad.output


def test_a_report_where_nothing_fits_prints_no_warnings(tmp_path):
    """Empty plots (no GPU fits) drew a legend of nothing: matplotlib's UserWarning on stderr."""
    import warnings

    report = build_report(
        load_model_spec("Llama-3.1-70B"), _trace(), "t", [find_gpu("L4")], [1], PlanSettings()
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = render(report, tmp_path / "plan.html")
    assert all(p.exists() for p in paths)


def test_report_load_modes(tmp_path):
    """--mode trace plans the trace's own arrivals: three requests 10 minutes apart keep one L4
    busy for 20 minutes and more; --mode poisson without --rate is a one-line refusal."""
    trace = tmp_path / "spaced.jsonl"
    write_trace(trace, [TraceRecord(t * 600_000.0, 500, 100, [t]) for t in range(3)])
    base = ["capacity", "report", "--model", "Qwen2.5-7B", "--trace", str(trace), "--gpus", "L4"]
    out = tmp_path / "r.html"
    timed = CliRunner().invoke(app, [*base, "--mode", "trace", "-o", str(out)])
    assert timed.exit_code == 0, timed.output
    md = (tmp_path / "r.md").read_text()
    assert "arrivals at the trace's timestamps" in md
    records = [TraceRecord(t * 600_000.0, 500, 100, [t]) for t in range(3)]
    spec, gpu = load_model_spec("Qwen2.5-7B"), find_gpu("L4")
    timed_plan = plan_gpu(spec, records, gpu, 1, PlanSettings(load=Load("trace")))
    batch_plan = plan_gpu(spec, records, gpu, 1, PlanSettings())
    assert timed_plan.sim.makespan_s >= 1200 > 60 > batch_plan.sim.makespan_s
    bad = CliRunner().invoke(app, [*base, "--mode", "poisson", "-o", str(tmp_path / "p.html")])
    assert bad.exit_code == 2 and "--rate" in bad.output


def test_max_model_len_is_an_option():
    """--max-model-len sets the engine's context (the KV pool must hold one such request); one
    shorter than the workload's longest request is refused, naming both."""
    spec, gpu = load_model_spec("Qwen2.5-7B"), find_gpu("L4")
    records = _trace(2)
    longest = max(r.input_length + r.output_length for r in records)
    plan = plan_gpu(spec, records, gpu, 1, PlanSettings(max_model_len=32768))
    assert plan.error is None and plan.memory.max_model_len == 32768
    short = plan_gpu(spec, records, gpu, 1, PlanSettings(max_model_len=longest - 1))
    assert "--max-model-len" in short.error and str(longest) in short.error


def test_nothing_fits_is_exit_1_with_the_reasons(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, _trace(2))
    args = ["capacity", "report", "--model", "Llama-3.1-70B", "--trace", str(trace)]
    result = CliRunner().invoke(app, [*args, "--gpus", "L4", "-o", str(tmp_path / "r.html")])
    assert result.exit_code == 1, result.output
    assert (tmp_path / "r.md").exists()  # the report still says why
    assert "L4 tp 1:" in result.output
    one_fits = [*args, "--gpus", "L4,H200", "--dtype", "fp8", "-o", str(tmp_path / "s.html")]
    fits = CliRunner().invoke(app, one_fits)
    assert fits.exit_code == 0, fits.output


def test_json_output_has_every_figure_unrounded(tmp_path):
    import json

    trace = tmp_path / "t.jsonl"
    records = _trace(3)
    write_trace(trace, records)
    out, data_path = tmp_path / "r.html", tmp_path / "r.json"
    args = ["capacity", "report", "--model", "Qwen2.5-7B", "--trace", str(trace), "--gpus", "L4"]
    result = CliRunner().invoke(app, [*args, "-o", str(out), "--json", str(data_path)])
    assert result.exit_code == 0, result.output
    data = json.loads(data_path.read_text())
    (plan,) = data["plans"]
    direct = plan_gpu(load_model_spec("Qwen2.5-7B"), records, find_gpu("L4"), 1, PlanSettings())
    assert plan["makespan_s"] == direct.sim.makespan_s  # not rounded for a table
    tokens = sum(r.input_length + r.output_length for r in records)
    assert plan["total_tokens_per_s"] == pytest.approx(tokens / plan["makespan_s"])
    assert plan["requests_per_s"] == pytest.approx(len(records) / plan["makespan_s"])
    assert plan["memory"]["kv_bytes_per_token"] == direct.memory.kv_bytes_per_token
    assert data["settings"]["load"]["mode"] == "batch" and data["requests"] == len(records)


def test_report_reads_the_traces_hash_block_size(tmp_path):
    """--block-size is the trace's hash block size (its records' block_size, 512 where absent),
    not the engine's KV block size (16). A trace of 16-token ids without block_size, read as
    512-token blocks, would share 32x more than it says: refused, naming the option."""
    old = tmp_path / "old16.jsonl"  # exported at 16 before traces carried their block size
    write_trace(old, [TraceRecord(0, 40, 4, [0, 1, 2]), TraceRecord(0, 40, 4, [0, 3, 4])])
    base = ["capacity", "report", "--model", "Qwen2.5-7B", "--gpus", "L4", "--trace", str(old)]
    refused = CliRunner().invoke(app, [*base, "-o", str(tmp_path / "a.html")])
    assert refused.exit_code == 2, refused.output
    assert f"{old}:1: 3 hash_ids for 40 tokens do not fit 512-token blocks" in refused.output
    assert "--block-size" in refused.output
    data = tmp_path / "b.json"
    args = [*base, "--block-size", "16", "-o", str(tmp_path / "b.html"), "--json", str(data)]
    ran = CliRunner().invoke(app, args)
    assert ran.exit_code == 0, ran.output
    import json

    report = json.loads(data.read_text())
    assert report["settings"]["block_size"] == 16  # the engine's, unchanged
    assert report["hash_block_size"] == 16
    bad = CliRunner().invoke(app, [*base, "--block-size", "0", "-o", str(tmp_path / "c.html")])
    assert bad.exit_code == 2 and "--block-size must be from 1" in bad.output


def test_kv_cache_dtype_reaches_memory_and_step_time():
    """--kv-cache-dtype fp8 (or int8) halves the KV bytes per token: about twice the blocks in
    the same pool, and decode steps that read half the KV bytes. auto is the compute dtype."""
    spec, gpu = load_model_spec("Llama-3.1-8B"), find_gpu("H100")
    # Long prompts, few at a time: every plan holds them all, so only the step times differ;
    # outputs long enough that decode steps, not the others' prefill chunks, make the TPOT.
    records = [TraceRecord(0, 30_000, 1024, [i]) for i in range(4)]
    plans = {
        kv: plan_gpu(spec, records, gpu, 1, PlanSettings(max_num_seqs=4, kv_cache_dtype=kv))
        for kv in (None, "bf16", "fp8", "int8")
    }
    auto, bf16, fp8, int8 = (plans[kv] for kv in (None, "bf16", "fp8", "int8"))
    assert auto.memory.kv_dtype == "bf16" and auto.memory.num_blocks == bf16.memory.num_blocks
    assert fp8.memory.kv_dtype == "fp8" and int8.memory.kv_dtype == "int8"
    assert fp8.memory.kv_bytes_per_token * 2 == bf16.memory.kv_bytes_per_token == 131_072
    assert abs(fp8.memory.num_blocks - 2 * bf16.memory.num_blocks) <= 1
    assert fp8.sim.preemptions == bf16.sim.preemptions == 0
    assert fp8.latency["tpot"]["p50"] < 0.95 * bf16.latency["tpot"]["p50"]
    assert int8.latency["tpot"]["p50"] == fp8.latency["tpot"]["p50"]


def test_kv_cache_dtype_option(tmp_path):
    import json

    trace = tmp_path / "t.jsonl"
    write_trace(trace, _trace(2))
    base = ["capacity", "report", "--model", "Qwen2.5-7B", "--trace", str(trace), "--gpus", "L4"]
    data = tmp_path / "r.json"
    ran = CliRunner().invoke(
        app, [*base, "--kv-cache-dtype", "FP8", "-o", str(tmp_path / "r.html"), "--json", data]
    )
    assert ran.exit_code == 0, ran.output
    report = json.loads(data.read_text())
    assert report["settings"]["kv_cache_dtype"] == "fp8"
    assert report["plans"][0]["memory"]["kv_dtype"] == "fp8"
    for value in ("int4", "q8", ""):
        bad = CliRunner().invoke(
            app, [*base, "--kv-cache-dtype", value, "-o", str(tmp_path / "x.html")]
        )
        assert bad.exit_code == 2, bad.output
        assert bad.output.startswith("error: --kv-cache-dtype: unknown dtype"), bad.output
        assert not (tmp_path / "x.md").exists()


def test_utilization_098_on_two_4090s_is_planned_with_a_warning(tmp_path):
    """2x RTX 4090 at --utilization 0.98 is a setup vLLM ran (vllm issue #13061): planned, not
    refused for a CUDA context the planner assumed; the report warns that vLLM >= 0.9.1 checks
    the free memory at startup."""
    trace = tmp_path / "t.jsonl"
    write_trace(trace, _trace(2))
    args = ["capacity", "report", "--model", "Qwen2.5-14B", "--trace", str(trace), "--gpus", "4090"]
    out = tmp_path / "r.html"
    run = CliRunner().invoke(app, [*args, "--tp", "2", "--utilization", "0.98", "-o", str(out)])
    assert run.exit_code == 0, run.output
    md = (tmp_path / "r.md").read_text()
    assert "**Warning (RTX 4090, TP 2):** utilization 0.98 leaves 0.47 GiB" in md
    refused = CliRunner().invoke(
        app, [*args, "--tp", "2", "--utilization", "1", "-o", str(tmp_path / "s.html")]
    )
    assert refused.exit_code == 1 and "leaves nothing beside the budget" in refused.output


def test_the_smallest_tp_that_fits_is_named():
    """Llama-3.1-70B in bf16 (131 GiB of weights) fits no single GPU: the plan names the
    smallest of tp 2, 4, 8 that fits each GPU (its heads divide them)."""
    spec, trace = load_model_spec("Llama-3.1-70B"), _trace(2)
    h100 = plan_gpu(spec, trace, find_gpu("H100"), 1, PlanSettings())
    assert h100.memory is None and h100.fits_at_tp == 2
    assert plan_gpu(spec, trace, find_gpu("4090"), 2, PlanSettings()).fits_at_tp == 8
    assert plan_gpu(spec, trace, find_gpu("H100"), 2, PlanSettings()).fits_at_tp is None  # fits
    from capacity.report import tp_note

    assert tp_note(h100) == "Smallest TP that fits: 2."
    # 405B-class weights fit no node of 4090s: said so.
    huge = plan_gpu(spec, trace, find_gpu("4090"), 1, PlanSettings(dtype="fp32"))
    assert huge.fits_at_tp is None and tp_note(huge) == "No TP of 2, 4, 8 fits either."


def test_nothing_fits_names_the_tp_that_would(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, _trace(2))
    args = ["capacity", "report", "--model", "Llama-3.1-70B", "--trace", str(trace)]
    result = CliRunner().invoke(app, [*args, "--gpus", "H100", "-o", str(tmp_path / "r.html")])
    assert result.exit_code == 1
    assert "H100-SXM tp 1:" in result.output and "Smallest TP that fits: 2." in result.output
    assert "**Smallest TP that fits: 2.**" in (tmp_path / "r.md").read_text()


def test_report_shows_kv_per_token_assumptions_and_throughputs(tmp_path):
    """The memory table gives KV bytes per token; "What the times assume" the plan's
    coefficients (efficiencies against the datasheet peaks, per-step and per-row costs) and the
    memory overheads; the batch table total tokens/s and requests/s."""
    from capacity.report import assumptions, requests_per_s, total_tokens_per_s

    spec = load_model_spec("Llama-3.1-8B")
    settings = PlanSettings(max_num_seqs=64, max_num_batched_tokens=2048)
    report = build_report(spec, _trace(), "t", [find_gpu("H100")], [1], settings)
    render(report, tmp_path / "plan.html")
    md, html = (tmp_path / "plan.md").read_text(), (tmp_path / "plan.html").read_text()
    (plan,) = report.plans
    assert plan.memory.kv_bytes_per_token == 128 * 1024
    assert f"| {plan.memory.num_blocks} |" in md and "| 128 |" in md and "KV KiB/token" in html
    a = assumptions(plan)
    compute, memory = plan.coefficients.efficiencies(plan.hardware)
    assert (a["compute_efficiency"], a["memory_efficiency"]) == (compute, memory)
    assert a["t_step_s"] == plan.coefficients.t_step and a["t_row_s"] == plan.coefficients.t_row
    assert plan.hardware.flops_per_s == 989e12 and plan.hardware.bytes_per_s == 3350e9
    row = f"| H100-SXM | 1 | {compute * 100:.0f}% |"
    assert "## What the times assume" in md and row in md and "What the times assume" in html
    assert "non-torch memory 0.25 GiB" in md and "| H100-SXM | 1 | 0.25 | 0.00 | 0.88 |" in md
    total, rps = total_tokens_per_s(plan), requests_per_s(plan)
    assert total == pytest.approx(
        sum(r.input_length + r.output_length for r in _trace()) / plan.sim.makespan_s
    )
    assert rps == pytest.approx(len(_trace()) / plan.sim.makespan_s)
    assert f"| {total:.0f} | {rps:.2f} |" in md
    # fp8 weights: the GEMM efficiency is of the fp8 peak
    fp8 = plan_gpu(spec, _trace(), find_gpu("H100"), 1, PlanSettings(dtype="fp8"))
    assert fp8.hardware.flops_per_s == 1979e12


def test_json_has_every_table(tmp_path):
    """--json: per plan the memory table (KV bytes per token, overheads item by item, the GPU's
    CUDA memory and its source, warnings), the assumptions, the batch table and the cost table,
    and for a plan that does not fit, the tp that would."""
    import json

    trace = tmp_path / "t.jsonl"
    write_trace(trace, _trace(2))
    data = tmp_path / "r.json"
    args = ["capacity", "report", "--model", "Llama-3.1-70B", "--trace", str(trace)]
    args += ["--gpus", "H100", "--tp", "1,2", "--deadline", "1h", "--api-price-per-mtok", "1,2"]
    result = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "r.html"), "--json", data])
    assert result.exit_code == 0, result.output
    report = json.loads(data.read_text())
    one, two = report["plans"]
    assert one["error"] and one["fits_at_tp"] == 2 and "memory" not in one
    assert two["gpu_memory"] == {
        "datasheet_gb": 80,
        "cuda_bytes": 81091 * 2**20,
        "basis": find_gpu("H100").memory_basis,
    }
    memory = two["memory"]
    assert memory["kv_bytes_per_token"] == 2 * 80 * 4 * 128 * 2
    assert set(memory["overheads"]) == {"non_torch_bytes", "nccl_bytes", "cuda_graph_bytes"}
    assert memory["warnings"] == [] and memory["cuda_context_bytes"] == round(0.51 * 2**30)
    assert set(two["assumptions"]) >= {"compute_efficiency", "memory_efficiency", "t_step_s"}
    for key in ("meets_deadline", "price_per_gpu_hour_usd", "total_tokens_per_s", "requests_per_s"):
        assert key in two
    assert report["api_cost_per_month_usd"] == pytest.approx(30 * report["api_cost_per_night_usd"])
    assert report["memory_constants"]["non_torch_bytes"] == round(0.25 * 2**30)
    from capacity.planner import request_lengths

    assert report["request_length_tokens"] == request_lengths(_trace(2))
