"""/metrics values on a live server: vLLM's names with the served model name, counts that agree
with what the responses reported, one inter-token interval fewer than tokens per request, the
phase times adding up to the end-to-end latency, aborts counted and forgotten."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.server.metrics import (
    FINISHED_REASONS,
    ITL_BUCKETS,
    TTFT_BUCKETS,
    ServerMetrics,
    build_1_2_5_buckets,
)
from tests.engine.server.live_server import build_chat_model, live_server

MODEL = "tiny-metrics"
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_chat_model(tmp_path_factory.mktemp("metrics"))
    with live_server(model_dir, MODEL, max_model_len=256) as running:
        yield running


def _samples(url: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value, as Prometheus reads the exposition."""
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float:
    """The sum over the series of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def _delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return _value(after, name, **labels) - _value(before, name, **labels)


def _completion(url: str, **body) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, **body}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _streamed_chat(url: str, max_tokens: int) -> dict:
    """A streamed chat request to its end; returns the usage of its last chunk."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        events = [ln.removeprefix("data: ") for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["usage"]


def _server_metrics(engine) -> ServerMetrics:
    """The app's ServerMetrics, found through the step observer it registered."""
    return next(
        o.__self__
        for o in engine.step_observers
        if isinstance(getattr(o, "__self__", None), ServerMetrics)
    )


# Every histogram vLLM observes once per (child) request as it finishes.
PER_SAMPLE = (
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
)


def test_counts_agree_with_the_responses(server):
    url, _ = server
    before = _samples(url)
    a = _completion(url, max_tokens=6, ignore_eos=True)
    text = a["choices"][0]["text"]
    assert text, "the greedy text is the stop string of the next request"
    b = _completion(url, max_tokens=12, ignore_eos=True, stop=[text])  # the same greedy text
    c = _streamed_chat(url, max_tokens=5)
    after = _samples(url)
    usages = [a["usage"], b["usage"], c]
    k = len(usages)
    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert [a["choices"][0]["finish_reason"], b["choices"][0]["finish_reason"]] == [
        "length",
        "stop",
    ]

    success = "vllm:request_success_total"
    assert _delta(before, after, success) == k
    assert _delta(before, after, success, finished_reason="length") == 2
    assert _delta(before, after, success, finished_reason="stop") == 1
    assert _delta(before, after, "nightshift:request_success_total") == k  # deprecated name
    assert _delta(before, after, "vllm:prompt_tokens_total") == prompt
    assert _delta(before, after, "vllm:generation_tokens_total") == generated
    assert _delta(before, after, "nightshift:generation_tokens_total") == generated
    for name in (*PER_SAMPLE, "vllm:request_params_n"):
        assert _delta(before, after, f"{name}_count") == k, name
    assert _delta(before, after, "vllm:request_prompt_tokens_sum") == prompt
    assert _delta(before, after, "vllm:request_generation_tokens_sum") == generated
    # One interval per output after the first: without speculation one token each.
    assert _delta(before, after, "vllm:inter_token_latency_seconds_count") == generated - k
    assert _delta(before, after, "vllm:time_per_output_token_seconds_count") == generated - k
    # Each step's tokens: a prompt counts once, in the step of its first token.
    assert _delta(before, after, "vllm:iteration_tokens_total_sum") == prompt + generated
    # The phases partition the request's life: queue + prefill + decode = end to end.
    phases = sum(
        _delta(before, after, f"vllm:request_{p}_time_seconds_sum")
        for p in ("queue", "prefill", "decode")
    )
    assert phases == pytest.approx(_delta(before, after, "vllm:e2e_request_latency_seconds_sum"))


