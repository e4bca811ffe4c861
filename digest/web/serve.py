"""Running the web view: a listening socket (bound before uvicorn starts, so that port 0 picks a
free port and the address printed is the one served), uvicorn, a stop on SIGINT/SIGTERM.

The view has no login: it binds loopback unless told otherwise, and says so when it is not."""

from __future__ import annotations

import logging
import signal
import socket
from types import FrameType

import uvicorn
from sqlalchemy import Engine

from digest.web.app import create_app

log = logging.getLogger("nightshift")


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


class _Server(uvicorn.Server):
    """uvicorn's server, except that a stop by signal ends the process normally (exit 0), as
    `nightshift serve` does: uvicorn re-raises the captured SIGTERM after shutting down, which a
    supervisor reads as a crash. A second Ctrl-C still forces the exit."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


def serve(engine: Engine, sock: socket.socket) -> None:
    """Serve the view on `sock` until SIGINT or SIGTERM (exit 0)."""
    config = uvicorn.Config(create_app(engine), log_level="warning", access_log=False)
    try:
        _Server(config).run(sockets=[sock])
    finally:
        sock.close()
