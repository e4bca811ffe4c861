"""AsyncEngine: concurrent asyncio callers against the engine thread."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine
from engine.request import RequestStatus
from tests.engine.tiny_models import build_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("async"))


@pytest.fixture
def engine(model_dir):
    eng = AsyncEngine(EngineConfig(model=str(model_dir), max_num_batched_tokens=64))
    yield eng
    eng.shutdown()


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(2, 384) for _ in range(rng.randint(3, 60))] for _ in range(n)]


async def _collect(engine: AsyncEngine, request_id: str, prompt, params=GREEDY):
    last = None
    async for out in engine.generate(request_id, prompt, params):
        last = out
    return last


def test_concurrent_requests_match_offline(engine, model_dir):
    prompts = _prompts(16)
    expected = [r.outputs[0].token_ids for r in LLM(model=str(model_dir)).generate(prompts, GREEDY)]

    async def main():
        return await asyncio.gather(*(_collect(engine, f"r{i}", p) for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    assert [r.outputs[0].token_ids for r in results] == expected
    assert all(r.finished for r in results)
    assert engine.num_unfinished == 0


def test_streams_cumulative_outputs(engine):
    async def main():
        return [out async for out in engine.generate("s", _prompts(1)[0], GREEDY)]

    outs = asyncio.run(main())
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and lengths[-1] == 8 and outs[-1].finished


def test_bad_request_raises_and_others_continue(engine):
    async def main():
        good = asyncio.create_task(_collect(engine, "good", _prompts(1)[0]))
        with pytest.raises(ValueError, match="empty"):
            await _collect(engine, "bad", [])
        return await good

    assert asyncio.run(main()).finished


def test_leaving_early_aborts_and_frees_blocks(engine):
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    seen = {}

    async def main():
        async for out in engine.generate("gone", _prompts(1)[0], long):
            if len(out.outputs[0].token_ids) >= 2:
                seen["request"] = engine.engine.core.requests["gone"]
                break  # the client disconnects
        for _ in range(500):  # the engine thread applies the abort
            if not engine.engine.has_unfinished():
                return
            await asyncio.sleep(0.01)

    asyncio.run(main())
    request = seen["request"]
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert len(request.output_token_ids) < 400
    kv = engine.engine.core.kv
    assert engine.num_unfinished == 0 and not engine.engine.has_unfinished()
    assert kv.stats().num_used == 0
    kv.check_integrity()


def test_failed_step_is_reported_and_engine_keeps_serving(engine, monkeypatch):
    core = engine.engine.core
    real_step = core.step
    calls = iter([True])

    def failing_once():
        if next(calls, False):
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(core, "step", failing_once)

    async def main():
        with pytest.raises(RuntimeError, match="boom"):
            await _collect(engine, "first", _prompts(1)[0])
        return await _collect(engine, "second", _prompts(1)[0])

    assert asyncio.run(main()).finished
    assert core.kv.stats().num_used == 0


def test_shutdown_stops_the_loop(model_dir):
    eng = AsyncEngine(EngineConfig(model=str(model_dir)))
    assert eng.is_alive
    eng.shutdown()
    assert not eng.is_alive


def test_a_model_that_cannot_load_fails_the_constructor(tmp_path):
    from engine.errors import ModelLoadError

    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError):
        AsyncEngine(EngineConfig(model=str(tmp_path / "empty")))


def test_the_engine_is_built_on_its_own_thread(model_dir, monkeypatch):
    # torch's OpenMP pool belongs to the thread that first runs a parallel region: the engine
    # thread must build (load weights, allocate KV) as well as step.
    import threading

    import engine.async_engine as async_engine

    built_on = []
    real = async_engine.LLMEngine

    def spy(config):
        built_on.append(threading.current_thread().name)
        return real(config)

    monkeypatch.setattr(async_engine, "LLMEngine", spy)
    eng = AsyncEngine(EngineConfig(model=str(model_dir)))
    eng.shutdown()
    assert built_on == ["nightshift-engine"]
