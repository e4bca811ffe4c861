"""GPU memory sizing pieces that run anywhere: the profiling forward's batch, its temporary KV
pool, the max_model_len check, the captured graph sizes."""

from __future__ import annotations

import pytest

from engine import LLM
from engine.cuda_graphs import graph_batch_sizes
from engine.device_memory import InsufficientMemoryError, _profile_forward, _split, check_fits
from tests.engine.tiny_models import build_tiny_model


def test_split_fills_the_budget_within_limits():
    assert _split(1024, 64, 8191) == [16] * 64
    assert _split(10, 4, 100) == [3, 3, 2, 2]
    assert _split(5000, 2, 1000) == [1000] * 5  # more, shorter prompts when one cannot hold it
    assert sum(_split(777, 5, 200)) == 777


def test_profile_forward_runs_and_reports_its_temporary_pool(tmp_path):
    llm = LLM(model=str(build_tiny_model("llama", tmp_path / "m")), num_kv_blocks=8)
    model = llm.engine.core.executor.model
    cfg = model.config
    temp = _profile_forward(model, 100, 4, 64, block_size=16)
    blocks = sum(-(-n // 16) for n in _split(100, 4, 63))
    assert temp == 2 * cfg.num_layers * blocks * 16 * cfg.num_kv_heads * cfg.head_dim * 4


def test_max_model_len_must_fit_the_pool():
    check_fits(num_blocks=10, block_size=16, max_model_len=160)
    with pytest.raises(InsufficientMemoryError, match="set max_model_len to at most 144"):
        check_fits(num_blocks=9, block_size=16, max_model_len=160)


def test_graph_batch_sizes_follow_vllm():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
