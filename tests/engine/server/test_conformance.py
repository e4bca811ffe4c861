"""The OpenAI-compatible API, row by row: every endpoint and every request field the docs list
(docs/API.md), sent to one live server on loopback twice, with raw httpx and with the official
`openai` client (fields its method does not know go in extra_body, as users send vLLM's extras).
Each row says what must come back: the status, for an error the `param` it names, and for a
success a check on the body. A field the server would accept and ignore has no place here: it is
either honoured (a row checks its effect) or refused (a row checks the 400 names it)."""

from __future__ import annotations

import base64
import inspect
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from tests.engine.server.live_server import build_chat_model, live_server

MODEL = "tiny"
KEY = "conformance-key"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hello there"}]


@dataclass(frozen=True)
class Row:
    name: str
    path: str
    body: dict | None = None  # None: a GET
    status: int = 200
    param: str | None = None  # an error's expected `param`
    check: Callable[[dict], None] | None = None  # on the JSON body (or the streamed chunks)
    stream: bool = False
    tags: tuple[str, ...] = field(default=())


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 4, "temperature": 0} | fields


def _cmpl(**fields) -> dict:
    return {"model": MODEL, "prompt": "Once upon a", "max_tokens": 4, "temperature": 0} | fields


# ---- checks -----------------------------------------------------------------------------------


def _chat_ok(body: dict) -> None:
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
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


def _models(body: dict) -> None:
    (card,) = body["data"]
    assert card["id"] == MODEL and card["object"] == "model"
    assert card["max_model_len"] == 256


def _health(body: dict) -> None:
    assert body == {"status": "ok"}


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
    Row(
        "chat response_format json_object",
        CHAT,
        _chat(max_tokens=40, response_format={"type": "json_object"}),
        check=_json_object,
    ),
    Row(
        "chat guided_choice",
        CHAT,
        _chat(max_tokens=10, guided_choice=["yes", "no"]),
        check=_choice_in(["yes", "no"]),
    ),
    Row("chat logprobs", CHAT, _chat(logprobs=True, top_logprobs=3), check=_chat_logprobs(3)),
    Row(
        "chat stream + include_usage",
        CHAT,
        _chat(stream=True, stream_options={"include_usage": True}, ignore_eos=True),
        check=_stream_usage,
        stream=True,
    ),
    # -- chat: refused, naming the field
    Row("chat temperature < 0", CHAT, _chat(temperature=-1), 400, "temperature"),
    Row("chat top_p 0", CHAT, _chat(top_p=0), 400, "top_p"),
    Row("chat n 0", CHAT, _chat(n=0), 400, "n"),
    Row("chat wrong model", CHAT, _chat(model="gpt-4"), 404, "model"),
    Row("chat no messages", CHAT, _chat(messages=[]), 400, "messages"),
    # -- completions
    Row("completion plain", COMPLETIONS, _cmpl(), check=_completion_tokens(4)),
    Row("completion logprobs out of range", COMPLETIONS, _cmpl(logprobs=99), 400, "logprobs"),
    # -- other endpoints
    Row("models", "/v1/models", check=_models),
    Row("health", "/health", check=_health),
]


# ---- the server and the two ways in ---------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_chat_model(tmp_path_factory.mktemp("conformance"))
    with live_server(model_dir, MODEL, api_key=KEY, max_model_len=256) as (url, _):
        yield url


def _sse_chunks(text: str) -> list[dict]:
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", "every stream ends with data: [DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_row_with_httpx(server, row: Row):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server, headers=headers, timeout=60) as http:
        if row.body is None:
            resp = http.get(row.path)
        else:
            resp = http.post(row.path, json=row.body)
    assert resp.status_code == row.status, resp.text
    if row.status != 200:
        error = resp.json()["error"]
        assert error["param"] == row.param, error
        assert error["message"]
        return
    if row.check is not None:
        row.check(_sse_chunks(resp.text) if row.stream else resp.json())


def _split(method: Callable, body: dict) -> dict:
    """The method's own keyword arguments, and the rest in extra_body (vLLM's extras)."""
    known = set(inspect.signature(method).parameters)
    kwargs = {k: v for k, v in body.items() if k in known}
    extra = {k: v for k, v in body.items() if k not in known}
    return {**kwargs, "extra_body": extra} if extra else kwargs


_CLIENT_ROWS = [r for r in ROWS if r.path in (CHAT, COMPLETIONS, "/v1/models")]


@pytest.mark.parametrize("row", _CLIENT_ROWS, ids=[r.name for r in _CLIENT_ROWS])
def test_row_with_the_openai_client(server, row: Row):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    if row.path == "/v1/models":
        body = client.models.list().model_dump()
        row.check(body)
        return
    method = client.chat.completions.create if row.path == CHAT else client.completions.create
    try:
        result = method(**_split(method, row.body))
    except openai.APIStatusError as e:
        assert e.status_code == row.status, e
        assert e.body["param"] == row.param, e.body
        return
    assert row.status == 200, f"expected {row.status}, got a response"
    if row.stream:
        body = [chunk.model_dump(exclude_unset=True) for chunk in result]
    else:
        body = result.model_dump()
    if row.check is not None:
        row.check(body)


def _base64_floats(data: str) -> list[float]:
    raw = base64.b64decode(data)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))
