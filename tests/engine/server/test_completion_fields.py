"""/v1/completions request fields and the sampling fields chat shares, against a live server
with a tiny model: each is honoured (the test checks its effect) or refused with a 400 naming it.
Raw httpx for the wire format, the official openai client (vLLM's extras in extra_body) and
LiteLLM for how clients see it."""

from __future__ import annotations

import json
import logging
import os

import httpx
import openai
import pytest

from tests.engine.server.live_server import build_chat_model, live_server

MODEL = "tiny"
MAX_MODEL_LEN = 256
PROMPT = "Hello world, this is"
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_chat_model(tmp_path_factory.mktemp("fields"))
    with live_server(model, MODEL, max_model_len=MAX_MODEL_LEN) as running:
        yield running


def _post(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def _complete(url: str, **fields) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0} | fields
    r = _post(url, body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, **fields) -> list[dict]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body | fields, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _refused(r: httpx.Response, param: str) -> dict:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    return error


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=60, max_retries=0)


# ----- logit_bias --------------------------------------------------------------------------------


def test_logit_bias_moves_and_forces_the_greedy_token(server):
    url, _ = server
    plain = _complete(url, max_tokens=1, logprobs=2, return_token_ids=True)["choices"][0]
    greedy = plain["token_ids"][0]
    # The reference: the runner-up of the unbiased distribution (its top_logprobs, raw logits).
    top = plain["logprobs"]["top_logprobs"][0]
    runner_up = sorted(top.items(), key=lambda kv: -kv[1])[1][0]
    banned = _complete(url, max_tokens=1, return_token_ids=True, logit_bias={str(greedy): -100})
    assert banned["choices"][0]["token_ids"][0] != greedy
    assert banned["choices"][0]["text"] == runner_up
    forced = _client(url).completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        logit_bias={"1234": 100},
        extra_body={"return_token_ids": True},
    )
    assert forced.choices[0].model_extra["token_ids"] == [1234, 1234, 1234]


def test_logit_bias_forces_a_sampled_token_and_respects_structured_output(server):
    url, _ = server
    sampled = _complete(url, temperature=1.0, seed=3, return_token_ids=True, logit_bias={"77": 100})
    assert sampled["choices"][0]["token_ids"] == [77] * 6
    # +100 on a token the grammar does not allow cannot pull the output out of it.
    constrained = _complete(
        url, max_tokens=8, guided_choice=["yes", "no"], logit_bias={"77": 100}, temperature=1.0
    )
    assert constrained["choices"][0]["text"] in ("yes", "no")


@pytest.mark.parametrize(
    "bias, param",
    [
        ({"abc": 1}, "logit_bias"),
        ({"49152": 1}, "logit_bias"),  # the vocabulary is [0, 49152)
        ({"-3": 1}, "logit_bias"),
        ({"5": 100.5}, "logit_bias"),
        ({"5": "much"}, "logit_bias.5"),
        ({str(i): 1 for i in range(1025)}, "logit_bias"),  # over --max-logit-bias's 1024
    ],
)
def test_bad_logit_bias_is_refused_by_name(server, bias, param):
    url, _ = server
    r = _post(url, {"model": MODEL, "prompt": PROMPT, "logit_bias": bias})
    _refused(r, param)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "logit_bias": bias}
    _refused(_post(url, chat, "/v1/chat/completions"), param)


# ----- stop_token_ids, include_stop_str_in_output ------------------------------------------------


def test_stop_token_ids_end_the_output(server):
    url, _ = server
    full = _complete(url, max_tokens=8, return_token_ids=True, ignore_eos=True)["choices"][0]
    stop_id = full["token_ids"][2]
    first = full["token_ids"].index(stop_id)
    stopped = _complete(url, max_tokens=8, return_token_ids=True, stop_token_ids=[stop_id])
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    assert choice["token_ids"] == full["token_ids"][: first + 1]


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(server, stream):
    url, _ = server
    text = _complete(url, max_tokens=10, ignore_eos=True)["choices"][0]["text"]
    stop = text[4:7]
    assert stop.strip(), text  # a stop string the text contains, past its start
    cut = text.index(stop)

    def run(**fields) -> str:
        fields |= {"max_tokens": 10, "ignore_eos": True, "stop": [stop]}
        if stream:
            return "".join(c["choices"][0]["text"] for c in _stream(url, **fields) if c["choices"])
        return _complete(url, **fields)["choices"][0]["text"]

    assert run() == text[:cut]
    assert run(include_stop_str_in_output=True) == text[: cut + len(stop)]


# ----- prompt_logprobs, echo with logprobs, max_tokens 0, text_offset ----------------------------


