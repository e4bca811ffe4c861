"""`nightshift router`: the router app under uvicorn, with the server's stop rules: SIGTERM (or
Ctrl-C) stops accepting, lets requests in flight finish for up to the grace period, and exits 0.
It binds to loopback unless told; beyond loopback it wants an API key (or
--allow-unauthenticated), as `nightshift serve` does, since it hands out the replicas' model.

The router imports no torch (engine/server/error_body.py and auth.py are light): it starts in
well under a second and fits a small pod."""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit

import uvicorn

from engine.router.app import create_router_app
from engine.router.replica_set import ReplicaSet
from engine.router.router_config import RouterConfig
from engine.server.auth import API_KEY_ENV, is_loopback
from engine.server.listen_socket import listen_socket

log = logging.getLogger(__name__)


class RouterBindError(ValueError):
    """An address the router must not listen on: beyond loopback without an API key (and
    without saying so on purpose), or one of its own backends."""


def check_router_bind(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    if api_key or allow_unauthenticated or is_loopback(host):
        return
    raise RouterBindError(
        f"refusing to listen on {host} without an API key: anyone who reaches it could use the "
        f"replicas' model. Set ${API_KEY_ENV} or --api-key-file, or pass --allow-unauthenticated"
    )


def check_not_self(backends: Sequence[str], host: str, port: int) -> None:
    """A backend that is the router's own address would route every request back to itself."""
    any_address = host in ("", "0.0.0.0", "::")
    for url in backends:
        parts = urlsplit(url)
        backend_port = parts.port or (443 if parts.scheme == "https" else 80)
        same_host = parts.hostname == host or (
            is_loopback(parts.hostname or "") and (any_address or is_loopback(host))
        )
        if backend_port == port and same_host:
            raise RouterBindError(
                f"--backend {url} is the router's own address ({host}:{port}): give the "
                "replicas' URLs, or another --port for the router"
            )


class RouterServer(uvicorn.Server):
    """uvicorn's server, except that a graceful stop exits 0 (uvicorn re-raises the captured
    SIGTERM, which a supervisor reads as a crash), and `on_signal` hears every stop signal
    first (the data-parallel supervisor passes it on to its engines)."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None] | None = None):
        super().__init__(config)
        self.on_signal = on_signal

    def handle_exit(self, sig: int, frame) -> None:
        if self.on_signal is not None:
            self.on_signal()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self.handle_exit)
        yield


def router_server(
    config: RouterConfig,
    api_key: str | None,
    grace_period: float,
    on_signal: Callable[[], None] | None = None,
    background: Sequence[Callable[[ReplicaSet], Awaitable[None]]] = (),
) -> RouterServer:
    app = create_router_app(config, api_key, background)
    server_config = uvicorn.Config(
        app, log_level="warning", timeout_graceful_shutdown=grace_period, lifespan="on"
    )
    return RouterServer(server_config, on_signal)


def run_router(
    config: RouterConfig,
    host: str,
    port: int,
    api_key: str | None = None,
    allow_unauthenticated: bool = False,
    grace_period: float = 30.0,
) -> None:
    """Runs until SIGTERM/SIGINT."""
    check_router_bind(host, api_key, allow_unauthenticated)
    check_not_self(config.backends, host, port)
    sock = listen_socket(host, port)
    backends = ", ".join(config.backends + [f"dns:{n}" for n in config.backend_dns])
    log.info(
        "router on http://%s:%d (%s policy) in front of %s", host, port, config.policy, backends
    )
    try:
        router_server(config, api_key, grace_period).run(sockets=[sock])
    finally:
        sock.close()
