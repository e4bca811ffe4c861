"""A request that makes a step fail ends alone with finish_reason "error"; the requests batched
with it produce exactly what they produce without it, and the engine is left clean."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine
from engine.errors import RequestFailedError
from tests.engine.tiny_models import build_tiny_model

MAX_MODEL_LEN = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)
# The marker of the request that fails: nothing else uses this temperature.
POISON = SamplingParams(temperature=0.77, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60)), list(range(100, 137))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("iso"))


def _llm(model_dir, **options) -> LLM:
    return LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, block_size=16, **options)


def _assert_clean(llm: LLM) -> None:
    core = llm.engine.core
    assert not llm.engine.has_unfinished() and core.requests == {}
    core.kv.check_integrity()
    assert core.kv.stats().num_used == 0


def _poison_sampler(llm: LLM, monkeypatch) -> list[int]:
    """The sampler raises for any batch holding the poisoned request, as the tiny-top_p bug did
    (IndexError deep in top-p); returns a list counting the batches it failed."""
    sampler = llm.engine.core.sampler
    failures: list[int] = []

    def sample(logits, rows, grammar=None):
        if any(row.params.temperature == POISON.temperature for row in rows):
            failures.append(len(rows))
            raise IndexError("index -1 is out of bounds for dimension 1 with size 256")
        return sampler(logits, rows, grammar)

    monkeypatch.setattr(llm.engine.core, "sampler", sample)
    return failures


@pytest.mark.parametrize("max_num_seqs", [2, 8])
def test_a_failing_request_fails_alone(model_dir, monkeypatch, max_num_seqs):
    llm = _llm(model_dir, max_num_seqs=max_num_seqs, max_num_batched_tokens=64)
    params = [GREEDY, SEEDED, GREEDY]
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    failures = _poison_sampler(llm, monkeypatch)
    outs = llm.generate(
        [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2]], [GREEDY, POISON, SEEDED, GREEDY]
    )
    assert failures, "the poisoned request never reached the sampler"
    bad = outs[1]
    assert bad.outputs[0].finish_reason == "error" and bad.finished
    assert "index -1 is out of bounds" in bad.error
    good = [outs[0], outs[2], outs[3]]
    assert [o.error for o in good] == [None, None, None]
    assert [o.outputs[0].token_ids for o in good] == expected
    assert [o.outputs[0].finish_reason for o in good] == ["length"] * 3
    _assert_clean(llm)


def test_a_failing_sample_of_n_fails_its_whole_request(model_dir, monkeypatch):
    llm = _llm(model_dir)
    expected = llm.generate([PROMPTS[1]], GREEDY)[0].outputs[0].token_ids
    _poison_sampler(llm, monkeypatch)
    n = SamplingParams(temperature=0.77, n=3, max_tokens=5, ignore_eos=True)
    bad, good = llm.generate([PROMPTS[0], PROMPTS[1]], [n, GREEDY])
    assert [o.finish_reason for o in bad.outputs] == ["error"] * 3
    assert good.outputs[0].token_ids == expected
    _assert_clean(llm)


def test_a_failed_forward_fails_its_step_and_poisons_no_cache(model_dir, monkeypatch):
    """The forward fails while two requests with one 40-token prompt are in it (the second hit
    blocks the first registered in the same step): both fail, a request admitted later is
    served, and the same prompt afterwards computes fresh K/V rather than the unwritten one."""
    llm = _llm(model_dir, max_num_seqs=2)
    reference = _llm(model_dir)
    expected = reference.generate([PROMPTS[1]], GREEDY)[0].outputs[0].token_ids
    runner = llm.engine.core.executor.runner
    execute = runner.execute
    calls = iter([True])

    def failing_once(sched):
        if next(calls, False):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return execute(sched)

    monkeypatch.setattr(runner, "execute", failing_once)
    outs = llm.generate([PROMPTS[1], PROMPTS[1], PROMPTS[0]], GREEDY)
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error", "length"]
    assert "illegal memory access" in outs[0].error
    _assert_clean(llm)
    again = llm.generate([PROMPTS[1]], GREEDY)[0]
    assert again.outputs[0].token_ids == expected


def test_async_engine_fails_one_stream_and_the_others_finish(model_dir, monkeypatch):
    engine = AsyncEngine(EngineConfig(model=str(model_dir), max_model_len=MAX_MODEL_LEN))
    try:
        reference = _llm(model_dir)
        expected = reference.generate([PROMPTS[1]], GREEDY)[0].outputs[0].token_ids
        _poison_sampler(engine, monkeypatch)

        async def run(request_id, prompt, params):
            final = None
            async for out in engine.generate(request_id, prompt, params):
                final = out
            return final

        async def main():
            return await asyncio.gather(
                run("good", PROMPTS[1], GREEDY),
                run("bad", PROMPTS[0], POISON),
                return_exceptions=True,
            )

        good, bad = asyncio.run(main())
        assert isinstance(bad, RequestFailedError) and "bad" in str(bad)
        assert good.outputs[0].token_ids == expected
        assert engine.is_alive
        assert engine.engine.core.requests == {}
    finally:
        engine.shutdown()
