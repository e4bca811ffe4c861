"""The engine-settings search and speculative decoding, through the planner and `capacity
report`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from capacity.gpus import find_gpu
from capacity.model_specs import load_model_spec
from capacity.planner import PlanSettings, plan_gpu
from capacity.search import search_settings
from capacity.simulate import Speculation
from nightshift.cli import app
from workload.trace import TraceRecord

SPEC = load_model_spec("Llama-3.1-8B")
TRACE = [TraceRecord(0, 900 + 17 * i, 200 + 7 * i) for i in range(120)]


def test_search_grid_holds_the_asked_point_and_picks_the_best():
    gpu = find_gpu("L4")
    settings = PlanSettings(max_num_seqs=64, max_num_batched_tokens=2048, deadline_s=60)
    result = search_settings(SPEC, TRACE, gpu, 1, settings, seqs=(16, 64), tokens=(2048, 8192))
    assert len(result.points) == 4
    asked = next(p for p in result.points if (p.max_num_seqs, p.max_num_batched_tokens) ==
                 (64, 2048))  # fmt: skip
    direct = plan_gpu(SPEC, TRACE, gpu, 1, settings)
    assert asked.plan.replica_makespan_s == direct.replica_makespan_s
    fitting = [p for p in result.points if p.fits]
    assert result.best is not None
    assert result.best.key() == min(p.key() for p in fitting)
    # 16 sequences batch fewer decodes: slower than 64 on this workload.
    slow = next(p for p in result.points if p.max_num_seqs == 16 and p.fits)
    assert slow.plan.sim.makespan_s > asked.plan.sim.makespan_s


def test_speculation_shortens_the_planned_night():
    gpu = find_gpu("H100")
    plain = plan_gpu(SPEC, TRACE, gpu, 1, PlanSettings())
    spec = plan_gpu(SPEC, TRACE, gpu, 1, PlanSettings(speculation=Speculation(4, 0.5)))
    none = plan_gpu(SPEC, TRACE, gpu, 1, PlanSettings(speculation=Speculation(4, 0.0)))
    assert spec.sim.makespan_s < plain.sim.makespan_s < none.sim.makespan_s
    assert spec.sim.output_tokens == plain.sim.output_tokens


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--speculative-tokens", "4"], "--spec-acceptance"),
        (["--spec-acceptance", "0.5"], "--speculative-tokens"),
        (["--speculative-tokens", "4", "--spec-acceptance", "1.5"], "acceptance rate"),
        (["--speculative-tokens", "-1"], ">= 0"),
    ],
)
def test_bad_speculation_options(tmp_path, args, message):
    result = CliRunner().invoke(
        app,
        [
            "capacity",
            "report",
            "--model",
            "Llama-3.1-8B",
            "--gpus",
            "H100",
            *args,
            "-o",
            str(tmp_path / "r.html"),
        ],  # fmt: skip
    )
    assert result.exit_code == 2
    assert message in result.output


def test_report_with_speculation_and_search(tmp_path):
    out, data = tmp_path / "r.html", tmp_path / "r.json"
    result = CliRunner().invoke(
        app,
        [
            "capacity",
            "report",
            "--model",
            "Llama-3.1-8B",
            "--gpus",
            "L4",
            "--papers",
            "20",
            "--speculative-tokens",
            "4",
            "--spec-acceptance",
            "0.4",
            "--search",
            "-o",
            str(out),
            "--json",
            str(data),
        ],  # fmt: skip
    )
    assert result.exit_code == 0, result.output
    report = json.loads(data.read_text())
    assert report["settings"]["speculation"]["num_tokens"] == 4
    (row,) = report["search"]
    assert row["best"]["max_num_seqs"] in {p["max_num_seqs"] for p in row["grid"]}
    assert len(row["grid"]) == 24
    md = out.with_suffix(".md").read_text()
    assert "Best engine settings" in md and "Speculative decoding: 4 draft tokens" in md


def test_a_deadline_beyond_max_replicas_reports_the_cap_not_a_traceback():
    from capacity.planner import MAX_REPLICAS

    plan = plan_gpu(SPEC, TRACE, find_gpu("L4"), 1, PlanSettings(deadline_s=0.001))
    assert plan.replicas == MAX_REPLICAS
    assert plan.replica_makespan_s > 0.001  # shows as missing the deadline


def test_a_huge_gpu_simulates_only_the_blocks_the_workload_can_use():
    from dataclasses import replace as dc_replace

    gpu = dc_replace(find_gpu("H100"), cuda_memory_mib=5_000_000_000)
    plan = plan_gpu(SPEC, TRACE[:4], gpu, 1, PlanSettings())
    small = plan_gpu(SPEC, TRACE[:4], find_gpu("H100"), 1, PlanSettings())
    assert plan.memory.num_blocks > 1000 * small.memory.num_blocks
    assert plan.sim.makespan_s == pytest.approx(small.sim.makespan_s)
    assert max(u for _, u in plan.sim.kv_usage) < max(u for _, u in small.sim.kv_usage)
