"""/tokenize and /detokenize (vLLM's shapes, guarded by the API key), /ping, and the model
cards of /v1/models and /v1/models/{model}, on a live server whose served name holds a slash."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.engine.server.live_server import build_chat_model, live_server

MODEL = "org/tiny-model"
KEY = "secret"
HEADERS = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 128
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Count to three."},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def server(model_dir):
    started = int(time.time())
    trusted = {"trust_request_chat_template": True}
    with live_server(
        model_dir, MODEL, api_key=KEY, max_model_len=MAX_MODEL_LEN, app_options=trusted
    ) as (url, engine):
        yield url, engine, started


def _post(url: str, path: str, body: dict, headers: dict | None = HEADERS) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers or {}, timeout=60)


def _assert_refused(r: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error


def test_tokenize_a_prompt(server):
    url, engine, _ = server
    tokenizer = engine.info.tokenizer
    text = "Hello there, tokenizer!"
    body = _post(url, "/tokenize", {"model": MODEL, "prompt": text}).json()
    assert body == {
        "count": len(tokenizer.encode(text)),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": tokenizer.encode(text),
        "token_strs": None,
    }
    asked = _post(url, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert asked["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    plain = _post(url, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)


def test_tokenize_messages_counts_what_chat_completions_gets(server):
    url, _, _ = server
    body = _post(url, "/tokenize", {"messages": MESSAGES}).json()
    chat = _post(
        url,
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 1},
    ).json()
    assert body["count"] == len(body["tokens"]) == chat["usage"]["prompt_tokens"]
    # Without the generation prompt the rendering is shorter by the assistant header.
    bare = _post(url, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["count"] < body["count"]
    assert body["tokens"][: bare["count"]] == bare["tokens"]
    # Continuing a final assistant message leaves it open: no end-of-turn after it.
    partial = MESSAGES + [{"role": "assistant", "content": "One, two"}]
    cont = _post(
        url,
        "/tokenize",
        {"messages": partial, "add_generation_prompt": False, "continue_final_message": True},
    ).json()
    closed = _post(url, "/tokenize", {"messages": partial, "add_generation_prompt": False}).json()
    assert cont["count"] < closed["count"]
    assert closed["tokens"][: cont["count"]] == cont["tokens"]


def test_detokenize_round_trips(server):
    url, engine, _ = server
    text = "Round trip, with punctuation."
    tokens = _post(url, "/tokenize", {"prompt": text}).json()["tokens"]
    assert _post(url, "/detokenize", {"model": MODEL, "tokens": tokens}).json() == {"prompt": text}
    assert _post(url, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        ("/tokenize", {}, "prompt", ["prompt", "messages"]),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "messages", ["not both"]),
        ("/tokenize", {"messages": []}, "messages", ["empty"]),
        ("/tokenize", {"prompt": 5}, "prompt", []),
        (
            "/tokenize",
            {"messages": MESSAGES, "continue_final_message": True},
            "continue_final_message",
            ["add_generation_prompt"],
        ),
        (
            "/tokenize",
            {"messages": MESSAGES, "add_special_tokens": True},
            "add_special_tokens",
            ["chat template"],
        ),
        (
            "/tokenize",
            {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}},
            "chat_template_kwargs",
            ["tokenize"],
        ),
        ("/detokenize", {"tokens": [1, 49152]}, "tokens", ["49152", "vocabulary"]),
        ("/detokenize", {"tokens": [-1]}, "tokens", ["-1"]),
        ("/detokenize", {"tokens": "abc"}, "tokens", ["list of token ids"]),
        ("/detokenize", {"tokens": [1.5]}, "tokens", ["list of token ids"]),
        ("/detokenize", {}, "tokens", ["Field required"]),
    ],
)
def test_bad_bodies_are_400s_naming_their_field(server, path, body, param, words):
    url, _, _ = server
    _assert_refused(_post(url, path, body), 400, param, *words)


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_a_wrong_model_is_a_404(server, path):
    url, _, _ = server
    body = {"model": "tiny", "prompt": "x", "tokens": [1]}
    assert _assert_refused(_post(url, path, body), 404, "model")["code"] == "model_not_found"


@pytest.mark.parametrize(
    "path, body", [("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})]
)
def test_the_tokenizer_endpoints_need_the_key(server, path, body):
    url, _, _ = server
    r = _post(url, path, body, headers=None)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert _post(url, path, body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert _post(url, path, body).status_code == 200


def test_ping_answers_get_and_post_without_the_key(server):
    url, _, _ = server
    assert httpx.get(f"{url}/ping").status_code == 200
    assert httpx.post(f"{url}/ping").status_code == 200
    assert httpx.get(f"{url}/ping").json() == httpx.get(f"{url}/health").json()


def test_model_cards_in_vllms_shape(server, model_dir):
    url, _, started = server
    listing = httpx.get(f"{url}/v1/models", headers=HEADERS).json()
    assert listing["object"] == "list"
    (card,) = listing["data"]
    assert card["id"] == MODEL and card["object"] == "model"
    assert isinstance(card["created"], int) and started <= card["created"] <= time.time()
    assert card["owned_by"] == "nightshift"
    assert card["root"] == str(model_dir) and card["parent"] is None
    assert card["max_model_len"] == MAX_MODEL_LEN
    (permission,) = card["permission"]
    assert permission["object"] == "model_permission"
    assert permission["id"].startswith("modelperm-")
    assert permission["allow_sampling"] is True and permission["organization"] == "*"
    # The card is the server's: the same on every call.
    assert httpx.get(f"{url}/v1/models", headers=HEADERS).json() == listing


def test_retrieve_a_model_with_the_openai_client(server):
    url, _, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=60, max_retries=0)
    model = client.models.retrieve(MODEL)  # the slash in the name stays part of the path
    assert model.id == MODEL and model.object == "model"
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("other")
    assert info.value.body["code"] == "model_not_found"
    r = httpx.get(f"{url}/v1/models/other", headers=HEADERS)
    _assert_refused(r, 404, "model", "other")
