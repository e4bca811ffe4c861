"""`nightshift bench engine` end to end on a tiny model (structure and counting, not speed)."""

from __future__ import annotations

import json

from engine.bench import BenchConfig, decode_step_bytes, linear_params, run_bench, workload_flops
from engine.models.model_config import load_model_config
from tests.engine.tiny_models import build_tiny_model, load_hf


def test_counts_match_the_checkpoint(tmp_path):
    path = build_tiny_model("qwen2", tmp_path / "m")
    config = load_model_config(path)
    hf = load_hf(path)
    matmul = sum(
        p.numel()
        for name, p in hf.named_parameters()
        if name.endswith("proj.weight") and ".layers." in name
    )
    assert linear_params(config) == matmul
    # One token through the model: 2 FLOPs per matmul weight, the logits, one attention pair.
    h, v = config.hidden_size, config.vocab_size
    pair = 4 * config.num_layers * config.num_heads * config.head_dim
    assert workload_flops(config, 1, 1) == 2 * matmul + pair + 2 * h * v
    assert decode_step_bytes(config, 0) == (matmul + h * v) * 4


def test_bench_runs_both_sides(tmp_path):
    path = build_tiny_model("llama", tmp_path / "m")
    out = tmp_path / "bench.json"
    cfg = BenchConfig(
        model=str(path),
        num_prompts=3,
        max_batch=2,
        max_num_batched_tokens=32,
        input_range=(10, 20),
        output_range=(2, 5),
        batch1_prompt=20,
        batch1_output=4,
        batch1_repeats=2,
        json_out=str(out),
    )
    lines: list[str] = []
    report = run_bench(cfg, echo=lines.append)
    assert json.loads(out.read_text())["mixed"]["speedup"] == report["mixed"]["speedup"]
    mixed = report["mixed"]
    assert mixed["engine"]["output_tokens"] == mixed["hf"]["output_tokens"]
    assert 0 < mixed["engine_flop_roofline_fraction"]
    assert len(report["batch1"]["runs"]["engine"]) == 2 == len(report["batch1"]["runs"]["hf"])
    assert any("engine / hf" in line for line in lines)


def test_a_case_longer_than_the_models_context_names_its_option(tmp_path):
    """A 512-token model: the default batch-1 case (400 + 128 tokens) does not fit, and the
    error says how to leave it out, before anything loads."""
    import pytest

    path = build_tiny_model("llama", tmp_path / "m", max_position_embeddings=512)
    small = dict(model=str(path), num_prompts=2, max_batch=2, input_range=(8, 16))
    with pytest.raises(ValueError, match="batch-1 case .* pass --skip-batch1"):
        run_bench(BenchConfig(**small, output_range=(2, 4)), echo=lambda _: None)
    with pytest.raises(ValueError, match="lower --input-max or --output-max"):
        run_bench(BenchConfig(**small, output_range=(2, 600), skip_batch1=True), echo=print)
