"""Tool calling: each "auto" parser on hand-written model outputs (whole and streamed in every
split), the readers of forced calls, and a live server with a tiny model whose Hermes-style
template renders tools, driven by the official openai client and raw httpx.

A random model does not choose to call a tool, so "auto" is driven end to end by steering its
text with a structured-output regex (allowed with tool_choice "auto", as OpenAI allows
response_format with tools): the parser then finds a real call in the model's real output."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from engine.server.app import create_app
from engine.server.protocol_chat import ChatCompletionRequest
from engine.server.tool_choice import (
    AutoCalls,
    CallDelta,
    NamedCall,
    RequiredCalls,
    collect,
    forced_constraint,
)
from engine.server.tool_parsers import PARSERS, ToolCall, detect_parser
from engine.structured.grammar import parse_spec
from engine.tokenizer import render_chat
from tests.engine.server.live_server import build_chat_model, live_server
from tests.engine.server.tool_models import CLOCK, HERMES_TEMPLATE, TOOLS, WEATHER, build_tool_model

MODEL = "tiny"
NAMES = {"get_weather", "get_time"}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# The text a Qwen-style model writes when it calls a tool, as a regex that steers the tiny one.
HERMES_CALL = (
    r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "Paris", "days": 2\}\}\n</tool_call>'
)


# -- parsers on hand-written outputs


def _events(parser_name: str, text: str, cuts: list[int]) -> list:
    """The parser's events when text arrives in pieces ending at cuts, with content merged."""
    parser = PARSERS[parser_name]()
    events, start = [], 0
    for cut in [*cuts, len(text)]:
        events += parser.feed(text[start:cut])
        start = cut
    events += parser.finish()
    merged: list = []
    for e in events:
        if isinstance(e, str) and merged and isinstance(merged[-1], str):
            merged[-1] += e
        else:
            merged.append(e)
    return merged


def _parse_everyway(parser_name: str, text: str) -> list:
    """Whole, token by token (character by character) and split once at every position: the
    same events each way, which is returned."""
    whole = _events(parser_name, text, [])
    assert _events(parser_name, text, list(range(1, len(text)))) == whole
    for cut in range(1, len(text)):
        assert _events(parser_name, text, [cut]) == whole, cut
    return whole


def _call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, json.dumps(arguments))


def test_hermes_text_then_several_calls():
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    )
    assert _parse_everyway("hermes", text) == [
        "Let me check.",
        _call("get_weather", city="Paris", days=2),
        _call("get_time", zone="UTC"),
    ]


def test_hermes_plain_text_is_untouched_even_with_tag_like_pieces():
    text = "a < b and <tool is not <tool_call either?  \n"
    assert _parse_everyway("hermes", text) == [text]


def test_hermes_malformed_call_stays_content():
    text = 'Sure <tool_call>{"name": "get_weather", "arguments": {oops}}</tool_call> done'
    assert _parse_everyway("hermes", text) == [text]
    # A call without a name is no call either.
    text = '<tool_call>{"arguments": {}}</tool_call>'
    assert _parse_everyway("hermes", text) == [text]


def test_hermes_call_closed_by_end_of_output_and_an_unfinished_one():
    # Models often stop at EOS before the closing tag: a whole JSON object is still a call.
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
    assert _parse_everyway("hermes", text) == [_call("get_time", zone="CET")]
    # Cut off by max_tokens: the half call is returned as the text it is.
    text = 'Hm <tool_call>\n{"name": "get_time", "argu'
    assert _parse_everyway("hermes", text) == [text]


def test_hermes_arguments_given_as_a_json_string():
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>'
    assert _parse_everyway("hermes", text) == [_call("get_time", zone="UTC")]


def test_llama3_json_calls_with_and_without_python_tag():
    text = '  {"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "f", "parameters": {}}'
    assert _parse_everyway("llama3_json", text) == [_call("get_time", zone="UTC"), _call("f")]
    text = 'On it. <|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}'
    assert _parse_everyway("llama3_json", text) == ["On it.", _call("get_time", zone="UTC")]


