"""The OpenAI-compatible API, row by row: every endpoint and every request field the docs list
(docs/API.md), sent to one live server on loopback twice, with raw httpx and with the official
`openai` client (fields its method does not know go in extra_body, as users send vLLM's extras).
Each row says what must come back: the status, for an error the `param` it names, and for a
success a check on the body. A field the server would accept and ignore has no place here: it is
either honoured (a row checks its effect) or refused (a row checks the 400 names it)."""

from __future__ import annotations

import base64
import functools
import inspect
import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from engine.model_fetch import fetch_default_model
from tests.engine.server.live_server import live_server
from tests.engine.server.tool_models import TOOLS, WEATHER, build_tool_model

MODEL = "tiny"
KEY = "conformance-key"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
USER = [{"role": "user", "content": "Hello there"}]


@dataclass(frozen=True)
class Row:
    name: str
    path: str
    body: dict | None = None  # None: a GET (or `method`)
    status: int = 200
    param: str | None = None  # an error's expected `param`
    check: Callable | None = None  # on the JSON body, the streamed chunks, or the text
    stream: bool = False
    method: str | None = None
    headers: dict = field(default_factory=dict)
    text: bool = False  # the check gets the body's text (metrics)
    key: bool = True  # send the API key


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 4, "temperature": 0} | fields


def _cmpl(**fields) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0} | fields


def _tools(**fields) -> dict:
    return _chat(max_tokens=60, tools=TOOLS) | fields


@functools.cache
def _tokenizer():
    return AutoTokenizer.from_pretrained(str(fetch_default_model()))


def _ids(text: str) -> list[int]:
    return _tokenizer().encode(text, add_special_tokens=False)


# What a Qwen-style model writes to call a tool, as a regex that steers the tiny model into it.
HERMES_CALL = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}\n</tool_call>'
PROMPT = "Once upon a time"
FORCED = _ids(" the")[0]  # a token logit_bias forces
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 12 C"},
]


# ---- checks -----------------------------------------------------------------------------------


def _chat_ok(body: dict) -> None:
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["total_tokens"] == (
        body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    )


def _n_choices(n: int) -> Callable[[dict], None]:
    def check(body: dict) -> None:
        assert sorted(c["index"] for c in body["choices"]) == list(range(n))

    return check


def _completion_tokens(k: int) -> Callable[[dict], None]:
    def check(body: dict) -> None:
        assert body["usage"]["completion_tokens"] == k

    return check


def _json_object(body: dict) -> None:
    content = body["choices"][0]["message"]["content"]
    assert isinstance(json.loads(content), dict)


def _choice_in(options: list[str]) -> Callable[[dict], None]:
    def check(body: dict) -> None:
        assert body["choices"][0]["message"]["content"] in options

    return check


def _chat_logprobs(k: int) -> Callable[[dict], None]:
    def check(body: dict) -> None:
        content = body["choices"][0]["logprobs"]["content"]
        assert content and all(len(t["top_logprobs"]) == k for t in content)

    return check


def _stream_usage(chunks: list[dict]) -> None:
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def _tool_calls(names: set[str], finish: str, most: int | None = None) -> Callable:
    def check(body: dict) -> None:
        choice = body["choices"][0]
        calls = choice["message"]["tool_calls"]
        assert calls and (most is None or len(calls) <= most)
        for call in calls:
            assert call["id"].startswith("call_") and call["type"] == "function"
            assert call["function"]["name"] in names
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
        assert choice["finish_reason"] == finish

    return check


OPEN_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
NO_PARAMETERS = {"type": "function", "function": {"name": "ping"}}
COMMA = _ids(",")[0]


def _only_declared_keys(body: dict) -> None:
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    for call in choice["message"]["tool_calls"]:
        arguments = json.loads(call["function"]["arguments"])
        expected = {"add": {"a", "b"}, "ping": set()}[call["function"]["name"]]
        assert set(arguments) == expected, arguments


def _no_tool_calls(body: dict) -> None:
    message = body["choices"][0]["message"]
    assert not message.get("tool_calls") and isinstance(message["content"], str)


