"""CORS (engine/server/cors.py) on a live server with an API key: a browser's preflight, which
never carries the key, is answered; responses to a page on another origin carry the header, the
401 of a missing key too (the browser could not show it otherwise); restricted origins are
refused."""

from __future__ import annotations

import httpx
import pytest

from engine.server.cors import CorsConfig
from tests.engine.server.live_server import build_chat_model, live_server

KEY = "secret"
ORIGIN = "http://page.example"
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("cors"))


@pytest.fixture(scope="module")
def server(model_dir):
    with live_server(model_dir, "tiny", api_key=KEY, max_model_len=128) as (url, _):
        yield url


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/embeddings", "/tokenize"])
def test_a_preflight_is_answered_without_the_key(server, path):
    r = httpx.options(f"{server}{path}", headers=PREFLIGHT)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    allowed = r.headers["access-control-allow-headers"].lower()
    assert "authorization" in allowed and "content-type" in allowed
    assert "access-control-allow-credentials" not in r.headers  # vLLM's default: no credentials


def test_a_request_from_another_origin_gets_the_header(server):
    ok = httpx.get(
        f"{server}/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}
    )
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "*"
    refused = httpx.get(f"{server}/v1/models", headers={"Origin": ORIGIN})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == "*"
    # Without an Origin (not a browser) there is nothing to allow.
    plain = httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert "access-control-allow-origin" not in plain.headers


def test_restricted_origins(model_dir):
    cors = CorsConfig(allowed_origins=[ORIGIN])
    with live_server(model_dir, "tiny", app_options={"cors": cors}, max_model_len=128) as (url, _):
        good = httpx.options(f"{url}/v1/chat/completions", headers=PREFLIGHT)
        assert good.status_code == 200
        assert good.headers["access-control-allow-origin"] == ORIGIN
        other = {**PREFLIGHT, "Origin": "http://elsewhere.example"}
        bad = httpx.options(f"{url}/v1/chat/completions", headers=other)
        assert bad.status_code == 400
        assert "access-control-allow-origin" not in bad.headers
        r = httpx.get(f"{url}/v1/models", headers={"Origin": "http://elsewhere.example"})
        assert r.status_code == 200  # served (CORS is the browser's check), without the header
        assert "access-control-allow-origin" not in r.headers