def test_prompt_logprobs_as_vllm_returns_them(server):
    url, engine = server
    prompt_ids = engine.encode_prompt(PROMPT)[0]
    body = _complete(url, prompt_logprobs=2)
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for token_id, entry in zip(prompt_ids[1:], entries[1:], strict=True):
        assert str(token_id) == next(iter(entry))  # the prompt token first
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(token_id))
        assert ranks == [1, 2]
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        assert entry[str(token_id)]["rank"] >= 1
    streamed = _post(url, {"model": MODEL, "prompt": PROMPT, "prompt_logprobs": 1, "stream": True})
    _refused(streamed, "prompt_logprobs")


def _check_offsets(logprobs: dict, text: str) -> None:
    offsets, tokens = logprobs["text_offset"], logprobs["tokens"]
    assert len(offsets) == len(tokens) == len(logprobs["token_logprobs"])
    assert offsets[0] == 0
    for i in range(1, len(offsets)):
        assert offsets[i] == offsets[i - 1] + len(tokens[i - 1])
    assert offsets[-1] + len(tokens[-1]) == len(text)


def test_echo_with_logprobs_covers_prompt_then_completion(server):
    url, engine = server
    prompt_ids = engine.encode_prompt(PROMPT)[0]
    body = _complete(url, echo=True, logprobs=1, return_token_ids=True, prompt_logprobs=1)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    p = len(prompt_ids)
    assert choice["text"].startswith(PROMPT)
    assert len(lp["tokens"]) == p + len(choice["token_ids"])
    assert "".join(lp["tokens"][:p]) == PROMPT
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    # The prompt's logprobs are the prompt_logprobs of the same positions.
    for i in range(1, p):
        entry = choice["prompt_logprobs"][i][str(prompt_ids[i])]
        assert lp["token_logprobs"][i] == entry["logprob"]
    _check_offsets(lp, choice["text"])
    plain = _complete(url, logprobs=1)["choices"][0]
    assert lp["token_logprobs"][p:] == plain["logprobs"]["token_logprobs"]
    assert plain["logprobs"]["text_offset"][0] == 0


def test_echo_max_tokens_0_scores_the_prompt(server):
    url, engine = server
    prompt_ids = engine.encode_prompt(PROMPT)[0]
    # As lm-eval-harness asks for a loglikelihood, through the official client.
    resp = _client(url).completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    choice = resp.choices[0]
    assert choice.text == PROMPT
    assert len(choice.logprobs.tokens) == len(prompt_ids)
    assert choice.logprobs.token_logprobs[0] is None
    assert sum(choice.logprobs.token_logprobs[1:]) < 0
    assert resp.usage.completion_tokens == 0
    streamed = _stream(url, echo=True, logprobs=1, max_tokens=0)
    assert "".join(c["choices"][0]["text"] for c in streamed if c["choices"]) == PROMPT
    r = _post(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 0})
    _refused(r, "max_tokens")  # as vLLM: nothing to return without echo
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}
    _refused(_post(url, chat, "/v1/chat/completions"), "max_tokens")


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_logprobs_match_the_whole_response(server, echo):
    url, _ = server
    fields = {"max_tokens": 8, "logprobs": 2, "echo": echo, "ignore_eos": True}
    whole = _complete(url, **fields)["choices"][0]
    chunks = [c["choices"][0] for c in _stream(url, **fields) if c["choices"]]
    joined = {
        key: [x for c in chunks for x in c["logprobs"][key]]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }
    assert joined == whole["logprobs"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for c in chunks:  # each chunk's first offset is where its text starts
        if c["logprobs"]["text_offset"]:
            assert c["logprobs"]["text_offset"][0] == len(
                "".join(x["text"] for x in chunks[: chunks.index(c)])
            )


# ----- return_token_ids ---------------------------------------------------------------------------


def test_return_token_ids_whole_and_streamed(server):
    url, engine = server
    prompt_ids = engine.encode_prompt(PROMPT)[0]
    choice = _complete(url, return_token_ids=True, ignore_eos=True)["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids
    assert len(choice["token_ids"]) == 6
    chunks = [c["choices"][0] for c in _stream(url, return_token_ids=True, ignore_eos=True)]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    assert "token_ids" not in _complete(url)["choices"][0]


# ----- structured_outputs ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, check",
    [
        ({"choice": ["red", "green"]}, lambda t: t in ("red", "green")),
        ({"regex": "[0-9]{3}"}, lambda t: len(t) == 3 and t.isdigit()),
        ({"json": SCHEMA}, lambda t: isinstance(json.loads(t)["a"], int)),
        ({"json_object": True}, lambda t: t.lstrip().startswith("{")),
    ],
)
def test_structured_outputs(server, spec, check):
    url, _ = server
    resp = _client(url).completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=40,
        temperature=0,
        extra_body={"structured_outputs": spec},
    )
    assert check(resp.choices[0].text), resp.choices[0].text


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "structured_outputs"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
            "structured_outputs",
        ),
        ({"structured_outputs": {"json": {"type": 5}}}, "structured_outputs"),
    ],
)
def test_bad_structured_outputs_are_refused(server, extra, param):
    url, _ = server
    _refused(_post(url, {"model": MODEL, "prompt": PROMPT} | extra), param)


