"""Greedy output token-identical to HF transformers, logprobs within 1e-4, for every family,
with prefix caching, forced chunked prefill and forced preemption."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.engine.tiny_models import build_tiny_model, hf_greedy, load_hf

MAX_NEW = 12


def _prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(2, vocab) for _ in range(40)]
    lengths = [1, 3, 17, 33, 50, 64, 90, 130]
    prompts = []
    for i, n in enumerate(lengths):
        tail = [rng.randrange(2, vocab) for _ in range(n)]
        # half of the prompts share a 40-token prefix (2.5 blocks) to exercise prefix hits
        prompts.append(shared + tail if i % 2 else tail)
    return prompts


CASES = [
    ("llama", False),
    ("llama", True),
    ("mistral", False),
    ("qwen2", False),
    ("qwen2", True),
    ("qwen3", False),
    ("qwen3", True),
]
CONFIGS = {
    "prefix": dict(enable_prefix_caching=True),
    "chunked": dict(max_num_batched_tokens=24, enable_prefix_caching=False),
    "preempt": dict(num_kv_blocks=24, max_num_seqs=8),
}


@pytest.fixture(
    scope="module", params=CASES, ids=lambda c: f"{c[0]}-{'tied' if c[1] else 'untied'}"
)
def tiny(request, tmp_path_factory):
    family, tied = request.param
    path = build_tiny_model(family, tmp_path_factory.mktemp(family), tied=tied)
    hf = load_hf(path)
    prompts = _prompts(hf.config.vocab_size)
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    return path, prompts, expected


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_hf(tiny, config):
    path, prompts, expected = tiny
    llm = LLM(model=str(path), block_size=16, **CONFIGS[config])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    # Twice: the second pass hits the prefix cache left by the first.
    for _ in range(2):
        results = llm.generate(prompts, params)
        for result, (tokens, logprobs) in zip(results, expected):
            assert result.outputs[0].token_ids == tokens
            for step, (ours, ref) in enumerate(zip(result.outputs[0].logprobs, logprobs)):
                for token, value in ours.items():
                    assert abs(value - ref[token].item()) < 1e-4, (step, token)
    if config == "preempt":
        assert llm.engine.core.scheduler.num_preemptions > 0
    if config == "prefix":
        assert llm.engine.core.kv.prefix_stats.hit_tokens > 0
    llm.engine.core.kv.check_integrity()
    assert llm.engine.core.kv.stats().num_used == 0
