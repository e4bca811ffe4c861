"""Real replicas for the router's tests: `nightshift serve` processes with a tiny model on
loopback ports the test picks (so that a killed one can come back on its own port), and the
router itself in a thread of the test process (so the test can read its replica set)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from engine.router.app import create_router_app
from engine.router.router_config import RouterConfig
from engine.server import parent_death
from engine.server.server_process import free_loopback_port

MODEL = "tiny-router"
# Room for a digest-like trace without evictions, so hit rates measure routing alone.
SERVE_ARGS = ("--max-model-len", "1024", "--num-kv-blocks", "1024", "--max-num-seqs", "16")


class Replica:
    def __init__(self, model_dir: Path, port: int | None = None) -> None:
        self.model_dir, self.port = model_dir, port or free_loopback_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Replica:
        cmd = [sys.executable, "-m", "nightshift.cli", "serve", "--model", str(self.model_dir)]
        cmd += ["--served-model-name", MODEL, "--port", str(self.port), *SERVE_ARGS]
        # One thread each: two replicas and the test share two cores.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            parent_death.command(os.getpid(), cmd),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return self

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, "the replica exited"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"replica on port {self.port} not healthy in {timeout_s} s")

    def kill(self) -> None:
        """kill -9: no grace, requests in flight cut off."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


@contextmanager
def running_router(config: RouterConfig, api_key: str | None = None) -> Iterator[str]:
    """Yields the router's URL while it runs in a thread; the app is at `.app` of the URL's
    holder (see router_app)."""
    app = create_router_app(config, api_key)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    url = RouterURL(f"http://127.0.0.1:{port}")
    url.app = app
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(15)


class RouterURL(str):
    """The router's URL, carrying its app (for its replica set)."""

    app: object


def wait_for(predicate, timeout_s: float = 30.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not hold within {timeout_s} s")