def test_llama3_json_answer_that_is_not_a_call_stays_content():
    for text in ('{"answer": 42}', '{"name": "f", "parameters": [1]}', "{not json}", "It is {x}"):
        assert _parse_everyway("llama3_json", text) == [text]


def test_mistral_calls_with_and_without_the_marker():
    calls = '[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "f", "arguments": {}}]'
    expected = [_call("get_time", zone="UTC"), _call("f")]
    assert _parse_everyway("mistral", calls) == expected
    assert _parse_everyway("mistral", "[TOOL_CALLS]" + calls) == expected
    text = 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"s": "a ] } [ string"}}]'
    assert _parse_everyway("mistral", text) == ["Sure.", _call("f", s="a ] } [ string")]


def test_mistral_array_that_is_not_calls_stays_content():
    for text in ("[1, 2, 3]", '[{"name": "f"}, 7]', '[TOOL_CALLS][{"name": "f", "argu'):
        assert _parse_everyway("mistral", text) == [text]


def test_parser_detected_from_the_template():
    assert detect_parser(HERMES_TEMPLATE) == "hermes"
    assert detect_parser("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_parser("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert detect_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None


# -- forced calls


def test_required_reader_streams_arguments_and_agrees_with_the_whole_text():
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, '
        '{"name": "get_time", "parameters": {"zone": "{]"}}]'
    )
    whole = RequiredCalls()
    content, calls = collect(whole.feed(text) + whole.finish())
    assert content == ""
    assert calls == [
        ToolCall("get_weather", '{"city": "Paris", "days": 2}'),
        ToolCall("get_time", '{"zone": "{]"}'),
    ]
    streamed = RequiredCalls()
    pieces = [p for ch in text for p in streamed.feed(ch)]
    assert collect(pieces) == (content, calls)
    # Each call starts with its name and empty arguments; no fragment holds the space after
    # the colon or the closing brackets of the call and the array.
    assert [p for p in pieces if p.name] == [
        CallDelta(0, "get_weather", ""),
        CallDelta(1, "get_time", ""),
    ]
    single = RequiredCalls()
    assert collect(single.feed('{"name": "get_time", "parameters": {}}')) == (
        "",
        [ToolCall("get_time", "{}")],
    )


def test_named_reader_is_the_whole_text_as_arguments():
    reader = NamedCall("get_time")
    pieces = reader.feed("") + reader.feed('{"zone"') + reader.feed(': "UTC"}') + reader.finish()
    assert pieces[0] == CallDelta(0, "get_time", "")
    assert collect(pieces) == ("", [ToolCall("get_time", '{"zone": "UTC"}')])


def test_auto_reader_keeps_one_call_unless_parallel():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
    )
    for parallel, names in ((True, ["a", "b"]), (False, ["a"])):
        reader = AutoCalls(PARSERS["hermes"](), parallel)
        content, calls = collect(reader.feed(text) + reader.finish())
        assert content == "" and [c.name for c in calls] == names
        assert reader.num_calls == len(names)


def test_forced_constraints_compile():
    for choice, parallel in (("required", True), ("required", False)):
        parse_spec(forced_constraint(TOOLS, choice, parallel))
    named = {"type": "function", "function": {"name": "get_time"}}
    assert forced_constraint(TOOLS, named, True) == {"json": CLOCK["function"]["parameters"]}
    assert forced_constraint(TOOLS, "auto", True) is None


def test_tool_calls_and_results_render_back_through_the_template(tmp_path):
    """An assistant's tool_calls (arguments as OpenAI's JSON string) and the tool's result
    render as the model was taught: arguments as an object, the result in <tool_response>."""
    folder = build_tool_model(tmp_path)
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(folder)
    body = ChatCompletionRequest(
        model=MODEL,
        tools=TOOLS,
        messages=[
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        ],
    )
    setup = body.tool_setup()
    text = tokenizer.decode(render_chat(tokenizer, body.template_messages(), tools=setup.tools))
    assert '"name": "get_weather"' in text and "The weather forecast of a city" in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


