"""POST /v1/embeddings on a live server: the official openai client (base64, its default, and
float), raw httpx for every input shape and every refusal, compared with HF transformers' final
hidden states; embeddings batched with a running completion leave it unchanged."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from engine.server.limits import RequestLimits
from tests.engine.server.live_server import build_chat_model, live_server
from tests.engine.tiny_models import load_hf

MODEL = "tiny"
KEY = "secret"
HEADERS = {"Authorization": f"Bearer {KEY}"}
HIDDEN = 64  # tiny_models' hidden_size
MAX_MODEL_LEN = 128
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("emb"))


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    limits = RequestLimits(max_prompts=8)
    with live_server(
        model_dir, MODEL, api_key=KEY, limits=limits, max_model_len=MAX_MODEL_LEN
    ) as running:
        yield running


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=60, max_retries=0)


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json=body, headers=HEADERS, timeout=60)


@torch.inference_mode()
def _reference(hf, ids: list[int], pooling="last", normalize=True, dimensions=None) -> np.ndarray:
    hidden = hf.model(torch.tensor([ids])).last_hidden_state[0].float()
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    if dimensions is not None:
        vector = vector[:dimensions]
    return (F.normalize(vector, dim=0) if normalize else vector).numpy()


def _close(got, ref) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() < TOL, np.abs(got - ref).max()


def _ids(engine, text: str) -> list[int]:
    return engine.info.tokenizer.encode(text)


def test_openai_client_base64_and_float_match_hf(server, hf):
    url, engine = server
    client = _client(url)
    texts = ["The quick brown fox.", "Embeddings are vectors."]
    by_default = client.embeddings.create(model=MODEL, input=texts)  # base64 on the wire
    as_float = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    for resp in (by_default, as_float):
        assert resp.object == "list" and resp.model == MODEL
        assert [d.index for d in resp.data] == [0, 1]
        assert all(d.object == "embedding" for d in resp.data)
        tokens = sum(len(_ids(engine, t)) for t in texts)
        assert (resp.usage.prompt_tokens, resp.usage.total_tokens) == (tokens, tokens)
        for text, d in zip(texts, resp.data):
            assert len(d.embedding) == HIDDEN
            _close(d.embedding, _reference(hf, _ids(engine, text)))
    assert [d.embedding for d in by_default.data] == [d.embedding for d in as_float.data]


def test_base64_is_little_endian_float32(server):
    url, _ = server
    body = {"model": MODEL, "input": "bytes on the wire", "encoding_format": "base64"}
    encoded = _post(url, body).json()["data"][0]["embedding"]
    floats = _post(url, {**body, "encoding_format": "float"}).json()["data"][0]["embedding"]
    raw = base64.b64decode(encoded)
    assert len(raw) == 4 * HIDDEN
    assert np.frombuffer(raw, dtype="<f4").tolist() == floats


def test_every_input_shape(server, hf):
    url, engine = server
    a, b = _ids(engine, "first text"), [5, 6, 7, 8, 9, 10]
    cases = {
        "string": ("first text", [a]),
        "strings": (["first text", "first text"], [a, a]),
        "token ids": (b, [b]),
        "lists of token ids": ([b, a], [b, a]),
    }
    for name, (given, expected) in cases.items():
        r = _post(url, {"input": given})  # no model: the served one
        assert r.status_code == 200, (name, r.text)
        body = r.json()
        assert body["model"] == MODEL
        assert [d["index"] for d in body["data"]] == list(range(len(expected))), name
        for ids, d in zip(expected, body["data"]):
            _close(d["embedding"], _reference(hf, ids))
        assert body["usage"] == {
            "prompt_tokens": sum(map(len, expected)),
            "total_tokens": sum(map(len, expected)),
        }


def test_dimensions_truncate_then_renormalize(server, hf):
    url, engine = server
    ids = _ids(engine, "shorter vectors")
    resp = _client(url).embeddings.create(model=MODEL, input=ids, dimensions=8)
    got = resp.data[0].embedding
    assert len(got) == 8 and abs(np.linalg.norm(got) - 1) < 1e-5
    _close(got, _reference(hf, ids, dimensions=8))
    full = _post(url, {"input": ids, "dimensions": HIDDEN}).json()["data"][0]["embedding"]
    _close(full, _reference(hf, ids))


def test_normalize_false_gives_the_raw_hidden_state(server, hf):
    url, _ = server
    r = _post(url, {"input": [3, 4, 5], "normalize": False})
    _close(r.json()["data"][0]["embedding"], _reference(hf, [3, 4, 5], normalize=False))


def _assert_refused(r: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"input": ""}, "input", ["empty string"]),
        ({"input": []}, "input", ["empty"]),
        ({"input": ["a", ""]}, "input[1]", ["input[1]", "empty string"]),
        ({"input": [[]]}, "input[0]", ["input[0]", "empty list"]),
        ({"input": [5, 49152]}, "input", ["49152", "vocabulary"]),
        ({"input": [[5], [-1]]}, "input[1]", ["-1", "vocabulary"]),
        ({"input": 5}, "input", ["a string, a list of strings"]),
        ({"input": [1, "a"]}, "input", ["a string, a list of strings"]),
        ({"input": [[1, 2.5]]}, "input[0]", ["input[0]", "token ids"]),
        ({"input": [True]}, "input", ["a string"]),
        ({}, "input", ["Field required"]),
        ({"input": ["x"] * 9}, "input", ["9 inputs", "limit of 8"]),
        ({"input": "a", "dimensions": 0}, "dimensions", ["between 1 and", "64"]),
        ({"input": "a", "dimensions": HIDDEN + 1}, "dimensions", ["65"]),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format", ["base64"]),
    ],
)
def test_bad_input_is_a_400_naming_its_field(server, body, param, words):
    url, engine = server
    _assert_refused(_post(url, body), 400, param, *words)
    assert engine.engine.core.requests == {}
    assert _post(url, {"input": "still serving"}).status_code == 200


@pytest.mark.parametrize("given", [[7] * (MAX_MODEL_LEN + 1), "word " * (MAX_MODEL_LEN + 10)])
def test_too_long_input_is_refused_in_openais_words(server, given):
    url, _ = server
    error = _assert_refused(_post(url, {"input": [given]}), 400, "input[0]")
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith(
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
    )
    assert "tokens in the input" in error["message"]
    # The whole context is an input's: exactly max_model_len tokens fit (nothing is generated).
    assert _post(url, {"input": [7] * MAX_MODEL_LEN}).status_code == 200


def test_wrong_model_and_missing_key(server):
    url, _ = server
    error = _assert_refused(_post(url, {"model": "other", "input": "x"}), 404, "model")
    assert error["code"] == "model_not_found"
    r = httpx.post(f"{url}/v1/embeddings", json={"input": "x"}, timeout=60)
    assert r.status_code == 401


def test_embeddings_batch_with_a_running_completion(server, hf):
    """Embeddings are asked for while a completion streams: they share engine steps with it,
    and its text is what it is alone."""
    url, engine = server
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=60, max_retries=0)
    kwargs = dict(model=MODEL, prompt=[11, 12, 13, 14], max_tokens=100, temperature=0)
    kwargs["extra_body"] = {"ignore_eos": True}
    texts = [f"sentence number {i}" for i in range(6)]
    shared_steps = []

    def observe(_elapsed, outputs) -> None:
        kinds = {o.embedding is not None for o in outputs}
        shared_steps.append(kinds == {True, False})

    async def main():
        alone = (await client.completions.create(**kwargs)).choices[0].text
        stream = await client.completions.create(**kwargs, stream=True)
        parts = [(await stream.__anext__()).choices[0].text]  # the completion is running

        async def rest() -> None:
            async for chunk in stream:
                parts.append(chunk.choices[0].text if chunk.choices else "")

        embedded = await asyncio.gather(
            rest(), *(client.embeddings.create(model=MODEL, input=t) for t in texts)
        )
        return alone, "".join(parts), embedded[1:]

    engine.step_observers.append(observe)
    try:
        alone, together, embedded = asyncio.run(main())
    finally:
        engine.step_observers.remove(observe)
    assert together == alone
    assert any(shared_steps)
    for text, resp in zip(texts, embedded):
        _close(resp.data[0].embedding, _reference(hf, _ids(engine, text)))
    assert engine.engine.core.requests == {}


def test_mean_pooling_and_the_waiting_limit(model_dir, hf):
    """pooling_type is a server option; the inputs of one request count against
    --max-waiting-requests together."""
    with live_server(
        model_dir,
        MODEL,
        max_waiting_requests=2,
        app_options={"pooling_type": "mean"},
        max_model_len=MAX_MODEL_LEN,
    ) as (url, _):
        r = httpx.post(f"{url}/v1/embeddings", json={"input": [[4, 5, 6], [7, 8]]}, timeout=60)
        assert r.status_code == 200, r.text
        for ids, d in zip([[4, 5, 6], [7, 8]], r.json()["data"]):
            _close(d["embedding"], _reference(hf, ids, pooling="mean"))
        r = httpx.post(f"{url}/v1/embeddings", json={"input": [[4], [5], [6]]}, timeout=60)
        error = _assert_refused(r, 400, "input", "waiting limit of 2")
        assert error["code"] == "limit_exceeded"
