"""`nightshift bench serve` end to end on a tiny model: a real server process on loopback, the
offline and HTTP sides alternating, the median ratio reported."""

from __future__ import annotations

from engine.server.bench import ServeBenchConfig, run_bench_serve
from tests.engine.tiny_models import build_tiny_model


def test_serve_bench_pairs_offline_and_http(tmp_path):
    model = build_tiny_model("llama", tmp_path / "m")
    cfg = ServeBenchConfig(
        model=str(model),
        num_prompts=4,
        max_batch=4,
        input_range=(8, 16),
        output_range=(4, 8),
        repeats=2,
    )
    report = run_bench_serve(cfg, echo=lambda _: None)
    assert len(report["pairs"]) == 2 and len(report["ratios"]) == 2
    for pair in report["pairs"]:
        # Both sides of a pair produced exactly the requested tokens of the same workload.
        assert pair["offline"]["output_tokens"] == pair["http"]["output_tokens"] > 0
    assert min(report["ratios"]) <= report["ratio"] <= max(report["ratios"])
