"""`nightshift serve --tensor-parallel-size 2`: a real server process on loopback serves with
two ranks, and when a worker dies it stops, exit code 1, within seconds (a supervisor restarts
it) rather than hanging or answering 503 forever; no process is left behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.engine.server.live_server import build_chat_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """Children of every thread of pid (the engine thread starts the workers)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = task / "children"
        if children.exists():
            found += [int(p) for p in children.read_text().split()]
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" not in status.read_text()


def test_serves_with_two_ranks_and_exits_when_a_worker_dies(tmp_path):
    model = build_chat_model(tmp_path / "m")
    port = _free_port()
    nightshift = Path(sys.executable).with_name("nightshift")
    server = subprocess.Popen(
        [
            str(nightshift),
            "serve",
            "--model",
            str(model),
            "--device",
            "cpu",
            "--port",
            str(port),
            "--tensor-parallel-size",
            "2",
            "--num-kv-blocks",
            "64",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        else:
            raise AssertionError("the server did not come up")
        body = {"model": str(model), "prompt": "Hello", "max_tokens": 5, "temperature": 0}
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 5
        workers = [p for p in _children(server.pid) if _alive(p)]
        assert workers, "no worker process"
        # The spawn start method's resource tracker is a child too; the rank is the one whose
        # command line names the worker entry point.
        rank = [p for p in workers if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        os.kill(rank[0], signal.SIGKILL)
        code = server.wait(timeout=30)
        output = server.stdout.read()
        assert code == 1, output[-2000:]
        assert "the engine failed: tensor-parallel worker" in output
        assert not any(_alive(p) for p in workers)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
