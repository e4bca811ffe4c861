"""Prompt logprobs against one HF transformers forward over the whole prompt (float32): every
position, under plain, chunked-prefill and preempting schedules, and never shortened by the prefix
cache."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.tiny_models import build_tiny_model, load_hf

K = 3
TOL = 1e-4
VOCAB = 384  # tiny_models' vocab_size
PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=K)


def _prompts(lengths: list[int], seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]


PROMPTS = _prompts([2, 17, 50, 90])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


@torch.inference_mode()
def _hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the distribution of prompt token i + 1."""
    logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", device="cpu", block_size=16, **kwargs)


def _check_against_hf(hf, prompt: list[int], got, k: int = K) -> None:
    assert got is not None
    assert len(got) == len(prompt)
    assert got[0] is None
    ref = _hf_prompt_logprobs(hf, prompt)
    for pos in range(1, len(prompt)):
        entry, row, token = got[pos], ref[pos - 1], prompt[pos]
        assert token in entry, pos
        assert abs(entry[token] - row[token].item()) < TOL, (pos, entry[token], row[token])
        top_ids = row.topk(k).indices.tolist() if k else []
        assert set(entry) == {token, *top_ids}, (pos, entry, top_ids)
        for t, value in entry.items():
            assert abs(value - row[t].item()) < TOL, (pos, t)


def _check_all(hf, prompts, results, k: int = K) -> None:
    for prompt, result in zip(prompts, results):
        _check_against_hf(hf, prompt, result.prompt_logprobs, k)


def test_prompt_logprobs_match_hf(model_dir, hf):
    results = _llm(model_dir).generate(PROMPTS, PARAMS)
    _check_all(hf, PROMPTS, results)
    for result in results:
        assert len(result.outputs[0].token_ids) == 2


def test_prompt_logprobs_zero_gives_the_prompt_token_only(model_dir, hf):
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    results = _llm(model_dir).generate(PROMPTS, params)
    _check_all(hf, PROMPTS, results, k=0)
    assert all(len(e) == 1 for r in results for e in r.prompt_logprobs[1:])


def test_prompt_logprobs_do_not_change_the_outputs(model_dir):
    llm = _llm(model_dir)
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    without = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, plain)]
    results = llm.generate(PROMPTS, PARAMS)
    assert [r.outputs[0].token_ids for r in results] == without
    assert all(r.prompt_logprobs is None for r in llm.generate(PROMPTS, plain))


def test_chunked_prefill_gives_the_same_prompt_logprobs(model_dir, hf):
    prompts = _prompts([50, 33, 7])
    whole = _llm(model_dir, enable_prefix_caching=False).generate(prompts, PARAMS)
    llm = _llm(model_dir, max_num_batched_tokens=16, enable_prefix_caching=False)
    scheduler = llm.engine.core.scheduler
    schedule = scheduler.schedule
    chunks: list[tuple[int, int]] = []  # (prompt length, tokens) of each scheduled prompt chunk

    def recording_schedule():
        out = schedule()
        chunks.extend(
            (s.request.num_prompt_tokens, s.num_tokens)
            for s in out.scheduled
            if s.request.num_computed_tokens < s.request.num_prompt_tokens
        )
        return out

    scheduler.schedule = recording_schedule
    chunked = llm.generate(prompts, PARAMS)
    # The 50-token prompt really was split over several steps.
    assert len([n for length, n in chunks if length == 50]) >= 4
    assert max(n for _, n in chunks) <= 16
    _check_all(hf, prompts, chunked)
    for a, b in zip(whole, chunked):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for pos, (x, y) in enumerate(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]), 1):
            assert x.keys() == y.keys(), pos
            assert all(abs(x[t] - y[t]) < TOL for t in x), pos


def test_prefix_cache_does_not_skip_prompt_positions(model_dir, hf):
    llm = _llm(model_dir, enable_prefix_caching=True)
    prompt = _prompts([70], seed=5)[0]
    stats = llm.engine.core.kv.prefix_stats
    first = llm.generate([prompt], PARAMS)[0]
    second = llm.generate([prompt], PARAMS)[0]
    _check_against_hf(hf, prompt, first.prompt_logprobs)
    _check_against_hf(hf, prompt, second.prompt_logprobs)
    assert second.prompt_logprobs == first.prompt_logprobs
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    # Control: the same prompt without prompt logprobs does hit the cache, so the requests above
    # had cached blocks to (wrongly) skip.
    hits = stats.hit_tokens
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    assert llm.generate([prompt], plain)[0].metrics.num_cached_tokens > 0
    assert stats.hit_tokens > hits
    # ... and a prompt_logprobs request after a plain one is still complete.
    third = llm.generate([prompt], PARAMS)[0]
    assert third.prompt_logprobs == first.prompt_logprobs
    llm.engine.core.kv.check_integrity()


def test_preemption_recomputes_complete_prompt_logprobs(model_dir, hf):
    prompts = _prompts([40, 45, 30, 50, 35, 42], seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=K)
    llm = _llm(model_dir, num_kv_blocks=12, max_num_seqs=6)
    results = llm.generate(prompts, params)
    assert llm.engine.core.scheduler.num_preemptions > 0
    _check_all(hf, prompts, results)
    llm.engine.core.kv.check_integrity()
    assert llm.engine.core.kv.stats().num_used == 0


def test_one_token_prompt(model_dir):
    result = _llm(model_dir).generate([[7]], PARAMS)[0]
    assert result.prompt_logprobs == [None]
