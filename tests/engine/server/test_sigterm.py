"""SIGTERM: the server stops accepting, lets the in-flight request finish, and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from engine.server.server_process import free_loopback_port
from tests.engine.tiny_models import build_tiny_model


def _wait_healthy(url: str) -> None:
    for _ in range(300):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError("server did not start")


def _start(tmp_path, grace: str) -> tuple[subprocess.Popen, str]:
    """`nightshift serve` on a tiny model (4096-token context) with this grace period, healthy."""
    model = build_tiny_model("llama", tmp_path / "m", max_position_embeddings=4096)
    port = free_loopback_port()
    cmd = [
        sys.executable,
        "-m",
        "nightshift.cli",
        "serve",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--port",
        str(port),
        "--grace-period",
        grace,
        "--max-model-len",
        "4096",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url)
    return proc, url


def _stream_in_thread(url: str, body: dict, lines: list[str]) -> threading.Thread:
    """A streaming completion on a thread, its non-empty SSE lines appended to `lines`."""

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=90) as r:
            lines.extend(ln for ln in r.iter_lines() if ln)

    client = threading.Thread(target=stream)
    client.start()
    return client


def test_sigterm_finishes_in_flight_then_exits_zero(tmp_path):
    proc, url = _start(tmp_path, "20")
    try:
        lines: list[str] = []
        body = {
            "model": "tiny",
            "prompt": [5, 6, 7],
            "max_tokens": 300,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }

        client = _stream_in_thread(url, body, lines)
        while not lines and client.is_alive():
            time.sleep(0.01)
        time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        client.join(60)
        assert proc.wait(60) == 0
        assert lines[-1] == "data: [DONE]"
        finish = [ln for ln in lines if '"finish_reason": "length"' in ln]
        assert finish, "the in-flight request was cut instead of finishing"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_grace_period_over_ends_requests_cleanly_without_tracebacks(tmp_path):
    """Requests still running when the grace period ends get an answer (a stream: an error
    event and [DONE]; otherwise a 503 in OpenAI's shape), and the log has no traceback."""
    proc, url = _start(tmp_path, "0.5")  # 4000 tokens take far longer than 0.5 s
    try:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True}
        results: dict[str, object] = {}

        def stream() -> None:
            with httpx.stream(
                "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
            ) as r:
                results["stream"] = [ln for ln in r.iter_lines() if ln]

        def plain() -> None:
            results["plain"] = httpx.post(f"{url}/v1/completions", json=body, timeout=60)

        clients = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for c in clients:
            c.start()
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGTERM)
        for c in clients:
            c.join(60)
        assert proc.wait(60) == 0
        log = proc.stdout.read()
        assert "Traceback" not in log, log
        lines = results["stream"]
        assert lines[-1] == "data: [DONE]"
        assert "shutting down" in lines[-2] and '"error"' in lines[-2]
        plain_response = results["plain"]
        assert plain_response.status_code == 503
        assert plain_response.json()["error"]["code"] == "shutting_down"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_second_sigterm_on_an_idle_server_still_exits_zero(tmp_path):
    proc, _ = _start(tmp_path, "5")
    try:
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "Traceback" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_ends_streams_now_and_cleanly(tmp_path, second):
    """SIGTERM, then a second signal (Ctrl-C twice) while a stream runs: the stream ends with an
    error event and [DONE] at once, not after the 60 s grace period, and no traceback."""
    proc, url = _start(tmp_path, "60")
    try:
        lines: list[str] = []
        body = {
            "model": "tiny",
            "prompt": [5, 6, 7],
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }

        client = _stream_in_thread(url, body, lines)
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        started = time.monotonic()
        os.kill(proc.pid, second)
        client.join(30)
        assert proc.wait(30) == 0
        assert time.monotonic() - started < 30
        assert lines[-1] == "data: [DONE]" and "shutting down" in lines[-2]
        assert "Traceback" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
