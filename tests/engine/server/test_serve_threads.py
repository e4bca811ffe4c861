"""`nightshift serve --threads N`: a real server on loopback logs the count it applied and where it
came from, and answers; a bad count is one line and exit 2, before any model loads."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

from engine.server.server_process import free_loopback_port
from tests.engine.server.test_sigterm import _wait_healthy
from tests.engine.tiny_models import build_tiny_model


def _serve(*args: str) -> list[str]:
    return [sys.executable, "-m", "nightshift.cli", "serve", *args]


def test_serve_threads_one_is_logged_and_applied(tmp_path):
    model = build_tiny_model("llama", tmp_path / "m")
    port = free_loopback_port()
    cmd = _serve("--model", str(model), "--served-model-name", "tiny", "--port", str(port))
    cmd += ["--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url)
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    # Logged by the engine thread as torch takes the count (a mismatch would be a warning).
    lines = [ln for ln in out.splitlines() if ln.startswith("torch threads:")]
    assert lines == [lines[0]] and lines[0].startswith(
        "torch threads: 1 (--threads; physical cores available: affinity "
    ), out


@pytest.mark.parametrize("bad", ["0", "-1"])
def test_serve_refuses_a_bad_thread_count(tmp_path, bad):
    done = subprocess.run(
        _serve("--model", str(tmp_path / "absent"), f"--threads={bad}"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr == f"error: --threads must be at least 1, not {bad}\n"
