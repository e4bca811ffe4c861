"""The published-results validation: cases read and checked, each simulated as it was run, the
fast re-timing of a recorded schedule equal to a fresh simulation, and a fit that recovers a
table from cases it generated itself."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from capacity.efficiency import DEFAULTS, Efficiency, get, load_table, with_values
from capacity.gpus import find_gpu
from capacity.model_specs import load_model_spec
from capacity.published import (
    PUBLISHED_PATH,
    build_run,
    engine_of,
    fit_request_cost,
    fit_table,
    free_parameters,
    load_cases,
    predict,
    trtllm_bench_settings,
    vllm_defaults,
)
from nightshift.cli import app
from workload.input_file import BadInputFile

BASE = {
    "id": "x",
    "source": "test",
    "url": "https://example.org",
    "engine": "vLLM",
    "engine_version": "0.10.0",
    "model": "Llama-3.1-8B",
    "planner_gpu": "H100-SXM",
    "tp": 1,
    "dtype": "bf16",
    "input_len": 256,
    "output_len": 32,
    "num_requests": 24,
    "mode": "batch",
    "metric": "output_tokens_per_s",
    "value": 1000.0,
}


def _write(tmp_path, records):
    path = tmp_path / "cases.jsonl"
    path.write_text("".join(json.dumps({**BASE, **r}) + "\n" for r in records))
    return path


def test_bundled_cases_load_with_sources():
    cases, skipped = load_cases(PUBLISHED_PATH)
    assert len(cases) >= 12
    assert len({c.source.split(",")[0] for c in cases}) >= 3
    assert all(c.url.startswith("https://") for c in cases)
    assert sum(c.complete for c in cases) >= 12
    assert all(s.reason for s in skipped)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mode": "burst"}, "mode must be one of"),
        ({"metric": "speed"}, "metric must be one of"),
        ({"value": 0}, "value must be positive"),
        ({"mode": "concurrency"}, "needs concurrency"),
        ({"input_len": "long"}, "input_len"),
    ],
)
def test_bad_case_names_line_and_problem(tmp_path, change, message):
    path = _write(tmp_path, [{}, {**change, "id": "y"}])
    with pytest.raises(BadInputFile, match=message) as info:
        load_cases(path)
    assert ":2" in str(info.value)


def test_duplicate_ids_refused(tmp_path):
    with pytest.raises(BadInputFile, match="appears twice"):
        load_cases(_write(tmp_path, [{}, {}]))


def test_unpinned_gpu_is_skipped_with_reason(tmp_path):
    cases, skipped = load_cases(_write(tmp_path, [{}, {"id": "y", "planner_gpu": None}]))
    assert [c.id for c in cases] == ["x"] and skipped[0].id == "y"
    assert "GPU" in skipped[0].reason


def test_vllm_defaults_follow_version_and_gpu(tmp_path):
    cases, _ = load_cases(_write(tmp_path, [{}]))
    case = cases[0]
    h100, a100 = find_gpu("H100"), find_gpu("A100-80GB")
    assert vllm_defaults(case, h100) == (1024, 16384)
    assert vllm_defaults(case, a100) == (256, 8192)
    served = replace(case, mode="concurrency", concurrency=8, served=True)
    assert vllm_defaults(served, h100) == (1024, 8192)
    assert vllm_defaults(replace(case, engine_version="0.8.4"), h100) == (256, 8192)
    old = replace(case, engine_version="0.6.3")
    assert vllm_defaults(old, h100) == (256, 2048)


def test_a_batch_sent_over_http_is_served(tmp_path):
    """A batch a benchmark client sent to `vllm serve` (GPUStack's 1000 prompts at once) runs
    with the server's defaults (8192 batched tokens on an H100, not the LLM class's 16384) and
    through the HTTP front end: at least t_request_http per request."""
    records = [{"num_requests": 200, "input_len": 128, "output_len": 4}]
    records.append({**records[0], "id": "y", "served": True})
    (offline, served), _ = load_cases(_write(tmp_path, records))
    assert not offline.served and served.served
    h100 = find_gpu("H100")
    assert vllm_defaults(offline, h100) == (1024, 16384)
    assert vllm_defaults(served, h100) == (1024, 8192)
    table = with_values(DEFAULTS, {"t_request_http": 0.05})
    fast, slow = build_run(offline, table), build_run(served, table)
    assert predict(slow, table) == pytest.approx(200 * 4 / (200 * 0.05), rel=0.05)
    assert predict(fast, table) > 3 * predict(slow, table)
    quicker = with_values(table, {"t_request_http": 0.02})
    assert predict(build_run(served, quicker), quicker) > 2 * predict(slow, table)
    cases, _ = load_cases(_write(tmp_path, [{"mode": "concurrency", "concurrency": 4}]))
    assert cases[0].served  # online modes are a client's


def test_vllm_before_0_8_is_its_own_engine_for_fixed_costs(tmp_path):
    cases, _ = load_cases(_write(tmp_path, [{}, {"id": "y", "engine_version": "0.6.3"}]))
    assert [engine_of(c) for c in cases] == ["vllm", "vllm-v0"]
    table = replace(DEFAULTS, t_layer=1e-4, engine_overheads={"vllm-v0": 2.0})
    h100 = find_gpu("H100")
    v1 = table.coefficients(h100, "bf16", 1, engine_of(cases[0]))
    v0 = table.coefficients(h100, "bf16", 1, engine_of(cases[1]))
    assert v0.t_layer == pytest.approx(2 * v1.t_layer) and v0.t_step == pytest.approx(2 * v1.t_step)
    assert v0.k_compute == v1.k_compute  # the same kernels


def test_trtllm_bench_settings_follow_its_tuning_heuristic(tmp_path):
    # trtllm-bench build --dataset: requests of ISL + OSL that 95% of the memory beside the
    # weights holds as KV (8.03e9 fp8 parameters, 79.19 GiB, 64 KiB of fp8 KV per token), capped
    # at 4096 and rounded up; tokens = batch x (1 + ISL / OSL), at least 2048, rounded up.
    fp8 = {"engine": "TensorRT-LLM", "engine_version": "0.14.0", "dtype": "fp8"}
    records = [
        {**fp8, "id": "a", "kv_cache_dtype": "fp8", "input_len": 1000, "output_len": 1000},
        {**fp8, "id": "b", "kv_cache_dtype": "fp8", "input_len": 2048, "output_len": 128},
        {**fp8, "id": "c", "kv_cache_dtype": "fp8", "input_len": 128, "output_len": 128},
        {**fp8, "id": "d", "input_len": 1000, "output_len": 1000},  # 16-bit KV: half the batch
    ]
    cases, _ = load_cases(_write(tmp_path, records))
    spec, h100 = load_model_spec("Llama-3.1-8B"), find_gpu("H100-SXM")
    got = [trtllm_bench_settings(c, spec, h100) for c in cases]
    assert got == [(640, 2048), (512, 9216), (4096, 8192), (384, 2048)]


def test_trtllm_cases_simulate_with_its_settings_and_no_eviction(tmp_path):
    record = {"engine": "TensorRT-LLM", "engine_version": "0.14.0", "num_requests": 40}
    cases, _ = load_cases(_write(tmp_path, [record]))
    run = build_run(cases[0], DEFAULTS)
    spec = load_model_spec("Llama-3.1-8B")
    seqs, tokens = trtllm_bench_settings(cases[0], spec, find_gpu("H100-SXM"))
    assert run.max_num_batched_tokens == tokens
    assert run.max_num_seqs <= min(seqs, run.num_blocks * 16 // (256 + 32))


OTHER = with_values(
    DEFAULTS,
    {"hopper.gemm": 0.45, "hopper.memory": 0.6, "hopper.t_step": 0.002, "t_row": 1e-5},
)


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"mode": "concurrency", "concurrency": 4, "metric": "mean_tpot_ms"},
        {"metric": "mean_ttft_ms", "mode": "concurrency", "concurrency": 6},
        {"mode": "single", "metric": "tokens_per_s_single"},
        {"metric": "mean_batch_latency_ms", "concurrency": 8},
        {"tp": 2, "metric": "total_tokens_per_s"},
    ],
)
def test_retimed_schedule_equals_a_fresh_simulation(tmp_path, change):
    # The fit re-times a recorded schedule under other coefficients; a new simulation under those
    # coefficients must give the same figure (batch and closed-loop schedules do not depend on
    # step times).
    cases, _ = load_cases(_write(tmp_path, [change]))
    recorded = build_run(cases[0], DEFAULTS)
    fresh = build_run(cases[0], OTHER)
    assert predict(recorded, OTHER) == pytest.approx(predict(fresh, OTHER), rel=1e-9)
    assert predict(recorded, OTHER) != pytest.approx(predict(recorded, DEFAULTS), rel=1e-3)


def test_fit_recovers_a_table_from_its_own_predictions(tmp_path):
    # Cases whose "published" figures the model itself produced under a known table: the fit,
    # started from the defaults, must find parameters that reproduce the figures.
    truth = with_values(
        DEFAULTS, {"hopper.gemm": 0.7, "hopper.memory": 0.85, "hopper.t_step": 0.0015}
    )
    shapes = [
        {"input_len": 1024, "output_len": 8, "num_requests": 64},  # prefill: compute
        {"input_len": 64, "output_len": 128, "num_requests": 8},  # small decode: memory
        {
            "input_len": 16,
            "output_len": 64,
            "num_requests": 1,
            "mode": "single",
            "metric": "tokens_per_s_single",
        },  # fmt: skip
        {"input_len": 512, "output_len": 64, "num_requests": 96},
    ]
    records = [{**s, "id": f"c{i}"} for i, s in enumerate(shapes)]
    cases, _ = load_cases(_write(tmp_path, records))
    runs = [build_run(c, DEFAULTS) for c in cases]
    for run in runs:
        run.case = replace(run.case, value=predict(run, truth))
    train = [r for r in runs if not r.case.held_out]
    assert train, "the ids chosen put every case in the held-out split"
    fitted = fit_table(runs, rounds=1).table
    for run in train:
        assert predict(run, fitted) == pytest.approx(run.case.value, rel=0.03)
    before = [abs(predict(r, DEFAULTS) / r.case.value - 1) for r in train]
    assert max(before) > 0.05  # the defaults were wrong: the fit had something to find


def test_committed_table_loads_and_names_its_cases():
    table = load_table()
    assert table.fitted_on, "capacity/data/efficiency.json lists the cases it was fitted on"
    cases, _ = load_cases(PUBLISHED_PATH)
    held_out = {c.id for c in cases if c.held_out}
    assert held_out and not held_out & set(table.fitted_on)
    for eff in table.generations.values():
        assert isinstance(eff, Efficiency) and 0 < eff.gemm <= 1 and 0 < eff.memory <= 1


def test_validate_published_cli(tmp_path):
    path = _write(
        tmp_path,
        [{"id": "a"}, {"id": "b", "mode": "concurrency", "concurrency": 4, "value": 300.0}],
    )
    out, fit = tmp_path / "v.json", tmp_path / "eff.json"
    result = CliRunner().invoke(
        app,
        [
            "capacity",
            "validate",
            "--published",
            "--cases",
            str(path),
            "--fit",
            str(fit),
            "--jobs",
            "2",  # two worker processes: the cases come back in order, each built once
            "-o",
            str(out),
        ],  # fmt: skip
    )
    assert result.exit_code == 0, result.output
    assert "MAE" in result.output and "published" in result.output
    data = json.loads(out.read_text())
    assert {row["id"] for row in data["cases"]} == {"a", "b"}
    assert data["summary"]["all"]["cases"] == 2
    assert load_table(fit).fitted_on
    again = CliRunner().invoke(
        app,
        [
            "capacity",
            "validate",
            "--published",
            "--cases",
            str(path),
            "--table",
            str(fit),
            "-o",
            str(out),
        ],  # fmt: skip
    )
    assert again.exit_code == 0, again.output


def test_validate_without_traces_or_published_is_a_usage_error():
    result = CliRunner().invoke(app, ["capacity", "validate"])
    assert result.exit_code == 2
    assert "--train" in result.output


def test_the_front_end_cost_is_found_where_it_binds(tmp_path):
    """fit_request_cost finds the per-request cost a front-end-bound served batch was generated
    with (a local search started where it does not bind would never move it), and leaves a table
    alone without served training cases."""
    records = [{"num_requests": 300, "input_len": 64, "output_len": 2, "served": True, "id": id_}
               for id_ in ("a", "b", "c", "d")]  # fmt: skip
    cases, _ = load_cases(_write(tmp_path, records))
    truth = with_values(DEFAULTS, {"t_request_http": 0.03})
    runs = [build_run(c, DEFAULTS) for c in cases]
    for run in runs:
        run.case = replace(run.case, value=predict(run, truth))
    assert any(not r.case.held_out for r in runs)
    found = fit_request_cost(runs, DEFAULTS).t_request_http
    assert found == pytest.approx(0.03, rel=0.07)
    offline = [replace(r, case=replace(r.case, served=False)) for r in runs]
    assert fit_request_cost(offline, DEFAULTS) is DEFAULTS


def test_a_chat_template_is_prefilled_but_not_counted(tmp_path):
    """A client of the chat endpoint sends messages: the server's chat template adds tokens the
    engine prefills (GPUStack's Qwen3 runs: 8 per prompt), which the source's counts leave out."""
    records = [{"served": True}, {"id": "y", "served": True, "chat_template_tokens": 8}]
    records = [{**r, "metric": "total_tokens_per_s", "num_requests": 6} for r in records]
    plain, chat = load_cases(_write(tmp_path, records))[0]
    assert (plain.chat_template_tokens, chat.chat_template_tokens) == (0, 8)
    runs = [build_run(c, DEFAULTS) for c in (plain, chat)]
    prefilled = [sum(s.num_batched_tokens for s in r.shapes) for r in runs]
    assert prefilled[1] - prefilled[0] == 6 * 8
    # The figure counts the client's tokens over a longer run: lower, not inflated by the 8.
    assert predict(runs[1], DEFAULTS) < predict(runs[0], DEFAULTS)
    with pytest.raises(BadInputFile, match="chat_template_tokens"):
        load_cases(_write(tmp_path, [{"chat_template_tokens": -1}]))


def test_free_parameters_split_an_engine_by_generation_only_beside_vllm(tmp_path):
    small = {"input_len": 16, "output_len": 4, "num_requests": 2}
    records = [
        {**small, "id": "vllm-h100"},
        {**small, "id": "trt-h100", "engine": "TensorRT-LLM", "engine_version": "0.14.0"},
        {**small, "id": "trt-l40s", "engine": "TensorRT-LLM", "planner_gpu": "L40S"},
        {**small, "id": "trt-a100-tp2", "engine": "TensorRT-LLM", "planner_gpu": "A100-80GB",
         "tp": 2},
    ]  # fmt: skip
    cases, _ = load_cases(_write(tmp_path, records))
    names = free_parameters([build_run(c, DEFAULTS) for c in cases])
    # vLLM ran on Hopper: TensorRT-LLM's factor there is its own; on Ada and Ampere (no vLLM
    # case) the generation's fractions already are TensorRT-LLM's, so one plain factor.
    assert "engine:tensorrt-llm/hopper" in names and "engine:tensorrt-llm" in names
    assert not any(n.startswith("engine:tensorrt-llm/a") for n in names)
    # TP over NVLink ran on Ampere only: its share is Ampere's, no shared one to fit.
    assert "ampere.link" in names and "hopper.link" not in names and "link" not in names


def test_an_engine_fitted_per_generation_keeps_a_plain_factor_it_fitted():
    from capacity.published import _engine_means

    table = with_values(
        DEFAULTS,
        {"engine:tensorrt-llm/hopper": 2.0, "engine:tensorrt-llm/ampere": 0.5,
         "engine:tensorrt-llm": 1.7, "engine_overhead:tensorrt-llm/hopper": 0.8},
    )  # fmt: skip
    names = ["engine:tensorrt-llm/hopper", "engine:tensorrt-llm/ampere", "engine:tensorrt-llm",
             "engine_overhead:tensorrt-llm/hopper"]  # fmt: skip
    means = _engine_means(table, names)
    assert means.engines["tensorrt-llm"] == 1.7  # fitted itself (L40S, no vLLM beside it)
    assert means.engine_overheads["tensorrt-llm"] == pytest.approx(0.8)  # the mean of one
    assert _engine_means(table, names[:2]).engines["tensorrt-llm"] == pytest.approx(1.0)


def test_a_fit_of_some_parameters_keeps_the_others(tmp_path):
    """fit_table(only=...): the named terms move to fit, every other keeps the start's value
    (a model change that touches a few terms is refitted without the full search)."""
    truth = with_values(DEFAULTS, {"hopper.memory": 0.6})
    records = [{"input_len": 64, "output_len": 128, "num_requests": 8, "id": f"m{i}"}
               for i in range(4)]  # fmt: skip
    cases, _ = load_cases(_write(tmp_path, records))
    runs = [build_run(c, DEFAULTS) for c in cases]
    for run in runs:
        run.case = replace(run.case, value=predict(run, truth))
    fitted = fit_table(runs, DEFAULTS, rounds=1, only=("hopper.memory",)).table
    assert get(fitted, "hopper.memory") == pytest.approx(0.6, rel=0.05)
    for name in ("hopper.gemm", "hopper.t_step", "t_layer", "roofline_p", "fp8_gemm"):
        assert get(fitted, name) == get(DEFAULTS, name), name
    with pytest.raises(ValueError, match="not a free parameter of these cases: link_pcie"):
        fit_table(runs, DEFAULTS, rounds=1, only=("link_pcie",))  # no TP case over PCIe


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fit-only", "hopper.memory"], "--fit-only needs --fit"),
        (["--fit", "F", "--fit-only", " , "], "no parameter names"),
        (["--fit", "F", "--fit-only", "hopper.memroy,volta.gemm"], "hopper.memroy, volta.gemm"),
    ],
)
def test_fit_only_is_checked_before_any_simulation(tmp_path, args, message):
    path = _write(tmp_path, [{"id": "a"}])
    args = [str(tmp_path / "eff.json") if a == "F" else a for a in args]
    result = CliRunner().invoke(
        app, ["capacity", "validate", "--published", "--cases", str(path), *args,
              "-o", str(tmp_path / "v.json")],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "v.json").exists()
