"""Structured output over HTTP: OpenAI's response_format (json_schema, json_object) and vLLM's
guided_* fields, driven by the official openai client against a live uvicorn server with a tiny
model; a bad constraint is a 400 that names the problem and the server keeps serving."""

from __future__ import annotations

import json
import re
import shutil
import socket
import threading
import time

import openai
import pytest
import uvicorn

from digest.review_parse import review_response_format
from engine import EngineConfig
from engine.async_engine import AsyncEngine
from engine.model_fetch import fetch_default_model
from engine.server.app import create_app
from tests.engine.tiny_models import build_tiny_model

MODEL = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "label": {"enum": ["cat", "dog", "bird"]},
    },
    "required": ["id", "label"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True},
}
MESSAGES = [{"role": "user", "content": "Describe a pet."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_tiny_model(
        "llama", tmp_path_factory.mktemp("sso"), vocab_size=49152, eos_token_id=2, bos_token_id=1
    )
    default = fetch_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default / name).exists():
            shutil.copy(default / name, path / name)
    engine = AsyncEngine(EngineConfig(model=str(path), max_model_len=256))
    app = create_app(engine, MODEL)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    yield openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60, max_retries=0
    )
    srv.should_exit = True
    thread.join(10)
    engine.shutdown()


def _chat(client: openai.OpenAI, **kwargs):
    kwargs.setdefault("max_tokens", 32)
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, **kwargs
    ).choices[0]


def test_response_format_json_schema(server):
    choice = _chat(server, response_format=SCHEMA_FORMAT)
    data = json.loads(choice.message.content)
    assert set(data) == {"id", "label"} and data["label"] in ("cat", "dog", "bird")
    assert choice.finish_reason == "stop"


def test_response_format_json_object(server):
    choice = _chat(server, response_format={"type": "json_object"})
    assert isinstance(json.loads(choice.message.content), dict)


def test_the_digest_review_schema_is_accepted(server):
    choice = _chat(server, response_format=review_response_format(), max_tokens=8)
    assert choice.message.content.startswith('{"summary": "')


def test_guided_choice_and_regex(server):
    choices = ["yes", "no", "maybe later"]
    choice = _chat(server, extra_body={"guided_choice": choices})
    assert choice.message.content in choices and choice.finish_reason == "stop"
    completion = server.completions.create(
        model=MODEL,
        prompt="Code:",
        max_tokens=16,
        temperature=0,
        extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"},
    )
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", completion.choices[0].text)


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                }
            },
            "Invalid type: foo",
        ),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "unclosed group"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "json_schema.schema is required",
        ),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}},
            "give only one of response_format, guided_choice",
        ),
    ],
)
def test_bad_constraint_is_a_400_and_the_server_keeps_serving(server, kwargs, problem):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(server, **kwargs)
    assert info.value.status_code == 400
    assert problem in info.value.body["message"]
    assert info.value.body["type"] == "invalid_request_error"
    assert json.loads(_chat(server, response_format=SCHEMA_FORMAT).message.content)


def test_streaming_with_a_schema(server):
    full = _chat(server, response_format=SCHEMA_FORMAT).message.content
    chunks = list(
        server.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            temperature=0,
            max_tokens=32,
            response_format=SCHEMA_FORMAT,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full and set(json.loads(text)) == {"id", "label"}
    assert chunks[-1].choices[0].finish_reason == "stop"
