"""`nightshift serve` as a child process on a free loopback port: what the serving benchmark, the
digest's `--endpoint local` and the tests use to get a real server and to stop it cleanly."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from engine.server import parent_death

log = logging.getLogger(__name__)


def free_loopback_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    """The child server exited or never answered /health."""


@dataclass(slots=True)
class ServerProcess:
    proc: subprocess.Popen
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self, grace_s: float = 10.0) -> None:
        # SIGTERM lets the server finish in-flight requests and exit 0; kill only if it hangs.
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server_process(
    serve_args: list[str],
    *,
    timeout_s: float = 300.0,
    quiet: bool = True,
    die_with_parent: bool = True,
) -> ServerProcess:
    """Start `nightshift serve <serve_args> --port P` and wait until /health answers 200.
    die_with_parent: the server is killed when this process dies, even by `kill -9`
    (parent_death), so that no multi-GB server is left listening behind a crashed caller."""
    port = free_loopback_port()
    cmd = [sys.executable, "-m", "nightshift.cli", "serve", *serve_args, "--port", str(port)]
    out = subprocess.DEVNULL if quiet else None
    launch = parent_death.command(os.getpid(), cmd) if die_with_parent else cmd
    proc = subprocess.Popen(launch, stdout=out, stderr=out)
    server = ServerProcess(proc, port)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                log.debug("server up on port %d", port)
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop(grace_s=2.0)
    raise ServerStartError(f"the server did not become healthy within {timeout_s:.0f} s")