# -- a live server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = build_tool_model(tmp_path_factory.mktemp("tools"))
    trusted = {"trust_request_chat_template": True}
    with live_server(folder, MODEL, max_model_len=1024, app_options=trusted) as running:
        yield running


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=60, max_retries=0)


def _ask(url: str, **kwargs):
    kwargs = {"messages": ASK, "tools": TOOLS, "max_tokens": 80, "temperature": 0} | kwargs
    return _client(url).chat.completions.create(model=MODEL, **kwargs)


def _streamed_calls(url: str, **kwargs) -> tuple[list, list[dict], str]:
    """(chunks, calls reassembled from the deltas, last finish_reason) of a streamed answer."""
    chunks = list(_ask(url, stream=True, **kwargs))
    calls: list[dict] = []
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            if tc.id is not None:  # a call's first delta: id, type, name, empty arguments
                assert tc.type == "function" and tc.function.name and tc.function.arguments == ""
                assert tc.index == len(calls)
                calls.append({"id": tc.id, "name": tc.function.name, "arguments": ""})
            else:  # later ones: index and an arguments fragment only
                assert tc.function.name is None and tc.type is None
                calls[tc.index]["arguments"] += tc.function.arguments
    return chunks, calls, chunks[-1].choices[0].finish_reason


def _check_arguments(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7
    else:
        assert args["zone"] in ("UTC", "CET")


def test_template_renders_the_tools_into_the_prompt(server):
    _, engine = server
    ids = engine.encode_chat(ASK, tools=TOOLS)
    with_tools = engine.info.tokenizer.decode(ids)
    assert "get_weather" in with_tools and "get_time" in with_tools
    assert "get_weather" not in engine.info.tokenizer.decode(engine.encode_chat(ASK))


def test_required_gives_well_formed_calls_streamed_as_openai_does(server):
    url, _ = server
    resp = _ask(url, tool_choice="required", parallel_tool_calls=False)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name in NAMES
    _check_arguments(call.function.name, call.function.arguments)
    _, calls, finish = _streamed_calls(url, tool_choice="required", parallel_tool_calls=False)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]


def test_required_with_parallel_calls(server):
    url, _ = server
    resp = _ask(url, tool_choice="required", max_tokens=200)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) >= 1
    for call in choice.message.tool_calls:
        assert call.function.name in NAMES
        _check_arguments(call.function.name, call.function.arguments)
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)
    _, calls, _ = _streamed_calls(url, tool_choice="required", max_tokens=200)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


def test_named_function_is_called_and_ends_as_stop(server):
    url, _ = server
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = _ask(url, tool_choice=named).choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's finish_reason for a forced function
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    _check_arguments("get_time", call.function.arguments)
    _, calls, finish = _streamed_calls(url, tool_choice=named)
    assert finish == "stop"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_time", call.function.arguments)]


