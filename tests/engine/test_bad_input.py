"""Bad input through the public API: each is a ValueError subclass naming the problem, and the
engine keeps serving afterwards with nothing left behind."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError, InvalidSamplingParamsError, ModelLoadError
from tests.engine.tiny_models import build_tiny_model

MAX_MODEL_LEN = 128
VOCAB = 384  # tiny_models' vocab_size
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
GOOD_PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, block_size=16)


@pytest.fixture(scope="module")
def baseline(llm):
    return _good_tokens(llm)


def _good_tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate(GOOD_PROMPTS, GREEDY) + llm.generate(GOOD_PROMPTS, SEEDED)
    return [o.outputs[0].token_ids for o in outs]


def _assert_clean(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished()
    assert not engine.core.has_unfinished()
    assert engine.core.requests == {}
    assert engine._sample_to_group == {}
    engine.core.kv.check_integrity()
    assert engine.core.kv.stats().num_used == 0


BAD_REQUESTS = {
    "empty prompt": ([[]], GREEDY, ["empty"]),
    "prompt longer than max_model_len": ([list(range(2, 202))], GREEDY, ["max_model_len", "200"]),
    "prompt exactly max_model_len": ([[3] * MAX_MODEL_LEN], GREEDY, ["max_model_len"]),
    "prompt + max_tokens over max_model_len": (
        [[3] * 100],
        SamplingParams(max_tokens=50),
        ["max_tokens", "max_model_len", "150"],
    ),
    "token id = vocab size": ([[5, VOCAB, 6]], GREEDY, ["vocabulary", str(VOCAB)]),
    "negative token id": ([[5, -1, 6]], GREEDY, ["vocabulary", "-1"]),
    "non-int token": ([[5, 1.5, 6]], GREEDY, ["token ids"]),
    "bool token": ([[5, True, 6]], GREEDY, ["token ids"]),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_rejected_and_engine_keeps_serving(llm, baseline, case):
    prompts, params, words = BAD_REQUESTS[case]
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(prompts, params)
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)
    _assert_clean(llm)
    assert _good_tokens(llm) == baseline
    _assert_clean(llm)


BAD_PARAMS = {
    "max_tokens<0": ({"max_tokens": -3}, ["max_tokens"]),
    "top_p=0": ({"top_p": 0.0}, ["top_p"]),
    "top_p>1": ({"top_p": 1.5}, ["top_p"]),
    "negative temperature": ({"temperature": -0.5}, ["temperature"]),
    "n=0": ({"n": 0}, ["n must"]),
    "min_tokens > max_tokens": ({"min_tokens": 9, "max_tokens": 4}, ["min_tokens"]),
}


@pytest.mark.parametrize("case", list(BAD_PARAMS))
def test_bad_sampling_params_are_rejected(case):
    kwargs, words = BAD_PARAMS[case]
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value)


def test_batch_with_one_bad_prompt_leaves_nothing_behind(llm, baseline):
    good = GOOD_PROMPTS[0]
    for batch in ([good, good, [5, VOCAB]], [[5, VOCAB], good], [good, [], good]):
        with pytest.raises(InvalidRequestError):
            llm.generate(batch, GREEDY)
        _assert_clean(llm)
    # n > 1 fans out into several core requests: all of them go when one fails.
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate([good, [3] * 120], SamplingParams(n=3, max_tokens=20))
    _assert_clean(llm)
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate([good, good], [GREEDY])
    _assert_clean(llm)
    assert _good_tokens(llm) == baseline


def test_request_larger_than_kv_pool(model_dir):
    llm = LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, block_size=16, num_kv_blocks=4)
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([[3] * 60], SamplingParams(max_tokens=10))  # 70 tokens: 5 blocks > 4
    message = str(info.value)
    assert "KV blocks" in message and "4" in message and "64" in message
    _assert_clean(llm)
    # The largest request that fits still runs: 64 tokens = the whole pool.
    out = llm.generate([[3] * 60], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    _assert_clean(llm)


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(model="/nonexistent")


def test_unsupported_architecture(tmp_path, model_dir):
    folder = tmp_path / "gpt2"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        LLM(model=str(folder))
    assert "unsupported architecture" in str(info.value)
    assert "GPT2LMHeadModel" in str(info.value)


def test_folder_without_weights(tmp_path, model_dir):
    folder = tmp_path / "no-weights"
    folder.mkdir()
    shutil.copy(model_dir / "config.json", folder / "config.json")
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(model=str(folder))


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(model=str(tmp_path))


def test_max_model_len_above_model_limit(model_dir):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=str(model_dir), max_model_len=100_000)


def test_llm_engine_api_keeps_good_requests_after_a_bad_one(llm, baseline):
    engine = llm.engine
    engine.add_request("good-0", GOOD_PROMPTS[0], GREEDY)
    engine.add_request("good-1", GOOD_PROMPTS[1], GREEDY)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request("bad", [5, VOCAB], GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("good-0", GOOD_PROMPTS[0], GREEDY)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine.add_request("bad-long", [3] * 200, GREEDY)
    finished = {}
    for _ in range(100):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert finished == {"good-0": baseline[0], "good-1": baseline[1]}
    _assert_clean(llm)
    # The rejected ids were never registered: they are free to use.
    engine.add_request("bad", GOOD_PROMPTS[0], GREEDY)
    engine.abort("bad")
    _assert_clean(llm)


def test_prompts_text_or_stop_strings_need_a_tokenizer(llm):
    # The tiny model folder ships no tokenizer.
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        llm.generate("hello", GREEDY)
    with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer"):
        llm.generate([GOOD_PROMPTS[0]], SamplingParams(stop=["x"]))
    _assert_clean(llm)


# ----- regressions: values that once passed validation or left the engine dirty ---------------


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": float("nan")}, {"repetition_penalty": float("nan")}, {"top_k": 1.5}],
    ids=["temperature-nan", "repetition_penalty-nan", "top_k-float"],
)
def test_nan_or_non_integer_sampling_params_are_rejected(kwargs):
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert next(iter(kwargs)) in str(info.value)


def test_out_of_range_seed_is_rejected_by_name():
    with pytest.raises(InvalidSamplingParamsError, match="seed"):
        SamplingParams(seed=2**64, temperature=1.0)


def test_engine_keeps_serving_after_a_step_fails(model_dir, monkeypatch):
    """A batch whose sampling fails although no request fails alone: all of them end with
    finish_reason "error" (the batch cannot be split), and the engine serves on unchanged."""
    llm = LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, block_size=16)
    expected = _good_tokens(llm)
    sampler = llm.engine.core.sampler
    calls = iter([True])

    def failing_once(logits, rows, grammar=None):
        if next(calls, False):
            raise RuntimeError("sampler failure")
        return sampler(logits, rows, grammar)

    monkeypatch.setattr(llm.engine.core, "sampler", failing_once)
    outs = llm.generate(GOOD_PROMPTS, GREEDY)
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
    assert all("sampler failure" in o.error for o in outs)
    _assert_clean(llm)
    assert _good_tokens(llm) == expected


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"top_p": 1e-50, "temperature": 1.0}, "top_p"),  # 0.0 in float32
        ({"temperature": 1e39}, "temperature"),  # inf in float32
        ({"repetition_penalty": 1e-50}, "repetition_penalty"),
        ({"repetition_penalty": 1e39}, "repetition_penalty"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"logprobs": 2.5}, "logprobs"),
    ],
)
def test_values_that_break_float32_or_int64_are_rejected_by_name(kwargs, field):
    with pytest.raises(InvalidSamplingParamsError, match=field):
        SamplingParams(**kwargs)


def test_a_huge_top_k_means_no_top_k(llm):
    huge = SamplingParams(temperature=1.0, top_k=10**30, seed=3, max_tokens=6, ignore_eos=True)
    off = SamplingParams(temperature=1.0, top_k=-1, seed=3, max_tokens=6, ignore_eos=True)
    a, b = llm.generate([GOOD_PROMPTS[0]] * 2, [huge, off])
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    _assert_clean(llm)


def test_smallest_float32_top_p_samples_the_top_token(llm):
    tiny = SamplingParams(temperature=1.0, top_p=1.2e-38, seed=1, max_tokens=6, ignore_eos=True)
    out = llm.generate([GOOD_PROMPTS[0]], tiny)[0]
    greedy = llm.generate(
        [GOOD_PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )[0]
    assert out.outputs[0].token_ids == greedy.outputs[0].token_ids
