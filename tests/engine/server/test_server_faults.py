"""Faults and hostile input against a live server on 127.0.0.1: no request may harm another,
every error has OpenAI's shape, every stream ends with [DONE], a client that leaves stops its
request, admission holds under a burst, and oversized asks are refused by name."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from engine.server.limits import RequestLimits
from tests.engine.server.live_server import build_chat_model, live_server

MODEL = "tiny"
POISON_TEMPERATURE = 0.77  # marks the request whose sampling fails (nothing else uses it)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("faults"), max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(model_dir):
    with live_server(model_dir, MODEL, max_model_len=1024) as running:
        yield running


def _completion(prompt="Hello", **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}


def _assert_openai_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], (word, error)
    return error


def _sse_events(lines: list[str]) -> list:
    return [ln.removeprefix("data: ") for ln in lines if ln.startswith("data: ")]


@pytest.fixture
def poisoned(server, monkeypatch):
    """The sampler fails for the poisoned request once it has 3 output tokens (mid-stream)."""
    _, engine = server
    core = engine.engine.core
    sampler = core.sampler

    def sample(logits, rows, grammar=None):
        for row in rows:
            if row.params.temperature == POISON_TEMPERATURE and len(row.output_token_ids) >= 3:
                raise IndexError("index -1 is out of bounds for dimension 1 with size 256")
        return sampler(logits, rows, grammar)

    monkeypatch.setattr(core, "sampler", sample)


def _slow_steps(engine, seconds: float):
    """Each engine step takes at least this long (an observer sleeping on the engine thread)."""

    def observe(_: float, __: list) -> None:
        time.sleep(seconds)

    engine.step_observers.append(observe)
    return observe


# ----- a request that breaks the engine harms nobody else ------------------------------------


def test_tiny_top_p_is_a_400_and_a_concurrent_stream_is_untouched(server):
    url, engine = server
    good = _completion(max_tokens=60, ignore_eos=True, stream=True)

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:

            async def stream():
                async with c.stream("POST", f"{url}/v1/completions", json=good) as r:
                    return [ln async for ln in r.aiter_lines() if ln]

            task = asyncio.create_task(stream())
            await asyncio.sleep(0.05)
            bad = await c.post(f"{url}/v1/completions", json=_completion(top_p=1e-50))
            return bad, await task

    bad, lines = asyncio.run(main())
    _assert_openai_error(bad, 400, "top_p")
    events = _sse_events(lines)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert engine.is_alive


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_request_failing_mid_stream_ends_with_an_error_event_and_done(server, poisoned, endpoint):
    url, engine = server
    if endpoint == "chat":
        path, base = "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}
    else:
        path, base = "/v1/completions", {"prompt": "Hi"}
    bad = {
        "model": MODEL,
        **base,
        "max_tokens": 40,
        "ignore_eos": True,
        "stream": True,
        "temperature": POISON_TEMPERATURE,
    }
    good = {**bad, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:

            async def stream(body):
                async with c.stream("POST", f"{url}{path}", json=body) as r:
                    return [ln async for ln in r.aiter_lines() if ln]

            return await asyncio.gather(stream(bad), stream(good))

    bad_lines, good_lines = asyncio.run(main())
    bad_events = _sse_events(bad_lines)
    assert bad_events[-1] == "[DONE]"
    error = json.loads(bad_events[-2])["error"]
    assert error["type"] == "internal_server_error" and "out of bounds" in error["message"]
    good_events = _sse_events(good_lines)
    assert good_events[-1] == "[DONE]"
    assert json.loads(good_events[-2])["choices"][0]["finish_reason"] == "length"
    assert engine.engine.core.requests == {}
    metrics = httpx.get(f"{url}/metrics").text
    assert _metric(metrics, 'nightshift:request_failed_total{model_name="tiny"}') >= 1


def test_a_request_failing_without_streaming_is_a_500_in_openai_shape(server, poisoned):
    url, _ = server
    body = _completion(max_tokens=20, ignore_eos=True, temperature=POISON_TEMPERATURE)
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    _assert_openai_error(r, 500, "out of bounds")
    ok = httpx.post(f"{url}/v1/completions", json=_completion(), timeout=60)
    assert ok.status_code == 200


# ----- clients that leave ---------------------------------------------------------------------


def test_a_non_streaming_request_is_aborted_when_its_client_leaves(server):
    url, engine = server
    observe = _slow_steps(engine, 0.02)  # 1000 tokens would take 20 s
    try:
        before = _metric(httpx.get(f"{url}/metrics").text, _ABORTED)
        body = _completion(max_tokens=1000, ignore_eos=True)
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 5
        while engine.num_unfinished and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.num_unfinished == 0, "the request kept computing after its client left"
        assert engine.engine.core.kv.stats().num_used == 0
        after = _metric(httpx.get(f"{url}/metrics").text, _ABORTED)
        assert after == before + 1
    finally:
        engine.step_observers.remove(observe)


_ABORTED = 'nightshift:request_aborted_total{model_name="tiny",reason="client_disconnect"}'


def _metric(text: str, name: str) -> float:
    """The value of one sample line (name with its labels, exactly); 0 when absent."""
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == name:
            return float(value)
    return 0.0


# ----- admission under a burst ----------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2])
def test_the_waiting_limit_holds_under_a_burst_counting_samples(model_dir, n):
    limit = 2
    with live_server(
        model_dir, MODEL, max_waiting_requests=limit, max_model_len=256, max_num_seqs=2
    ) as (url, engine):
        waiting_seen: list[int] = []
        scheduler = engine.engine.core.scheduler

        def observe(_: float, __: list) -> None:
            waiting_seen.append(len(scheduler.waiting))
            time.sleep(0.01)

        engine.step_observers.append(observe)
        body = _completion(max_tokens=30, ignore_eos=True, n=n)

        async def main():
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(
                    *(c.post(f"{url}/v1/completions", json=body) for _ in range(32))
                )

        responses = asyncio.run(main())
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429}, codes
        assert 429 in codes and 200 in codes, codes
        assert max(waiting_seen) <= limit, max(waiting_seen)
        refused = next(r for r in responses if r.status_code == 429)
        _assert_openai_error(refused, 429, "waiting queue is full")
        assert refused.headers["retry-after"] == "1"
        # More samples than may wait: never admissible, so a 400 rather than a 429 to retry.
        too_many = httpx.post(f"{url}/v1/completions", json=_completion(n=limit + 1))
        _assert_openai_error(too_many, 400, "--max-waiting-requests")
        fits = httpx.post(f"{url}/v1/completions", json=_completion(n=limit), timeout=60)
        assert fits.status_code == 200, fits.text


# ----- limits ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, extra, words",
    [
        ("completions", {"logprobs": 10**9}, ["logprobs", "20", "--max-logprobs"]),
        ("completions", {"logprobs": 21}, ["logprobs", "20"]),
        ("chat", {"logprobs": True, "top_logprobs": 21}, ["top_logprobs", "20"]),
        ("completions", {"n": 129}, ["n", "128", "--max-n"]),
        ("completions", {"stop": [f"s{i}" for i in range(65)]}, ["stop", "64"]),
        ("completions", {"stop": ["x" * 1025]}, ["stop", "1024"]),
        ("completions", {"prompt": ["a"] * 257}, ["prompt", "256"]),
        ("completions", {"prompt": ["a"] * 200, "n": 6}, ["1200 samples", "1024"]),
        ("chat", {"messages": [{"role": "user", "content": ""}] * 1100}, ["context length"]),
        ("completions", {"top_k": 10**30, "temperature": 1}, None),  # huge top_k is no top-k
        ("completions", {"stop_token_ids": [10**30]}, ["stop_token_ids"]),
        ("completions", {"seed": 2**64}, ["seed"]),
        ("completions", {"max_tokens": 10**12}, ["max_tokens"]),
        ("completions", {"temperature": 1e39}, ["temperature"]),
    ],
)
def test_oversized_or_unrepresentable_asks_are_refused_by_name(server, path, extra, words):
    url, engine = server
    if path == "chat":
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, **extra}, timeout=60)
    else:
        r = httpx.post(f"{url}/v1/completions", json={**_completion(), **extra}, timeout=60)
    if words is None:
        assert r.status_code == 200, r.text
    else:
        _assert_openai_error(r, 400, *words)
    assert httpx.get(f"{url}/health").status_code == 200
    assert engine.engine.core.requests == {}


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("completions", {"temperature": -1}, "temperature"),
        ("completions", {"top_p": 1e-50}, "top_p"),
        ("completions", {"max_tokens": 0}, "max_tokens"),
        ("completions", {"max_tokens": 10**9}, "max_tokens"),
        ("completions", {"seed": 2**63}, "seed"),  # any int64 is a seed; this is not one
        ("completions", {"stop": [""]}, "stop"),
        ("completions", {"prompt": [10**9]}, "prompt"),
        ("completions", {"guided_regex": ""}, "guided_regex"),
        ("completions", {"guided_json": {"type": 5}}, "guided_json"),
        ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("chat", {"max_completion_tokens": -3}, "max_completion_tokens"),
    ],
)
def test_a_refusal_names_its_field_in_param(server, path, extra, param):
    url, _ = server
    if path == "chat":
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **extra}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    else:
        r = httpx.post(f"{url}/v1/completions", json={**_completion(), **extra}, timeout=60)
    assert _assert_openai_error(r, 400)["param"] == param


def test_a_body_over_the_limit_is_a_413_announced_or_chunked(model_dir):
    limits = RequestLimits(max_request_bytes=10_000)
    with live_server(model_dir, MODEL, limits=limits, max_model_len=256) as (url, _):
        big = json.dumps(_completion(prompt="x" * 20_000)).encode()
        r = httpx.post(
            f"{url}/v1/completions", content=big, headers={"content-type": "application/json"}
        )
        _assert_openai_error(r, 413, "10000 bytes", "--max-request-bytes")

        def chunks():
            for i in range(0, len(big), 1000):
                yield big[i : i + 1000]

        r = httpx.post(
            f"{url}/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        _assert_openai_error(r, 413, "10000 bytes")
        ok = httpx.post(f"{url}/v1/completions", json=_completion(), timeout=60)
        assert ok.status_code == 200


def test_a_10mb_prompt_is_refused_before_tokenizing_and_streams_keep_flowing(server):
    url, engine = server
    encoded_on: list[str] = []
    encode = engine.engine.encode_prompt

    def recording(prompt):
        if isinstance(prompt, str):  # token ids are only checked
            encoded_on.append(threading.current_thread().name)
        return encode(prompt)

    engine.engine.encode_prompt = recording
    try:
        r = httpx.post(
            f"{url}/v1/completions", json=_completion(prompt="x " * 5_000_000), timeout=60
        )
        error = _assert_openai_error(r, 400, "maximum context length is 1024 tokens")
        assert error["code"] == "context_length_exceeded"
        assert encoded_on == [], "the huge prompt was tokenized"
        r = httpx.post(f"{url}/v1/completions", json=_completion(prompt="word " * 100), timeout=60)
        assert r.status_code == 200
        assert encoded_on and "nightshift-engine" not in encoded_on
    finally:
        del engine.engine.encode_prompt


# ----- error shapes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method, path, content, status",
    [
        ("GET", "/v1/nothing", None, 404),
        ("GET", "/v1/completions", None, 405),
        ("POST", "/v1/completions", b'{"model": "tiny", "prompt": ', 400),
        ("POST", "/v1/completions", b"[1, 2, 3]", 400),
        ("POST", "/v1/completions", b"\xff\xfe binary", 400),
        ("POST", "/v1/chat/completions", b'{"model": "tiny", "messages": "hi"}', 400),
        ("POST", "/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400),
    ],
)
def test_every_error_has_the_openai_shape(server, method, path, content, status):
    url, _ = server
    r = httpx.request(
        method, f"{url}{path}", content=content, headers={"content-type": "application/json"}
    )
    _assert_openai_error(r, status)


def test_an_internal_error_is_a_500_in_openai_shape_and_the_server_goes_on(server, monkeypatch):
    url, engine = server

    def broken(messages, **template_options):
        raise RuntimeError("template exploded")

    monkeypatch.setattr(engine.engine, "encode_chat", broken)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    error = _assert_openai_error(r, 500, "template exploded")
    assert error["type"] == "internal_server_error"
    monkeypatch.undo()
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200


def test_the_openai_client_sees_typed_errors(server):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", logprobs=100)
    assert "--max-logprobs" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="Hi")


# ----- constraints that break while generating ----------------------------------------------

BROKEN_GRAMMARS = {
    "5000 choices": {"guided_choice": [f"opt{i}" for i in range(5000)]},
    "recursive schema": {
        "guided_json": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    },
    "huge regex": {"guided_regex": "a{1000000}"},
}


@pytest.mark.parametrize("case", list(BROKEN_GRAMMARS))
@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_breaks_is_an_error_never_a_silent_stop(server, case, stream):
    """llguidance gives up on these at the first token; the request must say so rather than
    end with finish_reason "stop" and text outside its constraint."""
    url, engine = server
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Pick one."}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": stream,
        **BROKEN_GRAMMARS[case],
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        r.read()
    if r.status_code == 200:  # the stream had started: its last event is the error
        events = _sse_events([ln for ln in r.text.splitlines() if ln])
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
    else:
        error = _assert_openai_error(r, 400)
    assert error["code"] == "structured_output_failed"
    assert "structured output failed" in error["message"] and "<state>" not in error["message"]
    assert engine.engine.core.requests == {}


def test_echo_of_a_token_id_prompt_streams_like_it_answers(server):
    url, _ = server
    body = _completion(prompt=[1, 2, 3, 4], echo=True, max_tokens=3)
    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        events = _sse_events([ln for ln in r.iter_lines() if ln])
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert streamed == plain["choices"][0]["text"]
    assert len(streamed) > 0


@pytest.mark.parametrize("length", [b"abc", b"-1"])
def test_an_unparseable_http_request_gets_an_openai_error_too(server, length):
    import socket

    url, _ = server
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + length + b"\r\n\r\n{}"
        )
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
