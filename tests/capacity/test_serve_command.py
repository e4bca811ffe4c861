"""The planner's answer as the engine's command: the flags exist on `nightshift serve` with the
values the plan simulated (tensor parallelism, replicas, deadline settings), and a plan the
engine cannot run yet says why."""

from __future__ import annotations

import json
from dataclasses import replace

import typer
from typer.testing import CliRunner

from capacity.gpus import find_gpu
from capacity.model_specs import load_model_spec
from capacity.planner import PlanSettings, plan_gpu
from capacity.serve_command import serve_command
from capacity.simulate import Speculation
from nightshift.cli import app
from workload.trace import TraceRecord, write_trace


def _trace(papers: int = 6) -> list[TraceRecord]:
    records = []
    for p in range(papers):
        records.append(TraceRecord(0, 400 + 10 * p, 120, [100 + p], kind="summary"))
        records.append(TraceRecord(0, 460 + 10 * p, 300, [100 + p], kind="review"))
    return records


def _parsed(args: list[str]) -> dict:
    """The options `nightshift serve` parses from args (click parses and checks them; nothing
    runs)."""
    assert args[:2] == ["nightshift", "serve"]
    command = typer.main.get_command(app).commands["serve"]
    return command.make_context("serve", list(args[2:])).params


def test_a_tensor_parallel_plan_with_replicas_is_a_serve_command():
    spec, gpu = load_model_spec("Llama-3.1-70B"), find_gpu("H100")
    settings = PlanSettings(
        max_num_seqs=64, max_num_batched_tokens=2048, speculation=Speculation(3, 0.5)
    )
    first = plan_gpu(spec, _trace(), gpu, 4, settings)
    settings = replace(settings, deadline_s=first.sim.makespan_s / 2.5)
    plan = plan_gpu(spec, _trace(), gpu, 4, settings)
    assert plan.replicas >= 3
    command = serve_command(plan, settings, spec.name)
    options = _parsed(command.args)
    assert options["tensor_parallel_size"] == 4
    assert options["data_parallel_size"] == plan.replicas
    assert options["max_num_seqs"] == 64 and options["max_num_batched_tokens"] == 2048
    assert options["max_model_len"] == plan.memory.max_model_len
    assert options["gpu_memory_utilization"] == settings.utilization
    assert options["speculative"] == "ngram" and options["num_speculative_tokens"] == 3
    assert options["dtype"] == "bf16"
    assert command.caveats == []


def test_a_plan_the_engine_cannot_run_yet_says_why():
    spec, gpu = load_model_spec("Llama-3.1-8B"), find_gpu("H100")
    settings = PlanSettings(dtype="fp8", kv_cache_dtype="fp8", max_num_seqs=32)
    plan = plan_gpu(spec, _trace(), gpu, 1, settings)
    command = serve_command(plan, settings, spec.name)
    assert "--dtype" not in command.args and "--tensor-parallel-size" not in command.args
    assert any("fp8 weights" in c for c in command.caveats)
    assert any("KV cache in fp8" in c for c in command.caveats)
    _parsed(command.args)


def test_the_report_prints_the_command(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, _trace())
    out = tmp_path / "plan"
    result = CliRunner().invoke(
        app,
        [
            "capacity",
            "report",
            "--trace",
            str(trace),
            "--model",
            "Llama-3.1-70B",
            "--gpus",
            "H100",
            "--tp",
            "4",
            "-o",
            str(out),
            "--json",
            str(tmp_path / "p.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    markdown = (tmp_path / "plan.md").read_text()
    assert "nightshift serve --model MODEL_DIR/Llama-3.1-70B --tensor-parallel-size 4" in markdown
    plan = json.loads((tmp_path / "p.json").read_text())["plans"][0]
    assert _parsed(plan["serve_command"]["args"])["tensor_parallel_size"] == 4
