"""LiteLLM's completion() against a live server as an OpenAI-compatible provider
("openai/<served name>" with api_base): chat, streaming, tools, and response_format
json_schema. LITELLM_LOCAL_MODEL_COST_MAP keeps its import off the network."""

from __future__ import annotations

import json
import os

import pytest

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
import litellm  # noqa: E402

from tests.engine.server.live_server import live_server  # noqa: E402
from tests.engine.server.tool_models import build_tool_model  # noqa: E402

MODEL = "tiny"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def call(tmp_path_factory):
    folder = build_tool_model(tmp_path_factory.mktemp("litellm"))
    with live_server(folder, MODEL, api_key="secret", max_model_len=1024) as (url, _):

        def completion(**kwargs):
            kwargs = {"messages": ASK, "max_tokens": 12, "temperature": 0} | kwargs
            return litellm.completion(
                model=f"openai/{MODEL}", api_base=f"{url}/v1", api_key="secret", **kwargs
            )

        yield completion


def test_chat_and_stream(call):
    resp = call()
    text = resp.choices[0].message.content
    assert isinstance(text, str) and resp.usage.completion_tokens > 0
    chunks = list(call(stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


def test_tools(call):
    resp = call(tools=[WEATHER], tool_choice="required", max_tokens=40)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    (tool_call,) = choice.message.tool_calls[:1]
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments)["city"] in ("Paris", "Oslo")


def test_response_format_json_schema(call):
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "blue"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    resp = call(
        max_tokens=20,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "pick", "schema": schema, "strict": True},
        },
    )
    assert json.loads(resp.choices[0].message.content)["colour"] in ("red", "blue")
