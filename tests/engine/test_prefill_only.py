"""Prefill-only requests (max_tokens=0) and pooling requests (embeddings) against HF transformers
(float32): they go through the real scheduler and runner, chunked, batched with generation,
preempted and next to the prefix cache, and finish once their prompt is computed."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine, QueueFullError
from engine.errors import InvalidRequestError
from engine.pooling import PoolingParams
from tests.engine.tiny_models import build_tiny_model, load_hf

TOL = 1e-4
VOCAB = 384  # tiny_models' vocab_size
HIDDEN = 64  # tiny_models' hidden_size
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SCORE = SamplingParams(max_tokens=0, prompt_logprobs=2)


def _prompts(lengths: list[int], seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]


PROMPTS = _prompts([1, 9, 40, 75])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(
        "llama", tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=128
    )


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", device="cpu", block_size=16, **kwargs)


@torch.inference_mode()
def _hf_hidden(hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), hidden]: the final hidden states, after the final norm."""
    return hf.model(torch.tensor([prompt])).last_hidden_state[0].float()


def _hf_embedding(hf, prompt: list[int], params: PoolingParams) -> torch.Tensor:
    hidden = _hf_hidden(hf, prompt)
    vector = hidden[-1] if params.pooling_type == "last" else hidden.mean(dim=0)
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    return F.normalize(vector, dim=0) if params.normalize else vector


def _check_embeddings(hf, prompts, results, params: PoolingParams) -> None:
    for prompt, result in zip(prompts, results):
        # A pooling request is complete once pooled: vLLM's FINISHED_STOPPED.
        assert result.finished and result.outputs[0].finish_reason == "stop"
        assert result.outputs[0].token_ids == []
        got = torch.tensor(result.embedding)
        ref = _hf_embedding(hf, prompt, params)
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, atol=TOL, rtol=0), (got - ref).abs().max()
        if params.normalize:
            assert abs(got.norm().item() - 1.0) < 1e-5


@torch.inference_mode()
def _check_prompt_logprobs(hf, prompt: list[int], got) -> None:
    assert got is not None and len(got) == len(prompt) and got[0] is None
    ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    for pos in range(1, len(prompt)):
        token = prompt[pos]
        assert set(got[pos]) == {token, *ref[pos - 1].topk(2).indices.tolist()}, pos
        for t, value in got[pos].items():
            assert abs(value - ref[pos - 1, t].item()) < TOL, (pos, t)


# ---- max_tokens=0: prompt logprobs, no token ---------------------------------------------------


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(model_dir, hf):
    llm = _llm(model_dir)
    results = llm.generate(PROMPTS, SCORE)
    for prompt, result in zip(PROMPTS, results):
        assert result.finished
        (out,) = result.outputs
        assert (out.text, out.token_ids, out.finish_reason) == ("", [], "length")
        assert out.logprobs is None
        assert result.metrics.first_token_time is None  # nothing was sampled
        _check_prompt_logprobs(hf, prompt, result.prompt_logprobs)
    assert llm.engine.core.kv.stats().num_used == 0
    llm.engine.core.kv.check_integrity()


def test_max_tokens_zero_without_prompt_logprobs(model_dir):
    llm = _llm(model_dir)
    (result,) = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=0, logprobs=3))
    assert result.prompt_logprobs is None
    assert result.outputs[0].token_ids == [] and result.outputs[0].logprobs == []
    assert result.outputs[0].finish_reason == "length"


def test_scoring_batched_with_generation_leaves_generation_unchanged(model_dir, hf):
    """Chunked prefill (16-token budget): scoring and generating requests share steps."""
    alone = [r.outputs[0].token_ids for r in _llm(model_dir).generate(PROMPTS, GREEDY)]
    llm = _llm(model_dir, max_num_batched_tokens=16, enable_prefix_caching=False)
    shared_steps = 0
    schedule = llm.engine.core.scheduler.schedule

    def recording_schedule():
        nonlocal shared_steps
        out = schedule()
        kinds = {s.request.prefill_only for s in out.scheduled}
        shared_steps += kinds == {True, False}
        return out

    llm.engine.core.scheduler.schedule = recording_schedule
    mixed = llm.generate(PROMPTS + PROMPTS, [GREEDY] * len(PROMPTS) + [SCORE] * len(PROMPTS))
    assert shared_steps > 0
    assert [r.outputs[0].token_ids for r in mixed[: len(PROMPTS)]] == alone
    for prompt, result in zip(PROMPTS, mixed[len(PROMPTS) :]):
        _check_prompt_logprobs(hf, prompt, result.prompt_logprobs)
        assert result.outputs[0].token_ids == []