def _legacy_call(body: dict) -> None:
    choice = body["choices"][0]
    assert choice["message"]["function_call"]["name"] == "get_weather"
    assert json.loads(choice["message"]["function_call"]["arguments"])["city"] in ("Paris", "Oslo")
    assert choice["finish_reason"] == "stop"


def _streamed_tool_call(chunks: list[dict]) -> None:
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls: dict[int, list[dict]] = {}
    for d in deltas:
        for part in d.get("tool_calls") or []:
            calls.setdefault(part["index"], []).append(part)
    assert sorted(calls) == list(range(len(calls))) and calls
    for parts in calls.values():
        # OpenAI's order: id, type and name first, then argument fragments alone.
        assert parts[0]["id"].startswith("call_") and parts[0]["type"] == "function"
        assert parts[0]["function"]["name"] in ("get_weather", "get_time")
        assert all("id" not in p and "name" not in p.get("function", {}) for p in parts[1:])
        arguments = "".join(p["function"].get("arguments", "") for p in parts)
        assert isinstance(json.loads(arguments), dict)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "tool_calls"


def _forced(body: dict) -> None:
    ids = body["choices"][0]["token_ids"]
    assert ids == [FORCED] * len(ids) and ids


def _stopped_at_token(body: dict) -> None:
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == FORCED
    assert choice["text"] == ""


def _text_is(expected: str) -> Callable[[dict], None]:
    def check(body: dict) -> None:
        assert body["choices"][0]["text"] == expected

    return check


def _ends_with_prefill(body: dict) -> None:
    # Continued, not a new turn: the prompt ends with the assistant's own words.
    tail = _ids("The answer is")
    assert body["prompt_token_ids"][-len(tail) :] == tail


def _template_kwargs(body: dict) -> None:
    assert _tokenizer().decode(body["prompt_token_ids"]).startswith("Bonjour|Hello there")


def _prompt_logprobs(body: dict) -> None:
    lps = body["prompt_logprobs"]
    assert lps[0] is None and len(lps) == body["usage"]["prompt_tokens"]
    for position in lps[1:]:
        assert all({"logprob", "rank", "decoded_token"} <= set(v) for v in position.values())


def _token_ids(body: dict) -> None:
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"]
    assert len(body["prompt_token_ids"]) == body["usage"]["prompt_tokens"]


def _completion_token_ids(body: dict) -> None:
    choice = body["choices"][0]  # each prompt of a completions request has its own
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"]
    assert choice["prompt_token_ids"] == _ids(PROMPT)


def _prompt_tokens(k: int) -> Callable[[dict], None]:
    def check(body: dict) -> None:
        assert body["usage"]["prompt_tokens"] == k

    return check


def _truncated(k: int) -> Callable[[dict], None]:
    def check(body: dict) -> None:
        assert body["usage"]["prompt_tokens"] == k
        # echo repeats what was kept: the prompt's last k tokens
        assert body["choices"][0]["text"].startswith(_tokenizer().decode(_ids(TOO_LONG)[-k:]))

    return check


