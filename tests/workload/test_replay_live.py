"""The replay against a live `nightshift serve` app (a tiny random model on loopback): exact prompt
and output lengths, a prefix-cache hit for the records that share a hash_id, and totals that
agree with the server's own /metrics counters."""

from __future__ import annotations

import httpx
import pytest

from tests.engine.server.live_server import build_chat_model, live_server
from workload.prompt_tokens import TextPrompts, TokenPrompts, load_tokenizer
from workload.replay import ReplayConfig, replay
from workload.trace import TraceRecord

MODEL = "tiny"
MAX_MODEL_LEN = 512
# (input, output, hash_ids): records 1 and 6 share block 7, so 6 hits 1's first 112 tokens.
TRACE = [
    TraceRecord(0, n_in, n_out, hash_ids)
    for n_in, n_out, hash_ids in (
        (20, 4, [100]),
        (150, 24, [7]),
        (64, 8, [101]),
        (200, 12, [102]),
        (33, 16, [103]),
        (97, 5, [104]),
        (120, 10, [7]),
        (180, 20, [105]),
    )
]
SHARED = (1, 6)
SHARED_HIT = 112  # 7 whole 16-token blocks of the shorter prompt (120 tokens)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("replay"))


@pytest.fixture(scope="module")
def server(model_dir):
    with live_server(model_dir, MODEL, max_model_len=MAX_MODEL_LEN) as (url, _engine):
        yield url


def _counters(url: str) -> dict[str, float]:
    names = (
        "nightshift:prompt_tokens_total",
        "nightshift:generation_tokens_total",
        "nightshift:request_success_total",
        "nightshift:prefix_cache_hits_total",
    )
    text = httpx.get(f"{url}/metrics").text
    return {
        name: sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if not line.startswith("#") and line.split("{")[0].split()[0] == name
        )
        for name in names
    }


def _replay(url: str, prompt_fn, **kwargs) -> tuple[dict, dict[str, float]]:
    before = _counters(url)
    result = replay(TRACE, ReplayConfig(f"{url}/v1", MODEL, **kwargs), prompt_fn)
    after = _counters(url)
    return result, {k: after[k] - before[k] for k in before}


def _check_exact(result: dict, delta: dict[str, float]) -> None:
    requests = result["requests"]
    assert [r["error"] for r in requests] == [None] * len(TRACE)
    assert [r["prompt_tokens"] for r in requests] == [t.input_length for t in TRACE]
    assert [r["output_received"] for r in requests] == [t.output_length for t in TRACE]
    s = result["summary"]
    assert s["output_mismatch"] == 0 and s["requests"]["completed"] == len(TRACE)
    assert s["input_tokens"] == sum(t.input_length for t in TRACE)
    assert s["output_tokens"] == sum(t.output_length for t in TRACE)
    # the server counted the same work
    assert delta["nightshift:prompt_tokens_total"] == s["input_tokens"]
    assert delta["nightshift:generation_tokens_total"] == s["output_tokens"]
    assert delta["nightshift:request_success_total"] == len(TRACE)
    assert delta["nightshift:prefix_cache_hits_total"] == s["cached_tokens"]
    assert result["config"]["server_max_model_len"] == MAX_MODEL_LEN
    for r in requests:
        assert r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"]


def test_batch_mode_token_prompts(server):
    result, delta = _replay(server, TokenPrompts(49152, seed=10).prompt, mode="batch")
    _check_exact(result, delta)
    cached = [r["cached_tokens"] for r in result["requests"]]
    # Whichever of the pair the server admitted second hits the other's blocks.
    assert max(cached[i] for i in SHARED) == SHARED_HIT
    assert sum(cached) == SHARED_HIT
    s = result["summary"]
    assert s["makespan_s"] > 0 and s["peak_concurrency"] >= 2


def test_concurrency_mode_token_prompts(server):
    prompts = TokenPrompts(49152, seed=11)  # another seed: no hits on the batch run's blocks
    result, delta = _replay(server, prompts.prompt, mode="concurrency", concurrency=3)
    _check_exact(result, delta)
    cached = [r["cached_tokens"] for r in result["requests"]]
    assert cached == [SHARED_HIT if i == SHARED[1] else 0 for i in range(len(TRACE))]
    assert result["summary"]["peak_concurrency"] <= 3


def test_text_prompts_have_the_exact_server_token_count(server, model_dir):
    prompts = TextPrompts(load_tokenizer(model_dir), seed=12)
    result, delta = _replay(server, prompts.prompt, mode="concurrency", concurrency=4)
    _check_exact(result, delta)
    assert prompts.inexact == 0
    assert result["requests"][SHARED[1]]["cached_tokens"] > 0