def test_auto_finds_the_call_in_steered_text(server):
    url, _ = server
    steer = {"guided_regex": HERMES_CALL}
    choice = _ask(url, tool_choice="auto", extra_body=steer).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."  # text before a call stays content
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris", "days": 2},
    )
    chunks, calls, finish = _streamed_calls(url, extra_body=steer)  # tool_choice left out: auto
    assert finish == "tool_calls"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Checking."
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]
    # No chunk ever showed a piece of the tag as content.
    assert all("<" not in (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_auto_without_a_call_is_plain_content(server):
    url, _ = server
    plain = _ask(url, tools=None, max_tokens=24).choices[0]
    choice = _ask(url, tool_choice="auto", max_tokens=24).choices[0]
    assert not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")
    # The random model's text differs with the tools in the prompt; it is content, whole.
    assert isinstance(choice.message.content, str) and plain.message.content is not None
    chunks = list(_ask(url, tool_choice="auto", max_tokens=24, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    none = _ask(url, tool_choice="none", max_tokens=24).choices[0]
    assert none.message.content == choice.message.content and not none.message.tool_calls


def test_legacy_functions_answer_with_function_call(server):
    url, _ = server
    functions = [t["function"] for t in TOOLS]
    body = {
        "model": MODEL,
        "messages": ASK,
        "functions": functions,
        "function_call": {"name": "get_time"},
        "max_tokens": 40,
        "temperature": 0,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] == "stop"
    assert choice["message"]["function_call"]["name"] == "get_time"
    _check_arguments("get_time", choice["message"]["function_call"]["arguments"])
    assert "tool_calls" not in choice["message"]
    steered = body | {"function_call": "auto", "guided_regex": HERMES_CALL}
    choice = httpx.post(f"{url}/v1/chat/completions", json=steered, timeout=60).json()
    assert choice["choices"][0]["finish_reason"] == "function_call"
    assert choice["choices"][0]["message"]["function_call"]["name"] == "get_weather"


def _error(url: str, **body) -> tuple[int, dict]:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4} | body
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    return r.status_code, r.json().get("error", {})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools[0].function.name",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"function_call": "auto"}, "function_call"),
        ({"functions": [WEATHER["function"]], "tools": TOOLS}, "functions"),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{x"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"messages": [*ASK, {"role": "tool", "content": "sunny"}]}, "messages[1].tool_call_id"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(server, body, param):
    url, _ = server
    status, error = _error(url, **body)
    assert (status, error.get("param")) == (400, param), error
    assert _ask(url, tools=None, max_tokens=2).choices[0].finish_reason == "length"


def test_auto_needs_a_parser_when_the_template_shows_no_call_format(server):
    url, _ = server
    plain = "{% for t in tools %}{{ t.function.name }} {% endfor %}{{ messages[-1].content }}"
    status, error = _error(url, tools=TOOLS, chat_template=plain)
    assert (status, error["param"]) == (400, "tool_choice")
    assert "--tool-call-parser" in error["message"]
    # Forced calls need no parser.
    status, _ = _error(url, tools=TOOLS, chat_template=plain, tool_choice="required")
    assert status == 200


def test_a_template_without_tools_refuses_auto_only(tmp_path):
    """The default model's template has no tools. "auto" is refused: the model would decide
    without knowing them. "none" needs no tools, and "required" or a named function are
    enforced by the grammar whatever the prompt shows (as in vLLM), so the default model
    still answers LangChain's with_structured_output(method="function_calling")."""
    with live_server(build_chat_model(tmp_path), MODEL, max_model_len=256) as (url, _):
        status, error = _error(url, tools=TOOLS, tool_choice="auto")
        assert (status, error["param"]) == (400, "tools")
        assert _error(url, tools=TOOLS, tool_choice="none")[0] == 200
        named = {"type": "function", "function": {"name": "get_time"}}
        body = {"model": MODEL, "messages": ASK, "max_tokens": 40, "tools": TOOLS}
        for choice in ("required", named):
            r = httpx.post(
                f"{url}/v1/chat/completions", json=body | {"tool_choice": choice}, timeout=60
            )
            assert r.status_code == 200, r.text
            calls = r.json()["choices"][0]["message"]["tool_calls"]
            assert calls and all(json.loads(c["function"]["arguments"]) for c in calls)


def test_tool_call_parser_flag_picks_the_parser(tmp_path):
    """--tool-call-parser llama3_json reads `{"name": ..., "parameters": ...}` answers, though the
    template's own markers say hermes; an unknown name fails at start."""
    folder = build_tool_model(tmp_path)
    options = {"tool_call_parser": "llama3_json"}
    with live_server(folder, MODEL, max_model_len=1024, app_options=options) as (url, engine):
        steer = {"guided_regex": r'\{"name": "get_time", "parameters": \{"zone": "CET"\}\}'}
        choice = _ask(url, extra_body=steer).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls[0].function.name == "get_time"
        with pytest.raises(ValueError, match="unknown tool-call parser"):
            create_app(engine, MODEL, tool_call_parser="nope")
