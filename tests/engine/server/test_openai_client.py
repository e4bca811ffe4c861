"""A live uvicorn server on 127.0.0.1 with a tiny model, driven by the official openai client
(sync and async, streaming and not) and by raw httpx for errors."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine
from engine.request import RequestStatus
from engine.server.app import create_app
from tests.engine.server.live_server import build_chat_model, live_server

MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("srv"))


@pytest.fixture(scope="module")
def server(model_dir):
    with live_server(model_dir, MODEL, api_key="secret", max_model_len=256) as running:
        yield running


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="secret", timeout=60, max_retries=0)


def test_chat_matches_offline(server, model_dir):
    url, engine = server
    messages = [{"role": "user", "content": "Say something."}]
    resp = _client(url).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    prompt = engine.engine.encode_chat(messages)
    offline = (
        LLM(model=str(model_dir), max_model_len=256)
        .generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
        .outputs[0]
    )
    assert resp.choices[0].message.content == offline.text
    assert resp.choices[0].finish_reason == offline.finish_reason
    assert resp.usage.prompt_tokens == len(prompt)
    assert resp.usage.completion_tokens == len(offline.token_ids)


def test_chat_stream_concatenates_to_the_full_answer(server):
    url, _ = server
    client = _client(url)
    kwargs = dict(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=16, temperature=0
    )
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_completions_async_many_prompts(server, model_dir):
    url, _ = server
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="secret", timeout=60)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]

    async def main():
        return await asyncio.gather(
            *(
                client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
                for p in prompts
            )
        )

    results = asyncio.run(main())
    offline = LLM(model=str(model_dir), max_model_len=256).generate(
        prompts, SamplingParams(temperature=0, max_tokens=6)
    )
    assert [r.choices[0].text for r in results] == [o.outputs[0].text for o in offline]


def test_completion_stream(server):
    url, _ = server
    client = _client(url)
    full = (
        client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8, temperature=0)
        .choices[0]
        .text
    )
    parts = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(p.choices[0].text for p in parts if p.choices) == full


def test_models_health_version(server):
    url, _ = server
    assert [m.id for m in _client(url).models.list()] == [MODEL]
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/version").json()["version"]


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"model": MODEL, "messages": []}, 400, "messages"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 5},
            400,
            "top_p",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": -1},
            400,
            "temperature",
        ),
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "nope"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x " * 400}]},
            400,
            "maximum context length is 256 tokens",  # OpenAI's words
        ),
    ],
)
def test_errors(server, body, status, words):
    url, _ = server
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json=body,
        headers={"Authorization": "Bearer secret"},
        timeout=30,
    )
    assert r.status_code == status
    error = r.json()["error"]
    assert words in error["message"] and error["type"]
    # and the server keeps serving
    assert httpx.get(f"{url}/health").status_code == 200


def test_malformed_json_and_auth(server):
    url, _ = server
    r = httpx.post(
        f"{url}/v1/completions",
        content=b"{not json",
        headers={"Authorization": "Bearer secret", "Content-Type": "application/json"},
    )
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_disconnect_mid_stream_frees_the_request(server):
    url, engine = server
    body = {
        "model": MODEL,
        "prompt": "Tell me a long story",
        "max_tokens": 240,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        json=body,
        headers={"Authorization": "Bearer secret"},
        timeout=30,
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        running = [
            req for rid, req in engine.engine.core.requests.items() if rid.startswith("cmpl-")
        ]
    # the client is gone: the engine aborts the request and frees its blocks
    for _ in range(300):
        if not engine.engine.has_unfinished():
            break
        time.sleep(0.02)
    assert len(running) == 1
    assert running[0].status == RequestStatus.FINISHED_ABORTED
    assert len(running[0].output_token_ids) < 240
    assert not engine.engine.has_unfinished()
    assert engine.engine.core.kv.stats().num_used == 0
    metrics = httpx.get(f"{url}/metrics").text
    assert _metric(metrics, "nightshift:num_requests_running") == 0
    assert _metric(metrics, "nightshift:kv_cache_usage_perc") == 0


def test_64_concurrent_streams_match_offline(server, model_dir):
    url, _ = server
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="secret", timeout=120, max_retries=0)
    prompts = [[20 + i, 30 + i % 7, 40 + i % 5, 50 + i % 3] for i in range(64)]

    async def one(p):
        text = ""
        stream = await client.completions.create(
            model=MODEL, prompt=p, max_tokens=8, temperature=0, stream=True
        )
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
        return text

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    texts = asyncio.run(main())
    offline = LLM(model=str(model_dir), max_model_len=256).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8)
    )
    assert texts == [o.outputs[0].text for o in offline]


def _metric(text: str, name: str) -> float:
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def test_metrics(server):
    url, _ = server
    before = httpx.get(f"{url}/metrics").text
    _client(url).completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    after = httpx.get(f"{url}/metrics").text
    assert (
        _metric(after, "nightshift:generation_tokens_total")
        - _metric(before, "nightshift:generation_tokens_total")
        == 4
    )
    assert _metric(after, "nightshift:request_success_total") > _metric(
        before, "nightshift:request_success_total"
    )
    for name in (
        "nightshift:num_requests_running",
        "nightshift:kv_cache_usage_perc",
        "nightshift:time_to_first_token_seconds_count",
        "nightshift:step_seconds_count",
        "nightshift:prefix_cache_queries_total",
        "nightshift:num_preemptions_total",
    ):
        assert name in after


def test_full_queue_answers_429(model_dir):
    """--max-waiting-requests 1 with one sequence slot: one request runs, one waits, a third
    would make two wait, so it gets a 429."""
    import threading

    from fastapi.testclient import TestClient

    engine = AsyncEngine(EngineConfig(model=str(model_dir), max_model_len=256, max_num_seqs=1))
    engine.step_observers.append(lambda *_: time.sleep(0.005))  # the long ones run for seconds
    try:
        app = create_app(engine, MODEL, max_waiting_requests=1)
        long = {"model": MODEL, "prompt": "x", "max_tokens": 100, "ignore_eos": True}
        with TestClient(app) as client:
            threads = []
            for expected_unfinished in (1, 2):
                t = threading.Thread(
                    target=client.post, args=("/v1/completions",), kwargs={"json": long}
                )
                t.start()
                threads.append(t)
                while engine.num_unfinished < expected_unfinished:
                    time.sleep(0.005)
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
            for t in threads:
                t.join(60)
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
    finally:
        engine.shutdown()


def test_logprobs(server):
    url, _ = server
    client = _client(url)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert entry.logprob == max(t.logprob for t in entry.top_logprobs)
    text = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=3,
        temperature=0,
        logprobs=2,
        echo=True,
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert text.text.startswith("Hello")
    # echo: the prompt's one token (no logprob: it has no context), then the 3 generated
    assert len(text.logprobs.token_logprobs) == 1 + 3
    assert text.logprobs.token_logprobs[0] is None


def test_completions_several_prompts_and_n(server):
    url, _ = server

    def create():
        return _client(url).completions.create(
            model=MODEL,
            prompt=["One", "Two"],
            n=2,
            max_tokens=4,
            temperature=0.8,
            seed=7,
            extra_body={"ignore_eos": True},
        )

    resp = create()
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    assert resp.usage.completion_tokens == 16
    by_index = {c.index: c.text for c in create().choices}
    assert all(by_index[c.index] == c.text for c in resp.choices)  # seeded: reproducible