def test_a_cached_prompt_is_still_scored_whole(model_dir, hf):
    llm = _llm(model_dir, enable_prefix_caching=True)
    prompt = PROMPTS[3]
    llm.generate([prompt], GREEDY)  # its blocks are now in the prefix cache
    (plain,) = llm.generate([prompt], SamplingParams(max_tokens=0))
    assert plain.metrics.num_cached_tokens > 0  # a plain prefill-only request does hit it
    (scored,) = llm.generate([prompt], SCORE)
    assert scored.metrics.num_cached_tokens == 0
    _check_prompt_logprobs(hf, prompt, scored.prompt_logprobs)
    llm.engine.core.kv.check_integrity()


def test_a_prefill_only_prompt_may_fill_the_context(model_dir):
    llm = _llm(model_dir)
    full = [5] * 128  # max_model_len: no room is kept for an output token
    (result,) = llm.generate([full], SamplingParams(max_tokens=0))
    assert result.outputs[0].finish_reason == "length"
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([full + [5]], SamplingParams(max_tokens=0))
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError):  # one output token does not fit any more
        llm.generate([full], SamplingParams(max_tokens=1))


# ---- pooling ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        PoolingParams(),
        PoolingParams("mean"),
        PoolingParams("last", normalize=False),
        PoolingParams("mean", normalize=False),
        PoolingParams("last", dimensions=8),
        PoolingParams("mean", dimensions=HIDDEN),
    ],
    ids=["last", "mean", "last-raw", "mean-raw", "last-d8", "mean-d64"],
)
def test_embeddings_match_hf_hidden_states(model_dir, hf, params):
    results = _llm(model_dir).embed(PROMPTS, params)
    _check_embeddings(hf, PROMPTS, results, params)


