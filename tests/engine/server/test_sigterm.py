"""SIGTERM: the server stops accepting, lets the in-flight request finish, and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from engine.server.server_process import free_loopback_port
from tests.engine.tiny_models import build_tiny_model


def test_sigterm_finishes_in_flight_then_exits_zero(tmp_path):
    model = build_tiny_model("llama", tmp_path / "m")
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
        "20",
        "--max-model-len",
        "512",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        else:
            raise AssertionError("server did not start")
        lines: list[str] = []
        body = {
            "model": "tiny",
            "prompt": [5, 6, 7],
            "max_tokens": 300,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                lines.extend(line for line in r.iter_lines() if line)

        client = threading.Thread(target=stream)
        client.start()
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
