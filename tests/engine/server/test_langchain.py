"""langchain-openai's ChatOpenAI against a live server (a tiny model whose template renders
tools): plain invoke and .stream, bind_tools with tool_choice "required" and a named tool, and
with_structured_output (function_calling and json_schema) returning parsed objects, streamed tool
calls assembled by LangChain. strict=True makes
LangChain send closed schemas (additionalProperties false), which a random model needs to finish
its arguments instead of inventing keys until max_tokens."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.engine.server.live_server import live_server
from tests.engine.server.tool_models import build_tool_model

MODEL = "tiny"


class Weather(BaseModel):
    """The weather forecast of a city."""

    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=7)


class Clock(BaseModel):
    """The time in a zone."""

    zone: Literal["UTC", "CET"]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    folder = build_tool_model(tmp_path_factory.mktemp("lc"))
    with live_server(folder, MODEL, api_key="secret", max_model_len=1024) as (url, _):
        yield ChatOpenAI(
            model=MODEL,
            base_url=f"{url}/v1",
            api_key="secret",
            temperature=0,
            max_tokens=60,
            max_retries=0,
            timeout=60,
        )


def test_invoke_and_stream_agree(chat):
    answer = chat.invoke("Name a colour.")
    assert isinstance(answer, AIMessage) and isinstance(answer.content, str)
    assert answer.response_metadata["finish_reason"] in ("stop", "length")
    streamed = "".join(chunk.content for chunk in chat.stream("Name a colour."))
    assert streamed == answer.content


def test_bind_tools_with_required_and_named_choice(chat):
    for choice in ("required", "Clock"):
        bound = chat.bind_tools([Weather, Clock], tool_choice=choice, strict=True)
        message = bound.invoke("What time is it in Berlin?")
        assert message.tool_calls, message
        call = message.tool_calls[0]
        assert call["name"] in ("Weather", "Clock") and call["id"].startswith("call_")
        if choice == "Clock":
            assert call["name"] == "Clock" and call["args"]["zone"] in ("UTC", "CET")
        # The call and its result go back to the model through the template.
        follow_up = [
            HumanMessage("What time is it in Berlin?"),
            message,
            ToolMessage(json.dumps({"time": "12:00"}), tool_call_id=call["id"]),
        ]
        assert isinstance(chat.invoke(follow_up).content, str)


def test_structured_output_by_function_calling(chat):
    structured = chat.with_structured_output(Weather, method="function_calling", strict=True)
    forecast = structured.invoke("Weather in Oslo for three days?")
    assert isinstance(forecast, Weather)
    assert forecast.city in ("Paris", "Oslo") and 1 <= forecast.days <= 7


def test_structured_output_by_json_schema(chat):
    """LangChain's default method: response_format json_schema, parsed by LangChain."""
    structured = chat.with_structured_output(Weather, method="json_schema", strict=True)
    forecast = structured.invoke("Weather in Paris for two days?")
    assert isinstance(forecast, Weather) and 1 <= forecast.days <= 7


def test_streamed_tool_calls_assemble(chat):
    """Streamed delta.tool_calls chunks add up, in LangChain, to the same kind of call."""
    bound = chat.bind_tools([Clock], tool_choice="Clock", strict=True)
    merged = None
    for chunk in bound.stream("What time is it in Berlin?"):
        merged = chunk if merged is None else merged + chunk
    (call,) = merged.tool_calls
    assert call["name"] == "Clock" and call["args"]["zone"] in ("UTC", "CET")
