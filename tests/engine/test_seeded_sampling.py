"""A seeded request samples the same tokens whatever else runs with it: alone, in batches in any
order, with chunked prefill, under preemption, and whatever the engine's own seed."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.engine.tiny_models import build_tiny_model

MAX_TOKENS = 32
VOCAB = 384
SEEDED = SamplingParams(
    temperature=0.8, top_p=0.9, seed=123, max_tokens=MAX_TOKENS, ignore_eos=True
)
PROMPT = [random.Random(0).randrange(2, VOCAB) for _ in range(37)]


def _others(rng: random.Random) -> list[tuple[list[int], SamplingParams]]:
    """Seven other requests: unseeded, other seeds, greedy; short and long prompts (one shares a
    prefix with PROMPT, so prefix hits happen)."""
    kinds = [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 20},
        {"temperature": 0.8, "top_p": 0.9, "seed": 1},
        {"temperature": 0.8, "top_p": 0.9, "seed": 124},
        {"temperature": 1.2, "min_p": 0.05, "seed": 99},
        {"temperature": 0.0},
        {"temperature": 1.0, "presence_penalty": 0.5},
    ]
    out = []
    for i, kw in enumerate(kinds):
        n = rng.choice([1, 5, 18, 40, 70])
        prompt = [rng.randrange(2, VOCAB) for _ in range(n)]
        if i == 1:
            prompt = PROMPT[:32] + prompt
        out.append(
            (prompt, SamplingParams(max_tokens=rng.randint(4, MAX_TOKENS), ignore_eos=True, **kw))
        )
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-seeded"))


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(model=str(model_dir), max_model_len=256, block_size=16, **kwargs)


@pytest.fixture(scope="module")
def llm(model_dir):
    return _llm(model_dir)


@pytest.fixture(scope="module")
def alone(llm):
    tokens = llm.generate([PROMPT], SEEDED)[0].outputs[0].token_ids
    assert len(tokens) == MAX_TOKENS
    return tokens


def _in_batch(llm: LLM, order_seed: int) -> list[int]:
    rng = random.Random(order_seed)
    batch = _others(rng) + [(PROMPT, SEEDED)]
    rng.shuffle(batch)
    outs = llm.generate([p for p, _ in batch], [sp for _, sp in batch])
    index = next(i for i, (_, sp) in enumerate(batch) if sp is SEEDED)
    return outs[index].outputs[0].token_ids


def test_seeded_alone_is_reproducible(llm, alone):
    assert llm.generate([PROMPT], SEEDED)[0].outputs[0].token_ids == alone


@pytest.mark.parametrize("order_seed", [0, 1, 2])
def test_seeded_in_batch_matches_alone(llm, alone, order_seed):
    assert _in_batch(llm, order_seed) == alone


@pytest.mark.parametrize(
    "config",
    [
        {"max_num_batched_tokens": 8},  # chunked prefill, mixed with decodes
        {"max_num_batched_tokens": 24, "enable_prefix_caching": False},
        {"num_kv_blocks": 12, "max_num_seqs": 8},  # preemption
        {"seed": 987},  # a different engine seed: only unseeded requests change
    ],
    ids=["chunked", "chunked-no-prefix-cache", "preempt", "engine-seed"],
)
def test_seeded_matches_alone_under_other_configs(model_dir, alone, config):
    llm = _llm(model_dir, **config)
    assert llm.generate([PROMPT], SEEDED)[0].outputs[0].token_ids == alone
    assert _in_batch(llm, 3) == alone
    if "num_kv_blocks" in config:
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_different_seeds_differ(llm, alone):
    outputs = [alone]
    for seed in (124, 7, 2**40):
        params = SamplingParams(
            temperature=0.8, top_p=0.9, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True
        )
        outputs.append(llm.generate([PROMPT], params)[0].outputs[0].token_ids)
    assert len({tuple(o) for o in outputs}) == len(outputs)


def test_unseeded_requests_vary(llm):
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    second = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    assert first != second


def test_n_with_seed_is_reproducible(model_dir, llm):
    params = SamplingParams(
        n=3, temperature=0.8, top_p=0.9, seed=123, max_tokens=MAX_TOKENS, ignore_eos=True
    )
    first = [c.token_ids for c in llm.generate([PROMPT], params)[0].outputs]
    assert len(first) == 3 and all(len(c) == MAX_TOKENS for c in first)
    assert len({tuple(c) for c in first}) == 3  # each sample draws its own stream
    assert [c.token_ids for c in llm.generate([PROMPT], params)[0].outputs] == first
    # In a batch, and on another engine with chunked prefill: the same three completions.
    batch = [p for p, _ in _others(random.Random(5))]
    outs = llm.generate(batch + [PROMPT], [SamplingParams(temperature=1.0)] * len(batch) + [params])
    assert [c.token_ids for c in outs[-1].outputs] == first
    other = _llm(model_dir, max_num_batched_tokens=8, seed=5)
    assert [c.token_ids for c in other.generate([PROMPT], params)[0].outputs] == first