def _echo_logprobs(body: dict) -> None:
    choice, usage = body["choices"][0], body["usage"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == usage["prompt_tokens"] + usage["completion_tokens"]
    assert lp["token_logprobs"][0] is None and lp["token_logprobs"][1] < 0
    assert choice["text"].startswith(PROMPT)
    assert "prompt_logprobs" not in choice  # not asked for
    # text_offset: where each token starts in the returned text.
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets


def _scored(body: dict) -> None:
    choice = body["choices"][0]
    assert body["usage"]["completion_tokens"] == 0 and choice["text"] == PROMPT
    assert len(choice["logprobs"]["token_logprobs"]) == body["usage"]["prompt_tokens"]


def _streamed_logprobs(chunks: list[dict]) -> None:
    tokens = [t for c in chunks if c["choices"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == 4


def _served_model(body: dict) -> None:
    assert body["model"] == MODEL


def _overflow(body: dict) -> None:
    raise AssertionError("never called: the row is an error")


def _embedding(dims: int, count: int = 1) -> Callable[[dict], None]:
    def check(body: dict) -> None:
        assert body["object"] == "list" and len(body["data"]) == count
        for i, item in enumerate(body["data"]):
            vector = item["embedding"]
            if isinstance(vector, str):
                vector = _base64_floats(vector)
            assert item["index"] == i and len(vector) == dims
            assert math.isclose(math.fsum(v * v for v in vector), 1.0, rel_tol=1e-4)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0

    return check


def _tokenized(body: dict) -> None:
    assert body["count"] == len(body["tokens"]) and body["tokens"] == _ids(PROMPT)
    assert body["max_model_len"] == 512


def _tokenized_chat(body: dict) -> None:
    assert body["count"] == len(body["tokens"]) > len(_ids("Hello there"))


def _detokenized(body: dict) -> None:
    assert body == {"prompt": PROMPT}


def _models(body: dict) -> None:
    (card,) = body["data"]
    _card(card)


def _card(card: dict) -> None:
    assert card["id"] == MODEL and card["object"] == "model"
    assert card["max_model_len"] == 512 and card["parent"] is None
    assert isinstance(card["created"], int) and card["created"] > 0 and card["root"]


def _health(body: dict) -> None:
    assert body == {"status": "ok"}


def _preflight(body: str, headers: httpx.Headers) -> None:
    assert headers["access-control-allow-origin"] in ("*", "https://example.org")


def _vllm_metrics(text: str) -> None:
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert f'{name}{{engine="0",model_name="{MODEL}"}}' in text, name
    assert "vllm:time_to_first_token_seconds_bucket" in text
    assert 'vllm:request_success_total{engine="0",finished_reason="stop"' in text


TOO_LONG = "word " * 700  # more than the 512 tokens this server takes

ROWS = [
    # -- chat: what every client sends
    Row("chat plain", CHAT, _chat(), check=_chat_ok),
    Row("chat n=3", CHAT, _chat(n=3, temperature=1.0, seed=1), check=_n_choices(3)),
    Row("chat max_completion_tokens", CHAT, _chat(max_completion_tokens=2), check=_chat_ok),
    Row(
        "chat ignore_eos + min_tokens",
        CHAT,
        _chat(max_tokens=5, min_tokens=5, ignore_eos=True),
        check=_completion_tokens(5),
    ),
    Row("chat logprobs", CHAT, _chat(logprobs=True, top_logprobs=3), check=_chat_logprobs(3)),
    Row(
        "chat stream + include_usage",
        CHAT,
        _chat(stream=True, stream_options={"include_usage": True}, ignore_eos=True),
        check=_stream_usage,
        stream=True,
    ),
    Row("chat model omitted", CHAT, {"messages": USER, "max_tokens": 2}, check=_served_model),
    Row("chat seed int64 max", CHAT, _chat(seed=2**63 - 1, temperature=1.0), check=_chat_ok),
    Row("chat seed negative", CHAT, _chat(seed=-7, temperature=1.0), check=_chat_ok),
    Row("chat unknown field", CHAT, _chat(not_a_field=1), check=_chat_ok),
    # -- structured output, by each name
    Row(
        "chat response_format json_object",
        CHAT,
        _chat(max_tokens=40, response_format={"type": "json_object"}),
        check=_json_object,
    ),
    Row(
        "chat response_format json_schema",
        CHAT,
        _chat(
            max_tokens=40,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": WEATHER["function"]["parameters"]},
            },
        ),
        check=_json_object,
    ),
    Row(
        "chat guided_choice",
        CHAT,
        _chat(max_tokens=10, guided_choice=["yes", "no"]),
        check=_choice_in(["yes", "no"]),
    ),
    Row(
        "chat structured_outputs choice",
        CHAT,
        _chat(max_tokens=10, structured_outputs={"choice": ["red", "blue"]}),
        check=_choice_in(["red", "blue"]),
    ),
    Row(
        "chat structured_outputs + response_format",
        CHAT,
        _chat(structured_outputs={"choice": ["a"]}, response_format={"type": "json_object"}),
        400,
        "response_format",
    ),
    # -- tool calling
    Row(
        "tools required",
        CHAT,
        _tools(tool_choice="required"),
        check=_tool_calls({"get_weather", "get_time"}, "tool_calls"),
    ),
    Row(
        "tools named, an open schema is closed to its properties",
        CHAT,
        _chat(
            max_tokens=60,
            tool_choice={"type": "function", "function": {"name": "add"}},
            tools=[OPEN_TOOL, NO_PARAMETERS],
            # Pushed towards "," after every value: an open object would take another key.
            logit_bias={str(COMMA): 30},
        ),
        check=_only_declared_keys,
    ),
    Row(
        "tools required, parallel_tool_calls false",
        CHAT,
        _tools(tool_choice="required", parallel_tool_calls=False),
        check=_tool_calls({"get_weather", "get_time"}, "tool_calls", most=1),
    ),
    Row(
        "tools named",
        CHAT,
        _tools(tool_choice={"type": "function", "function": {"name": "get_time"}}),
        check=_tool_calls({"get_time"}, "stop"),
    ),
    Row("tools none", CHAT, _tools(tool_choice="none", max_tokens=4), check=_no_tool_calls),
    Row(
        "tools auto (output steered into a Hermes call)",
        CHAT,
        _tools(tool_choice="auto", guided_regex=HERMES_CALL),
        check=_tool_calls({"get_time"}, "tool_calls"),
    ),
    Row(
        "tools required, streamed",
        CHAT,
        _tools(tool_choice="required", stream=True),
        check=_streamed_tool_call,
        stream=True,
    ),
    Row(
        "tool results in the history",
        CHAT,
        _tools(messages=HISTORY, tool_choice="none", max_tokens=4),
        check=_no_tool_calls,
    ),
    Row(
        "legacy functions + function_call",
        CHAT,
        _chat(
            max_tokens=60,
            functions=[WEATHER["function"]],
            function_call={"name": "get_weather"},
        ),
        check=_legacy_call,
    ),
    Row(
        "tool_choice names an unknown function",
        CHAT,
        _tools(tool_choice={"type": "function", "function": {"name": "nope"}}),
        400,
        "tool_choice",
    ),
    Row("tool_choice without tools", CHAT, _chat(tool_choice="required"), 400, "tool_choice"),
    # -- chat template fields
    Row(
        "continue_final_message",
        CHAT,
        _chat(
            messages=USER + [{"role": "assistant", "content": "The answer is"}],
            continue_final_message=True,
            add_generation_prompt=False,
            return_token_ids=True,
        ),
        check=_ends_with_prefill,
    ),
    Row(
        "continue_final_message + add_generation_prompt",
        CHAT,
        _chat(
            messages=USER + [{"role": "assistant", "content": "The"}],
            continue_final_message=True,
            add_generation_prompt=True,
        ),
        400,
        "continue_final_message",
    ),
    Row(
        "chat_template + chat_template_kwargs",
        CHAT,
        _chat(
            chat_template="{{ greeting }}|{% for m in messages %}{{ m.content }}{% endfor %}",
            chat_template_kwargs={"greeting": "Bonjour"},
            return_token_ids=True,
        ),
        check=_template_kwargs,
    ),
    Row(
        "chat_template that fails",
        CHAT,
        _chat(chat_template="{{ raise_exception('no') }}"),
        400,
        "chat_template",
    ),
    Row("chat prompt_logprobs", CHAT, _chat(prompt_logprobs=2), check=_prompt_logprobs),
    Row("chat return_token_ids", CHAT, _chat(return_token_ids=True), check=_token_ids),
    # -- chat: refused, naming the field
    Row(
        "image part",
        CHAT,
        _chat(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ]
        ),
        400,
        "messages[0].content",
    ),
    Row(
        "audio part",
        CHAT,
        _chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
                    ],
                }
            ]
        ),
        400,
        "messages[0].content",
    ),
    Row("top_logprobs without logprobs", CHAT, _chat(top_logprobs=2), 400, "top_logprobs"),
    Row(
        "stream_options without stream",
        CHAT,
        _chat(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    Row(
        "chat lone surrogate",
        CHAT,
        _chat(messages=[{"role": "user", "content": "a\ud800"}]),
        400,
        "messages[0].content",
    ),
    Row(
        "chat unknown role",
        CHAT,
        _chat(messages=[{"role": "wizard", "content": "hi"}]),
        400,
        "messages[0].role",
    ),
    Row(
        "chat max_completion_tokens over the context",
        CHAT,
        _chat(max_completion_tokens=9000),
        400,
        "max_completion_tokens",
    ),
    Row(
        "chat structured_outputs without a constraint",
        CHAT,
        _chat(structured_outputs={"bogus": 1}),
        400,
        "structured_outputs",
    ),
    Row(
        "chat stop_token_ids outside the vocabulary",
        CHAT,
        _chat(stop_token_ids=[10**8]),
        400,
        "stop_token_ids",
    ),
    Row(
        "chat empty content array",
        CHAT,
        _chat(messages=[{"role": "user", "content": []}]),
        400,
        "messages[0].content",
    ),
    Row(
        "chat user content null",
        CHAT,
        _chat(messages=[{"role": "user", "content": None}]),
        400,
        "messages[0].content",
    ),
    Row("chat tools empty", CHAT, _chat(tools=[]), 400, "tools"),
    Row("chat priority as a string", CHAT, _chat(priority="1"), 400, "priority"),
    Row(
        "completion truncate_prompt_tokens over max_model_len",
        COMPLETIONS,
        _cmpl(truncate_prompt_tokens=10**6),
        400,
        "truncate_prompt_tokens",
    ),
    Row("chat temperature < 0", CHAT, _chat(temperature=-1), 400, "temperature"),
    Row("chat temperature not a number", CHAT, _chat(temperature="hot"), 400, "temperature"),
    Row("chat top_p 0", CHAT, _chat(top_p=0), 400, "top_p"),
    Row("chat n 0", CHAT, _chat(n=0), 400, "n"),
    Row("chat seed beyond int64", CHAT, _chat(seed=2**63), 400, "seed"),
    Row("chat wrong model", CHAT, _chat(model="gpt-4"), 404, "model"),
    Row("chat no messages", CHAT, _chat(messages=[]), 400, "messages"),
    Row(
        "chat context overflow",
        CHAT,
        _chat(messages=[{"role": "user", "content": TOO_LONG}]),
        400,
        "messages",
    ),
    Row("chat logit_bias key not a token", CHAT, _chat(logit_bias={"x": 5}), 400, "logit_bias"),
    # -- completions
    Row("completion plain", COMPLETIONS, _cmpl(), check=_completion_tokens(4)),
    Row(
        "completion logit_bias forces a token",
        COMPLETIONS,
        _cmpl(logit_bias={str(FORCED): 100}, return_token_ids=True),
        check=_forced,
    ),
    Row(
        "completion stop_token_ids",
        COMPLETIONS,
        _cmpl(logit_bias={str(FORCED): 100}, stop_token_ids=[FORCED]),
        check=_stopped_at_token,
    ),
    Row(
        "completion stop string, not included",
        COMPLETIONS,
        _cmpl(logit_bias={str(FORCED): 100}, stop=["the"]),
        check=_text_is(" "),
    ),
    Row(
        "completion include_stop_str_in_output",
        COMPLETIONS,
        _cmpl(logit_bias={str(FORCED): 100}, stop=["the"], include_stop_str_in_output=True),
        check=_text_is(" the"),
    ),
    Row(
        "completion echo + logprobs (prompt logprobs, text_offset)",
        COMPLETIONS,
        _cmpl(echo=True, logprobs=2),
        check=_echo_logprobs,
    ),
    Row(
        "completion stop_token_ids + include_stop_str_in_output",
        COMPLETIONS,
        _cmpl(
            logit_bias={str(FORCED): 100}, stop_token_ids=[FORCED], include_stop_str_in_output=True
        ),
        check=_text_is(" the"),
    ),
    Row("completion lone surrogate", COMPLETIONS, _cmpl(prompt="\udfff"), 400, "prompt"),
    Row(
        "completion echo + max_tokens 0 (scoring)",
        COMPLETIONS,
        _cmpl(echo=True, logprobs=1, max_tokens=0),
        check=_scored,
    ),
    Row(
        "completion streamed logprobs",
        COMPLETIONS,
        _cmpl(logprobs=1, stream=True, ignore_eos=True),
        check=_streamed_logprobs,
        stream=True,
    ),
    Row(
        "completion return_token_ids",
        COMPLETIONS,
        _cmpl(return_token_ids=True),
        check=_completion_token_ids,
    ),
    Row(
        "completion prompt_logprobs",
        COMPLETIONS,
        _cmpl(prompt_logprobs=1),
        check=lambda b: _prompt_logprobs(
            {"prompt_logprobs": b["choices"][0]["prompt_logprobs"], "usage": b["usage"]}
        ),
    ),
    Row(
        "completion structured_outputs regex",
        COMPLETIONS,
        _cmpl(max_tokens=10, structured_outputs={"regex": "[0-9]{3}"}),
        check=lambda b: re.fullmatch("[0-9]{3}", b["choices"][0]["text"]),
    ),
    Row(
        "completion model omitted",
        COMPLETIONS,
        {"prompt": PROMPT, "max_tokens": 2},
        check=_served_model,
    ),
    Row(
        "completion truncate_prompt_tokens",
        COMPLETIONS,
        _cmpl(prompt=TOO_LONG, truncate_prompt_tokens=8, echo=True),
        check=_truncated(8),
    ),
    Row(
        "completion truncate_prompt_tokens 0",
        COMPLETIONS,
        _cmpl(truncate_prompt_tokens=0),
        400,
        "truncate_prompt_tokens",
    ),
    Row("completion priority", COMPLETIONS, _cmpl(priority=-5), check=_completion_tokens(4)),
    Row("completion priority beyond int64", COMPLETIONS, _cmpl(priority=2**63), 400, "priority"),
    Row("completion suffix", COMPLETIONS, _cmpl(suffix="The end."), 400, "suffix"),
    Row(
        "completion max_tokens 0 without echo", COMPLETIONS, _cmpl(max_tokens=0), 400, "max_tokens"
    ),
    Row("completion logprobs out of range", COMPLETIONS, _cmpl(logprobs=99), 400, "logprobs"),
    Row(
        "completion stream_options without stream",
        COMPLETIONS,
        _cmpl(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    Row("completion context overflow", COMPLETIONS, _cmpl(prompt=TOO_LONG), 400, "prompt"),
    # -- embeddings
    Row("embeddings string", EMBEDDINGS, {"model": MODEL, "input": PROMPT}, check=_embedding(64)),
    Row(
        "embeddings list, base64",
        EMBEDDINGS,
        {"input": ["a", "b c"], "encoding_format": "base64"},
        check=_embedding(64, 2),
    ),
    Row(
        "embeddings token ids, dimensions",
        EMBEDDINGS,
        {"input": [_ids(PROMPT)], "dimensions": 8},
        check=_embedding(8),
    ),
    Row(
        "embeddings dimensions too big",
        EMBEDDINGS,
        {"input": "a", "dimensions": 10**6},
        400,
        "dimensions",
    ),
    Row("embeddings empty input", EMBEDDINGS, {"input": []}, 400, "input"),
    Row("embeddings lone surrogate", EMBEDDINGS, {"input": ["ok", "\ud800"]}, 400, "input[1]"),
    Row(
        "embeddings truncate_prompt_tokens",
        EMBEDDINGS,
        {"input": TOO_LONG, "truncate_prompt_tokens": 16},
        check=lambda b: _embedding(64)(b) or _prompt_tokens(16)(b),
    ),
    # -- tokenizer endpoints, models, probes, CORS, metrics
    Row(
        "tokenize prompt",
        "/tokenize",
        {"prompt": PROMPT, "add_special_tokens": False},
        check=_tokenized,
    ),
    Row(
        "tokenize messages",
        "/tokenize",
        {"messages": USER, "add_special_tokens": False},
        check=_tokenized_chat,
    ),
    Row("tokenize lone surrogate", "/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
    Row("detokenize", "/detokenize", {"tokens": _ids(PROMPT)}, check=_detokenized),
    Row("detokenize out of vocabulary", "/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    Row("models", "/v1/models", check=_models),
    Row("models retrieve", f"/v1/models/{MODEL}", check=_card),
    Row("models retrieve unknown", "/v1/models/gpt-4", status=404, param="model"),
    Row("health", "/health", check=_health, key=False),
    Row("ping", "/ping", check=_health, key=False),
    Row(
        "CORS preflight without the key",
        CHAT,
        method="OPTIONS",
        headers={
            "Origin": "https://example.org",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
        check=_preflight,
        key=False,
        text=True,
    ),
    Row("no key", CHAT, _chat(), 401, None, key=False),
    Row("metrics (vLLM's names)", "/metrics", check=_vllm_metrics, text=True, key=False),
]


# ---- the server and the two ways in ---------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tool_model(tmp_path_factory.mktemp("conformance"))
    # Rows send their own chat_template: a server that trusts its callers with that.
    trusted = {"trust_request_chat_template": True}
    with live_server(model_dir, MODEL, api_key=KEY, max_model_len=512, app_options=trusted) as (
        url,
        _,
    ):
        yield url


def _sse_chunks(text: str) -> list[dict]:
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", "every stream ends with data: [DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_row_with_httpx(server, row: Row):
    headers = {"Authorization": f"Bearer {KEY}"} if row.key else {}
    method = row.method or ("GET" if row.body is None else "POST")
    with httpx.Client(base_url=server, headers=headers | row.headers, timeout=60) as http:
        # json.dumps escapes a lone surrogate as \\ud800, as JavaScript clients send it
        # (httpx's own encoder refuses to).
        content = None if row.body is None else json.dumps(row.body)
        headers = {"Content-Type": "application/json"} if content else {}
        resp = http.request(method, row.path, content=content, headers=headers)
    assert resp.status_code == row.status, resp.text
    if row.status != 200:
        error = resp.json()["error"]
        assert error["param"] == row.param, error
        assert error["message"] and error["type"]
        if "overflow" in row.name:
            # LiteLLM and others recognise a context overflow by OpenAI's own words.
            assert error["message"].startswith("This model's maximum context length is 512")
            assert error["code"] == "context_length_exceeded"
        return
    if row.check is None:
        return
    if row.method == "OPTIONS":
        row.check(resp.text, resp.headers)
    elif row.text:
        row.check(resp.text)
    else:
        row.check(_sse_chunks(resp.text) if row.stream else resp.json())


def _split(method: Callable, body: dict) -> dict:
    """The method's own keyword arguments, and the rest in extra_body (vLLM's extras)."""
    known = set(inspect.signature(method).parameters)
    kwargs = {k: v for k, v in body.items() if k in known}
    extra = {k: v for k, v in body.items() if k not in known}
    return {**kwargs, "extra_body": extra} if extra else kwargs


_CLIENT_PATHS = (CHAT, COMPLETIONS, EMBEDDINGS, "/v1/models", f"/v1/models/{MODEL}")
# The client's methods require `model`: the rows that leave it out are for httpx alone.
_CLIENT_ROWS = [
    r
    for r in ROWS
    if r.path in _CLIENT_PATHS
    and r.key
    and r.method is None
    and (r.body is None or "model" in r.body or r.path == EMBEDDINGS)
    and "surrogate" not in r.name  # the client cannot encode one
]


@pytest.mark.parametrize("row", _CLIENT_ROWS, ids=[r.name for r in _CLIENT_ROWS])
def test_row_with_the_openai_client(server, row: Row):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    if row.path == "/v1/models":
        row.check(client.models.list().model_dump())
        return
    if row.path.startswith("/v1/models/"):
        row.check(client.models.retrieve(row.path.rsplit("/", 1)[1]).model_dump())
        return
    method = {
        CHAT: client.chat.completions.create,
        COMPLETIONS: client.completions.create,
        EMBEDDINGS: client.embeddings.create,
    }[row.path]
    body = dict(row.body)
    if row.path == EMBEDDINGS:
        body.setdefault("model", MODEL)  # the client's signature requires it
        body.setdefault("encoding_format", "float")  # else it asks base64 and decodes it itself
    try:
        result = method(**_split(method, body))
    except openai.APIStatusError as e:
        assert e.status_code == row.status, e
        assert e.body["param"] == row.param, e.body
        return
    assert row.status == 200, f"expected {row.status}, got a response"
    if row.stream:
        body = [chunk.model_dump(exclude_unset=True) for chunk in result]
    else:
        # Fields the client's models do not declare (vLLM's extras) stay in model_extra.
        body = result.model_dump(warnings=False)
    if row.check is not None:
        row.check(body)


def test_every_client_row_reaches_its_method():
    """The table's client half is not empty by accident."""
    assert len(_CLIENT_ROWS) > 50


def _base64_floats(data: str) -> list[float]:
    raw = base64.b64decode(data)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))