def test_default_pooling_is_the_normalized_last_token(model_dir, hf):
    results = _llm(model_dir).embed(PROMPTS[1:3])
    _check_embeddings(hf, PROMPTS[1:3], results, PoolingParams("last", normalize=True))


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_embeddings_chunked_and_batched_with_generation(model_dir, hf, pooling_type):
    params = PoolingParams(pooling_type)
    alone = [r.outputs[0].token_ids for r in _llm(model_dir).generate(PROMPTS, GREEDY)]
    llm = _llm(model_dir, max_num_batched_tokens=16)
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"gen-{i}", p, GREEDY)
        engine.add_request(f"emb-{i}", p, SamplingParams(max_tokens=0), pooling=params)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert [finals[f"gen-{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == alone
    assert all(finals[f"gen-{i}"].embedding is None for i in range(len(PROMPTS)))
    embedded = [finals[f"emb-{i}"] for i in range(len(PROMPTS))]
    _check_embeddings(hf, PROMPTS, embedded, params)
    engine.core.kv.check_integrity()
    assert engine.core.kv.stats().num_used == 0


def test_cached_prompts_keep_their_hidden_states(model_dir, hf):
    """ "last" may use the prefix cache (the last position is always computed); "mean" needs
    every position, so it never takes a hit."""
    llm = _llm(model_dir, enable_prefix_caching=True)
    prompts = PROMPTS[2:]
    llm.generate(prompts, GREEDY)
    for params in (PoolingParams("last"), PoolingParams("mean")):
        results = llm.embed(prompts, params)
        cached = [r.metrics.num_cached_tokens for r in results]
        assert all(c > 0 for c in cached) if params.pooling_type == "last" else cached == [0, 0]
        _check_embeddings(hf, prompts, results, params)
    llm.engine.core.kv.check_integrity()


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_preempted_pooling_requests_are_recomputed_whole(model_dir, hf, pooling_type):
    """Two decodes that grow into an 8-block pool preempt a long prompt being pooled, again and
    again (its chunks are the latest arrival's); what it pools in the end is still whole."""
    gens = _prompts([16, 16], seed=9)
    pooled = _prompts([90, 80], seed=10)
    llm = _llm(model_dir, num_kv_blocks=8, max_num_batched_tokens=32)
    engine = llm.engine
    long_gen = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(gens):
        engine.add_request(f"g{i}", p, long_gen)
    params = PoolingParams(pooling_type)
    for i, p in enumerate(pooled):
        engine.add_request(f"p{i}", p, SamplingParams(max_tokens=0), pooling=params)
    first = engine.core.requests["p0"]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert first.num_preemptions > 0
    _check_embeddings(hf, pooled, [finals["p0"], finals["p1"]], params)
    alone = _llm(model_dir).generate(gens, long_gen)
    assert [finals[f"g{i}"].outputs[0].token_ids for i in range(2)] == [
        r.outputs[0].token_ids for r in alone
    ]
    engine.core.kv.check_integrity()
    assert engine.core.kv.stats().num_used == 0


@pytest.mark.parametrize(
    "make, param",
    [
        (lambda: PoolingParams("cls"), "pooling_type"),
        (lambda: PoolingParams(dimensions=0), "dimensions"),
        (lambda: PoolingParams(dimensions=True), "dimensions"),
        (lambda: PoolingParams(normalize="yes"), "normalize"),
    ],
)
def test_bad_pooling_params_name_their_field(make, param):
    with pytest.raises(InvalidRequestError) as info:
        make()
    assert info.value.param == param


def test_pooling_requests_the_engine_refuses(model_dir):
    llm = _llm(model_dir)
    with pytest.raises(InvalidRequestError) as info:
        llm.embed([PROMPTS[1]], PoolingParams(dimensions=HIDDEN + 1))
    assert info.value.param == "dimensions" and str(HIDDEN) in str(info.value)
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="max_tokens=0"):
        engine.add_request("a", PROMPTS[1], SamplingParams(max_tokens=2), pooling=PoolingParams())
    with pytest.raises(InvalidRequestError, match="n must be 1"):
        params = SamplingParams(max_tokens=0, n=2)
        engine.add_request("b", PROMPTS[1], params, pooling=PoolingParams())
    assert not engine.has_unfinished() and engine.core.requests == {}
    # The engine still serves.
    assert llm.embed([PROMPTS[1]])[0].embedding is not None


def test_async_engine_embeds_and_admits_atomically(model_dir, hf):
    engine = AsyncEngine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu"))
    try:
        assert engine.info.hidden_size == HIDDEN

        async def main():
            prompts = [(f"e{i}", p, None) for i, p in enumerate(PROMPTS[1:])]
            params = SamplingParams(max_tokens=0)
            with pytest.raises(QueueFullError):  # 3 inputs over a limit of 2: none admitted
                engine.submit_many(prompts, params, max_waiting=2, pooling=PoolingParams())
            assert engine.num_waiting == 0
            streams = engine.submit_many(prompts, params, max_waiting=3, pooling=PoolingParams())
            finals = []
            for s in streams:
                async for out in s:
                    final = out
                finals.append(final)
            return finals

        finals = asyncio.run(main())
        _check_embeddings(hf, PROMPTS[1:], finals, PoolingParams())
    finally:
        engine.shutdown()


def test_a_failing_pooling_request_fails_alone(model_dir, hf, monkeypatch):
    """Pooling that raises for one request (marked by dimensions=7) fails that request with
    finish_reason "error"; the generation and the other embedding batched with it go on."""
    from engine.pooling import PoolingState

    add = PoolingState.add

    def poisoned(self, first, rows):
        if self.params.dimensions == 7:
            raise RuntimeError("poisoned pooling")
        return add(self, first, rows)

    monkeypatch.setattr(PoolingState, "add", poisoned)
    alone = [r.outputs[0].token_ids for r in _llm(model_dir).generate(PROMPTS[2:], GREEDY)]
    llm = _llm(model_dir, max_num_batched_tokens=32)
    engine = llm.engine
    engine.add_request("gen", PROMPTS[2], GREEDY)
    engine.add_request("bad", PROMPTS[3], SCORE, pooling=PoolingParams(dimensions=7))
    engine.add_request("good", PROMPTS[3], SamplingParams(max_tokens=0), pooling=PoolingParams())
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert "poisoned pooling" in finals["bad"].error
    assert finals["gen"].outputs[0].token_ids == alone[0]
    _check_embeddings(hf, [PROMPTS[3]], [finals["good"]], PoolingParams())
    assert engine.core.requests == {} and engine.core.kv.stats().num_used == 0
    engine.core.kv.check_integrity()