def test_each_of_n_samples_counts_as_a_request(server):
    """vLLM's unit: an n=3 request is 3 child requests, each observed with its own times and
    token counts; the n parameter (and the longest sample) once per caller request."""
    url, _ = server
    before = _samples(url)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello"}],
        "n": 3,
        "max_tokens": 3,
        "ignore_eos": True,
        "seed": 1,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 3
    after = _samples(url)

    success = _delta(before, after, "vllm:request_success_total")
    assert success == _delta(before, after, "vllm:request_success_total", finished_reason="length")
    assert success == 3
    for name in PER_SAMPLE:
        assert _delta(before, after, f"{name}_count") == success, name
    assert _delta(before, after, "vllm:request_params_n_count") == 1
    assert _delta(before, after, "vllm:request_params_n_sum") == 3
    assert _delta(before, after, "vllm:request_max_num_generation_tokens_sum") == 3
    # Token counts per sample: each sample prefills the prompt and makes its own tokens.
    prompt, generated = usage["prompt_tokens"], usage["completion_tokens"]
    assert generated == 9
    assert _delta(before, after, "vllm:request_prompt_tokens_sum") == 3 * prompt
    assert _delta(before, after, "vllm:prompt_tokens_total") == 3 * prompt
    assert _delta(before, after, "vllm:request_generation_tokens_sum") == generated
    assert _delta(before, after, "vllm:generation_tokens_total") == generated
    assert _delta(before, after, "vllm:inter_token_latency_seconds_count") == generated - 3
    assert _delta(before, after, "vllm:iteration_tokens_total_sum") == 3 * prompt + generated
    # Each sample's own phases add up to its own end-to-end latency.
    phases = sum(
        _delta(before, after, f"vllm:request_{p}_time_seconds_sum")
        for p in ("queue", "prefill", "decode")
    )
    assert phases == pytest.approx(_delta(before, after, "vllm:e2e_request_latency_seconds_sum"))


def test_an_embedding_finishes_as_stop_with_no_generation_phase(server):
    """vLLM finishes a pooling request FINISHED_STOPPED; it made no token, so it has a queue
    time and an end-to-end latency but no first token, prefill, decode or time per token; its
    generation-token histogram gets a 0, as vLLM's."""
    url, _ = server
    before = _samples(url)
    r = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": PROMPT}, timeout=60)
    assert r.status_code == 200, r.text
    after = _samples(url)
    success = "vllm:request_success_total"
    assert _delta(before, after, success, finished_reason="stop") == 1
    assert _delta(before, after, success) == 1
    for name in (
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:request_params_n",
    ):
        assert _delta(before, after, f"{name}_count") == 1, name
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_time_per_output_token_seconds",
    ):
        assert _delta(before, after, f"{name}_count") == 0, name
    assert _delta(before, after, "vllm:request_generation_tokens_sum") == 0
    assert _delta(before, after, "vllm:generation_tokens_total") == 0
    assert _delta(before, after, "vllm:request_prompt_tokens_sum") == len(PROMPT)
    assert _delta(before, after, "vllm:prompt_tokens_total") == len(PROMPT)


def test_gauges_return_to_zero_and_every_series_names_the_model(server):
    url, _ = server
    _completion(url, max_tokens=4, ignore_eos=True)
    samples = _samples(url)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        assert _value(samples, name) == 0, name
    info = {dict(ls).get("num_gpu_blocks") for (n, ls) in samples if n == "vllm:cache_config_info"}
    assert info and None not in info
    for name, labels in samples:
        labels = dict(labels)
        assert labels.get("model_name") == MODEL, name
        if name.startswith("vllm:"):
            assert labels.get("engine") == "0", name
    # Every finish reason is a series from the start, so rate() over it works at once.
    reasons = {
        dict(ls)["finished_reason"] for (n, ls) in samples if n == "vllm:request_success_total"
    }
    assert reasons == set(FINISHED_REASONS)


@pytest.mark.parametrize("n", [1, 2])
def test_a_client_leaving_is_an_abort_per_sample_and_forgotten(server, n):
    """The unit of an abort is the unit of a finish, a sample: a client that leaves an n=2
    stream aborts 2 engine requests. Their per-request state is forgotten."""
    url, engine = server
    before = _samples(url)

    def slow(_elapsed, _outputs):
        time.sleep(0.02)  # 200 tokens take at least 4 s: the client leaves long before

    engine.step_observers.append(slow)
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "n": n}
        with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass  # the first chunk: the request is running
        deadline = time.monotonic() + 10
        while engine.num_unfinished and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.num_unfinished == 0
    finally:
        engine.step_observers.remove(slow)
    _completion(url, max_tokens=3, ignore_eos=True)  # a step after the abort forgets it
    after = _samples(url)
    assert _delta(before, after, "vllm:request_success_total", finished_reason="abort") == n
    aborted = "nightshift:request_aborted_total"
    assert _delta(before, after, aborted, reason="client_disconnect") == n
    assert _delta(before, after, "vllm:request_success_total", finished_reason="length") == 1
    assert _server_metrics(engine)._progress == {}


def test_buckets_are_vllms():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(256)[-1] == 200
    assert (TTFT_BUCKETS[0], TTFT_BUCKETS[-1], len(TTFT_BUCKETS)) == (0.001, 2560.0, 22)
    assert (ITL_BUCKETS[0], ITL_BUCKETS[-1], len(ITL_BUCKETS)) == (0.01, 80.0, 19)
