"""The digest's `--endpoint local` server: `nightshift serve` as a child on a free loopback port
that dies with the digest (see `parent_death`), stopped with SIGTERM at the end of the run."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import httpx

from digest import parent_death
from engine.server.server_process import ServerProcess, ServerStartError, free_loopback_port

log = logging.getLogger(__name__)


def start_local_server(
    serve_args: list[str], *, timeout_s: float = 300.0, quiet: bool = True
) -> ServerProcess:
    """Start `nightshift serve <serve_args> --port P` and wait until /health answers 200."""
    port = free_loopback_port()
    serve = [sys.executable, "-m", "nightshift.cli", "serve", *serve_args, "--port", str(port)]
    out = subprocess.DEVNULL if quiet else None
    proc = subprocess.Popen(parent_death.command(os.getpid(), serve), stdout=out, stderr=out)
    server = ServerProcess(proc, port)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"the server exited with {proc.returncode}: {' '.join(serve)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                log.debug("local server up on port %d", port)
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop(grace_s=2.0)
    raise ServerStartError(f"the server did not become healthy within {timeout_s:.0f} s")