# ----- refusals, unknown fields, model, seed -----------------------------------------------------


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"suffix": " the end"}, "suffix"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
        ({"best_of": 2}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"temperature": "hot"}, "temperature"),
        ({"prompt": 5}, "prompt"),
        ({"seed": 2**63}, "seed"),
    ],
)
def test_refusals_name_their_field(server, extra, param):
    url, _ = server
    _refused(_post(url, {"model": MODEL, "prompt": PROMPT} | extra), param)


def test_refusals_through_the_official_client(server):
    url, _ = server
    client = _client(url)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, suffix="x")
    assert e.value.body["param"] == "suffix"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, best_of=3, n=1)
    assert e.value.body["param"] == "best_of"
    ok = client.completions.create(model=MODEL, prompt=PROMPT, best_of=2, n=2, max_tokens=2)
    assert len(ok.choices) == 2


def test_chat_validation_errors_name_the_nested_field(server):
    url, _ = server
    body = {"model": MODEL, "messages": [{"role": "user", "content": 5}]}
    _refused(_post(url, body, "/v1/chat/completions"), "messages[0].content")


def test_unknown_fields_are_accepted_and_logged(server, caplog):
    url, _ = server
    with caplog.at_level(logging.WARNING, logger="engine.server.protocol"):
        _complete(url, max_tokens=1, frobnicate=1)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        r = _post(url, chat | {"zork": True}, "/v1/chat/completions")
        assert r.status_code == 200, r.text
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert any("frobnicate" in line for line in lines), lines
    assert any("zork" in line for line in lines), lines
    assert all(line.startswith("The following fields were present") for line in lines)


def test_model_may_be_left_out(server):
    url, _ = server
    r = _post(url, {"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert _post(url, chat, "/v1/chat/completions").status_code == 200
    _refused_model = _post(url, {"model": "other", "prompt": PROMPT})
    assert _refused_model.status_code == 404


def test_seeds_repeat_and_any_int64_works(server):
    url, _ = server

    def sample(seed: int, n: int = 1) -> list[str]:
        body = _complete(url, temperature=1.0, seed=seed, n=n, max_tokens=8, ignore_eos=True)
        return [c["text"] for c in body["choices"]]

    for seed in (0, -1, -(2**63), 2**63 - 1, 12345):
        assert sample(seed) == sample(seed)
    assert sample(5) != sample(6)
    a, b = sample(-7, n=2)
    assert a != b  # n > 1 samples of one seed differ


# ----- context length, in OpenAI's words ---------------------------------------------------------


def test_context_overflow_in_openai_words(server):
    url, _ = server
    r = _post(url, {"model": MODEL, "prompt": [5] * 250, "max_tokens": 10})
    error = _refused(r, "prompt")
    assert error["code"] == "context_length_exceeded"
    assert error["message"] == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
        "260 tokens (250 in the prompt, 10 in the completion). Please reduce the length of the "
        "prompt or completion."
    )
    alone = _post(url, {"model": MODEL, "prompt": [5] * MAX_MODEL_LEN, "max_tokens": None})
    assert _refused(alone, "prompt")["code"] == "context_length_exceeded"
    assert _refused(_post(url, {"model": MODEL, "prompt": "x", "max_tokens": 10**6}), "max_tokens")
    fits = _post(url, {"model": MODEL, "prompt": [5] * 250, "max_tokens": 6, "ignore_eos": True})
    assert fits.status_code == 200, fits.text


def test_litellm_sees_a_context_window_error(server):
    url, _ = server
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    import litellm

    long_text = "hello " * 400  # over 256 tokens, under the character bound checked first
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(
            model=f"openai/{MODEL}",
            api_base=f"{url}/v1",
            api_key="x",
            messages=[{"role": "user", "content": long_text}],
            max_tokens=8,
        )
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.text_completion(
            model=f"openai/{MODEL}",
            api_base=f"{url}/v1",
            api_key="x",
            prompt=long_text,
            max_tokens=8,
        )
