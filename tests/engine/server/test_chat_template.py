"""The chat-template fields of /v1/chat/completions, against a live server with a tiny model:
continue_final_message / add_generation_prompt, chat_template (a request's own Jinja),
chat_template_kwargs, documents, content parts, and the 400s for what cannot be honoured.

Each honoured field is checked by the prompt the server built: its usage.prompt_tokens equals
the token count of the same render done directly with the tokenizer."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from engine.tokenizer import render_chat
from tests.engine.server.live_server import live_server
from tests.engine.server.tool_models import build_tool_model

MODEL = "tiny"
ASK = [{"role": "user", "content": "Name a colour."}]
LISTING = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = build_tool_model(tmp_path_factory.mktemp("tpl"))
    trusted = {"trust_request_chat_template": True}
    with live_server(folder, MODEL, max_model_len=512, app_options=trusted) as s:
        yield s


def _post(url: str, **body) -> httpx.Response:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, "temperature": 0} | body
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def _prompt_tokens(url: str, **body) -> int:
    r = _post(url, **body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def _error(url: str, **body) -> dict:
    r = _post(url, **body)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_continue_final_message_prefills_the_assistant(server):
    url, engine = server
    tokenizer = engine.info.tokenizer
    messages = [*ASK, {"role": "assistant", "content": "My favourite is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    ids = render_chat(tokenizer, messages, **options)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\nMy favourite is")
    assert _prompt_tokens(url, messages=messages, **options) == len(ids)
    # The openai client passes vLLM's fields through extra_body.
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, extra_body=options
    )
    assert resp.usage.prompt_tokens == len(ids)


def test_add_generation_prompt_false_leaves_the_assistant_turn_out(server):
    url, engine = server
    ids = render_chat(engine.info.tokenizer, ASK, add_generation_prompt=False)
    assert _prompt_tokens(url, add_generation_prompt=False) == len(ids)
    assert _prompt_tokens(url) == len(render_chat(engine.info.tokenizer, ASK))
    assert len(ids) < _prompt_tokens(url)


def test_continue_final_message_refusals(server):
    url, _ = server
    prefill = [*ASK, {"role": "assistant", "content": "Blue"}]
    error = _error(url, messages=prefill, continue_final_message=True)  # generation prompt too
    assert error["param"] == "continue_final_message"
    error = _error(url, continue_final_message=True, add_generation_prompt=False)  # last: user
    assert error["param"] == "continue_final_message" and "assistant" in error["message"]


def test_request_chat_template_overrides_the_models(server):
    url, engine = server
    ids = render_chat(engine.info.tokenizer, ASK, chat_template=LISTING)
    assert engine.info.tokenizer.decode(ids).startswith("[user] Name a colour.")
    assert _prompt_tokens(url, chat_template=LISTING) == len(ids)


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ("{{ raise_exception('no system role here') }}", "no system role here"),
        ("{% for m in messages %}{{ m.content }}", "TemplateSyntaxError"),
        ("{{ messages[0].content.upper().nothing() }}", "failed to render"),
    ],
)
def test_a_chat_template_that_fails_is_a_400_naming_it(server, template, words):
    url, _ = server
    error = _error(url, chat_template=template)
    assert error["param"] == "chat_template" and words in error["message"]
    assert _prompt_tokens(url) > 0  # still serving


def test_chat_template_kwargs_reach_the_template(server):
    url, engine = server
    template = "{{ greeting }}: {{ messages[0].content }}"
    kwargs = {"greeting": "Hello there, my dear old friend"}
    ids = render_chat(engine.info.tokenizer, ASK, chat_template=template, template_kwargs=kwargs)
    assert engine.info.tokenizer.decode(ids).startswith("Hello there, my dear old friend:")
    assert _prompt_tokens(url, chat_template=template, chat_template_kwargs=kwargs) == len(ids)
    error = _error(url, chat_template_kwargs={"tools": []})
    assert error["param"] == "chat_template_kwargs"


def test_documents_reach_the_template(server):
    url, engine = server
    template = (
        "{% for d in documents %}<doc>{{ d.text }}</doc>{% endfor %}{{ messages[0].content }}"
    )
    documents = [{"title": "a", "text": "The sky is blue."}, {"title": "b", "text": "Grass."}]
    ids = render_chat(engine.info.tokenizer, ASK, chat_template=template, documents=documents)
    assert "<doc>The sky is blue.</doc>" in engine.info.tokenizer.decode(ids)
    assert _prompt_tokens(url, chat_template=template, documents=documents) == len(ids)


def test_text_content_parts_are_the_same_prompt_as_a_string(server):
    url, _ = server
    parts = [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]
    assert _prompt_tokens(url, messages=[{"role": "user", "content": parts}]) == _prompt_tokens(url)


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": "http://127.0.0.1/a.wav"}},
        {"type": "video_url", "video_url": {"url": "http://127.0.0.1/v.mp4"}},
        {"type": "file", "file": {"file_id": "file-1"}},
    ],
)
def test_media_content_parts_are_refused(server, part):
    url, _ = server
    messages = [ASK[0], {"role": "user", "content": [{"type": "text", "text": "See:"}, part]}]
    error = _error(url, messages=messages)
    assert error["param"] == "messages[1].content" and "text only" in error["message"]


def test_unknown_content_part_types_are_refused(server):
    url, _ = server
    error = _error(url, messages=[{"role": "user", "content": [{"type": "hologram"}]}])
    assert error["param"] == "messages[0].content" and "hologram" in error["message"]
    error = _error(url, messages=[{"role": "user", "content": [{"type": "text"}]}])
    assert error["param"] == "messages[0].content"


def test_top_logprobs_needs_logprobs(server):
    url, _ = server
    assert _error(url, top_logprobs=2)["param"] == "top_logprobs"
    r = _post(url, top_logprobs=2, logprobs=True)
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert r.status_code == 200 and all(len(t["top_logprobs"]) == 2 for t in content)


def test_documents_the_template_never_renders_are_refused(server):
    url, _ = server
    error = _error(url, documents=[{"text": "The sky is blue."}])
    assert error["param"] == "documents"


def test_return_token_ids_and_prompt_logprobs(server):
    url, engine = server
    prompt = render_chat(engine.info.tokenizer, ASK)
    body = {"return_token_ids": True, "prompt_logprobs": 1, "max_tokens": 5, "ignore_eos": True}
    r = _post(url, **body).json()
    assert r["prompt_token_ids"] == prompt
    choice = r["choices"][0]
    assert len(choice["token_ids"]) == 5
    assert engine.info.tokenizer.decode(choice["token_ids"]) == choice["message"]["content"]
    logprobs = r["prompt_logprobs"]
    assert len(logprobs) == len(prompt) and logprobs[0] is None
    assert all(str(t) in entry for t, entry in zip(prompt[1:], logprobs[1:]))
    # Streamed: prompt_token_ids on the first chunk, each chunk's new token ids on its choice.
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "temperature": 0, "stream": True}
        | {k: v for k, v in body.items() if k != "prompt_logprobs"},
        timeout=60,
    ) as stream:
        events = [
            json.loads(line[6:])
            for line in stream.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    assert events[0]["prompt_token_ids"] == prompt
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert streamed == choice["token_ids"]


def test_a_request_template_needs_a_trusting_server(tmp_path):
    """By default a request's chat_template is refused (Jinja's sandbox bounds each loop, not
    nested ones: one template could spin a worker for hours); the model's own template and
    chat_template_kwargs still work."""
    spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with live_server(build_tool_model(tmp_path), MODEL, max_model_len=512) as (url, _):
        for path, body in (
            ("/v1/chat/completions", {"messages": ASK, "max_tokens": 2, "chat_template": spin}),
            ("/tokenize", {"messages": ASK, "chat_template": spin}),
        ):
            r = httpx.post(f"{url}{path}", json=body, timeout=30)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "chat_template"
            assert "--trust-request-chat-template" in error["message"]
        ok = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": ASK, "max_tokens": 2, "chat_template_kwargs": {"x": 1}},
            timeout=30,
        )
        assert ok.status_code == 200, ok.text
