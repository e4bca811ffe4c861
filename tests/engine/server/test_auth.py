"""The API key: from the environment or a file (not only argv), the bearer scheme in any case,
and no listening beyond loopback without a key unless asked for explicitly."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from typer.testing import CliRunner

from engine.server.auth import APIKeyError, is_loopback, resolve_api_key
from nightshift.cli import app
from tests.engine.server.live_server import build_chat_model, live_server
from tests.engine.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_chat_model(tmp_path_factory.mktemp("auth"))
    with live_server(model, "tiny", api_key="s3cret", max_model_len=128) as running:
        yield running


@pytest.mark.parametrize(
    "header, status",
    [
        ("Bearer s3cret", 200),
        ("bearer s3cret", 200),
        ("BEARER   s3cret", 200),
        ("Bearer s3cre", 401),
        ("Bearer s3cret2", 401),
        ("Basic s3cret", 401),
        ("s3cret", 401),
        ("", 401),
    ],
)
def test_bearer_scheme_is_case_insensitive_and_the_key_exact(server, header, status):
    url, _ = server
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": header} if header else {})
    assert r.status_code == status
    if status == 401:
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_probes_stay_open(server):
    url, _ = server
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200


def test_key_from_env_or_file(tmp_path, monkeypatch):
    monkeypatch.delenv("NIGHTSHIFT_API_KEY", raising=False)
    assert resolve_api_key(None, None) is None
    monkeypatch.setenv("NIGHTSHIFT_API_KEY", "from-env")
    assert resolve_api_key(None, None) == "from-env"
    assert resolve_api_key("from-arg", None) == "from-arg"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\r\na comment on the second line\n")
    assert resolve_api_key(None, key_file) == "from-file"
    with pytest.raises(APIKeyError, match="not both"):
        resolve_api_key("a", key_file)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(APIKeyError, match="empty"):
        resolve_api_key(None, tmp_path / "empty")
    with pytest.raises(APIKeyError, match="cannot read"):
        resolve_api_key(None, tmp_path / "missing")


def test_loopback_names():
    assert all(map(is_loopback, ["127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "example.org"]))


@pytest.mark.parametrize(
    "args, words",
    [
        (["--host", "0.0.0.0"], ["refusing to listen on 0.0.0.0", "--allow-unauthenticated"]),
        (["--api-key-file", "/nonexistent/key"], ["--api-key-file", "cannot read"]),
        (["--max-model-len", "99999"], ["max_model_len 99999", "512"]),
    ],
)
def test_serve_refuses_bad_setups_with_one_line(tmp_path, monkeypatch, args, words):
    monkeypatch.delenv("NIGHTSHIFT_API_KEY", raising=False)
    model = build_tiny_model("llama", tmp_path / "m")
    result = CliRunner().invoke(app, ["serve", "--model", str(model), *args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, result.output
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_the_refusal_is_a_real_exit_2_from_the_command_line(tmp_path):
    env = {"PATH": "/usr/bin:/bin"}  # no NIGHTSHIFT_API_KEY
    cmd = [
        sys.executable,
        "-m",
        "nightshift.cli",
        "serve",
        "--host",
        "0.0.0.0",
        "--model",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert "refusing to listen" in done.stderr and "Traceback" not in done.stderr
