"""ChatClient against the fault-injecting stub (retries, timeouts, broken streams, a rejected
response_format) and once against our own server with a tiny model."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from functools import partial

import httpx
import pytest

from digest.chat_client import (
    ChatCallError,
    ChatClient,
    ChatClientConfig,
    ChatResult,
    endpoint_label,
)
from digest.review_parse import parse_review, review_response_format
from tests.digest.fault_server import Fault, FaultServer, summary_for

# Our server with a tiny model, started once for this module: the fixtures live there.
from tests.engine.server.test_openai_client import model_dir, server  # noqa: F401

MESSAGES = [
    {"role": "system", "content": "You review papers."},
    {"role": "user", "content": "Title: Sparse Attention Revisited\nSummarize it."},
]
SUMMARY = summary_for("Sparse Attention Revisited")


def _config(stub: FaultServer, **overrides) -> ChatClientConfig:
    fields = dict(model="stub", backoff_s=0.01, max_backoff_s=0.05, read_timeout_s=0.5)
    return ChatClientConfig(stub.base_url, **(fields | overrides))


def _chat(config: ChatClientConfig, max_tokens: int = 200, **kwargs) -> ChatResult:
    async def main(client: ChatClient) -> ChatResult:
        return await client.chat(MESSAGES, max_tokens=max_tokens, **kwargs)

    return asyncio.run(_with_client(config, main))


async def _with_client(config: ChatClientConfig, body, concurrency: int = 4):
    async with ChatClient(config, concurrency=concurrency) as client:
        return await body(client)


def test_success_reports_text_usage_and_timings():
    with FaultServer(cached_tokens=7) as stub:
        before = datetime.now(UTC)
        result = _chat(_config(stub), seed=3)
    assert result.text == SUMMARY
    assert result.finish_reason == "stop"
    assert result.prompt_tokens == 3 + 6  # words in the two messages
    assert result.completion_tokens == len(SUMMARY.split())
    assert result.cached_tokens == 7
    assert result.attempts == 1
    assert 0 < result.ttft_s <= result.latency_s < 5
    assert result.started_at.tzinfo is UTC
    assert before <= result.started_at <= before + timedelta(seconds=5)
    (body,) = stub.requests
    assert body == {
        "model": "stub",
        "messages": MESSAGES,
        "max_tokens": 200,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": 3,
    }


def test_missing_cached_tokens_is_none_and_length_finish_is_reported():
    with FaultServer(cached_tokens=None) as stub:
        result = _chat(_config(stub), max_tokens=4)
    assert result.cached_tokens is None
    assert result.text == "This paper, Sparse Attention"
    assert (result.finish_reason, result.completion_tokens) == ("length", 4)


def test_retries_503_then_succeeds():
    with FaultServer(faults=[Fault("status", status=503, times=2)]) as stub:
        result = _chat(_config(stub))
    assert result.text == SUMMARY
    assert result.attempts == 3
    assert len(stub.requests) == 3


def test_429_retry_after_is_honoured_and_capped():
    with FaultServer(faults=[Fault("status", status=429, retry_after=1)]) as stub:
        t0 = time.monotonic()
        result = _chat(_config(stub, max_backoff_s=5))
        waited = time.monotonic() - t0
    assert result.attempts == 2
    assert 1.0 <= waited < 3
    # a Retry-After beyond max_backoff_s waits only max_backoff_s
    with FaultServer(faults=[Fault("status", status=429, retry_after=100)]) as stub:
        t0 = time.monotonic()
        result = _chat(_config(stub, max_backoff_s=0.05))
    assert result.attempts == 2
    assert time.monotonic() - t0 < 1


def test_retries_exhausted_raise_with_status_and_attempts():
    with FaultServer(faults=[Fault("status", status=502, times=-1)]) as stub:
        with pytest.raises(ChatCallError) as info:
            _chat(_config(stub, max_retries=2))
    error = info.value
    assert error.status_code == 502
    assert error.attempts == 3
    assert "HTTP 502: injected HTTP 502" in str(error) and "3 attempts" in str(error)
    assert error.started_at.tzinfo is UTC and error.latency_s > 0
    assert len(stub.requests) == 3


def test_400_is_not_retried():
    fault = Fault("status", status=400, message="max_tokens is too large")
    with FaultServer(faults=[fault]) as stub:
        with pytest.raises(ChatCallError) as info:
            _chat(_config(stub))
    assert info.value.status_code == 400
    assert info.value.attempts == 1
    assert str(info.value) == "HTTP 400: max_tokens is too large (gave up after 1 attempt)"
    assert len(stub.requests) == 1


def test_api_key_is_sent_and_a_wrong_one_is_not_retried():
    with FaultServer(api_key="sesame") as stub:
        assert _chat(_config(stub, api_key="sesame")).text == SUMMARY
        with pytest.raises(ChatCallError) as info:
            _chat(_config(stub))
    assert (info.value.status_code, info.value.attempts) == (401, 1)
    assert "invalid or missing API key" in str(info.value)


def test_read_timeout_is_retried_then_gives_up():
    with FaultServer(faults=[Fault("hang", delay_s=1.0)]) as stub:
        result = _chat(_config(stub, read_timeout_s=0.3))
    assert (result.text, result.attempts) == (SUMMARY, 2)
    assert result.latency_s < 0.3  # the successful attempt only
    with FaultServer(faults=[Fault("hang", times=-1, delay_s=1.0)]) as stub:
        with pytest.raises(ChatCallError) as info:
            _chat(_config(stub, read_timeout_s=0.3, max_retries=1))
    assert info.value.status_code is None
    assert info.value.attempts == 2
    assert "ReadTimeout" in str(info.value)
    assert len(stub.requests) == 2


def test_connect_error_is_retried_then_gives_up():
    with FaultServer() as stub:
        config = _config(stub, max_retries=1)
    with pytest.raises(ChatCallError) as info:  # the stub is gone: connection refused
        _chat(config)
    assert info.value.attempts == 2 and "ConnectError" in str(info.value)


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("drop", "incomplete chunked read"),
        ("end_early", "the stream ended before [DONE]"),
        ("bad_json", "malformed stream chunk"),
    ],
)
def test_broken_stream_is_retried(kind, words, caplog):
    with FaultServer(faults=[Fault(kind)]) as stub:
        result = _chat(_config(stub))
    assert (result.text, result.attempts) == (SUMMARY, 2)
    assert words in caplog.text


def test_rejected_response_format_is_dropped_and_remembered():
    stub = FaultServer(faults=[Fault("reject_response_format", times=-1)])
    messages = [{"role": "user", "content": "Title: Sparse Attention Revisited\nReview it."}]

    async def main(client: ChatClient):
        first = await client.chat(
            messages, max_tokens=200, response_format=review_response_format()
        )
        assert client.json_schema_supported is False
        second = await client.chat(
            messages, max_tokens=200, response_format=review_response_format()
        )
        return first, second

    with stub:
        first, second = asyncio.run(_with_client(_config(stub), main))
    assert first.attempts == 1 and second.attempts == 1
    sent = ["response_format" in body for body in stub.requests]
    assert sent == [True, False, False]
    # without response_format the stub writes prose; the caller's prompt must ask for JSON
    assert first.text == summary_for("Sparse Attention Revisited")


def test_accepted_response_format_is_remembered_and_the_reply_parses():
    messages = [{"role": "user", "content": "Title: Sparse Attention Revisited\nReview it."}]

    async def main(client: ChatClient):
        assert client.json_schema_supported is None
        result = await client.chat(
            messages, max_tokens=500, response_format=review_response_format()
        )
        assert client.json_schema_supported is True
        return result

    with FaultServer() as stub:
        result = asyncio.run(_with_client(_config(stub), main))
    assert stub.requests[0]["response_format"] == review_response_format()
    parsed = parse_review(result.text, "fulltext")
    assert parsed.status == "ok" and parsed.review.input_basis == "fulltext"


def test_concurrent_calls_share_one_client():
    titles = [f"Paper {i}" for i in range(6)]

    async def main(client: ChatClient):
        calls = [
            client.chat([{"role": "user", "content": f"Title: {t}\nSummarize."}], max_tokens=100)
            for t in titles
        ]
        return await asyncio.gather(*calls)

    with FaultServer(faults=[Fault("status", status=500, match="Paper 3")]) as stub:
        results = asyncio.run(_with_client(_config(stub), main, concurrency=2))
    assert [r.text for r in results] == [summary_for(t) for t in titles]
    assert [r.attempts for r in results] == [1, 1, 1, 2, 1, 1]


def test_a_server_that_ignores_stream_is_read_whole(monkeypatch):
    def handler(request: httpx.Request) -> httpx.Response:
        message = {"role": "assistant", "content": "Whole."}
        usage = {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": None}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return httpx.Response(200, json={"choices": [choice], "usage": usage})

    transport = httpx.MockTransport(handler)
    monkeypatch.setattr(httpx, "AsyncClient", partial(httpx.AsyncClient, transport=transport))
    result = _chat(ChatClientConfig("http://mock/v1", "m"))
    assert (result.text, result.finish_reason, result.attempts) == ("Whole.", "stop", 1)
    assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (5, 2, None)
    assert result.ttft_s is not None


def test_endpoint_label():
    assert endpoint_label("http://127.0.0.1:8000/v1") == "127.0.0.1:8000/v1"
    assert endpoint_label("https://user:pw@api.example.com/v1/?key=x") == "api.example.com/v1"


def test_against_our_server(request):
    """Our own server: streamed text, usage and a prefix-cache hit on the repeated prompt."""
    url, engine = request.getfixturevalue("server")
    config = ChatClientConfig(f"{url}/v1", "tiny", api_key="secret", max_retries=0)
    messages = [{"role": "user", "content": "Write one sentence about caches."}]

    async def main(client: ChatClient):
        return [await client.chat(messages, max_tokens=8, seed=1) for _ in range(2)]

    first, second = asyncio.run(_with_client(config, main))
    prompt_len = len(engine.engine.encode_chat(messages))
    assert first.text and first.text == second.text  # greedy
    assert first.prompt_tokens == second.prompt_tokens == prompt_len
    assert 1 <= first.completion_tokens <= 8
    assert first.finish_reason in ("stop", "length")
    assert first.cached_tokens == 0
    assert 0 < second.cached_tokens < prompt_len
    assert 0 < first.ttft_s <= first.latency_s
