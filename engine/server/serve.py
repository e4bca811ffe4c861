"""`nightshift serve`: build the engine, then run the API with uvicorn on loopback by default."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.distributed.rendezvous import env_rendezvous
from engine.engine_builder import run_tensor_parallel_worker
from engine.server.app import create_app
from engine.server.auth import API_KEY_ENV, is_loopback
from engine.server.batch_config import BatchConfig
from engine.server.cors import CorsConfig
from engine.server.errors import error_body
from engine.server.limits import RequestLimits
from engine.server.listen_socket import listen_socket

logger = logging.getLogger(__name__)

# After the grace period, requests still open are ended by the engine (an error event and
# [DONE] for streams, a 503 otherwise); this long is left for those answers to go out.
_FLUSH_S = 5.0


class JsonErrorsH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, except that a request it cannot parse at all (a bad
    Content-Length, a garbled request line) is answered in OpenAI's error shape too, not with
    uvicorn's plain-text "Invalid HTTP request received."."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(
            error_body(f"invalid HTTP request: {msg}", "invalid_request_error")
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()


class EngineDiedError(RuntimeError):
    """The engine stopped computing while serving (a tensor-parallel worker died)."""


class UnsafeBindError(ValueError):
    """Listening beyond loopback without an API key, and without saying so on purpose."""


class _Server(uvicorn.Server):
    """uvicorn's server, except that:
    - a graceful stop ends the process normally (exit 0): uvicorn re-raises the captured
      SIGTERM after shutting down, which a supervisor reads as a crash;
    - when the grace period runs out, the engine ends what is left cleanly, rather than
      uvicorn cancelling handler tasks mid-response (a traceback each, and cut streams)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace_period: float) -> None:
        super().__init__(config)
        self._engine, self._grace_period = engine, grace_period
        self._timer: threading.Timer | None = None
        self._signals = 0

    def handle_exit(self, sig: int, frame) -> None:
        """First signal: stop accepting, and end what is left after the grace period. Second:
        end what is left now (cleanly: error events, 503s). Third: uvicorn's force exit."""
        self._signals += 1
        if self._signals == 1:
            self._timer = threading.Timer(
                self._grace_period,
                self._engine.fail_all,
                args=(f"the server is shutting down (grace period of {self._grace_period:g} s)",),
            )
            self._timer.daemon = True
            self._timer.start()
            self.should_exit = True
        elif self._signals == 2:
            if self._timer is not None:
                self._timer.cancel()
            self._engine.fail_all("the server is shutting down (stopped again)")
        else:
            self.should_exit = self.force_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        # Not restored afterwards: serve() ignores both signals once it has stopped the engine.
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self.handle_exit)
        yield


def check_bind(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    if api_key or allow_unauthenticated or is_loopback(host):
        return
    raise UnsafeBindError(
        f"refusing to listen on {host} without an API key: anyone who reaches it could use the "
        f"model. Set ${API_KEY_ENV} or --api-key-file, or pass --allow-unauthenticated"
    )


def serve(
    config: EngineConfig,
    host: str,
    port: int,
    served_model_name: str | None,
    api_key: str | None,
    max_waiting_requests: int | None = None,
    grace_period: float = 30.0,
    limits: RequestLimits | None = None,
    allow_unauthenticated: bool = False,
    *,
    cors: CorsConfig | None = None,
    tool_call_parser: str | None = None,
    pooling_type: str = "last",
    trust_request_chat_template: bool = False,
    batch: BatchConfig | None = None,
) -> None:
    """Runs until SIGTERM/SIGINT: uvicorn then stops accepting and lets in-flight requests finish
    for up to grace_period seconds; whatever still runs after that is ended, and we exit 0."""
    if not (math.isfinite(grace_period) and grace_period >= 0):
        raise ValueError(f"--grace-period must be a number of seconds >= 0, got {grace_period}")
    rank = env_rendezvous(config.tensor_parallel_size)
    if rank is not None and rank.rank == 0 and rank.port == port:
        raise ValueError(
            f"MASTER_PORT {port} is also --port: the ranks' rendezvous and the server need a "
            "port each"
        )
    if rank is not None and rank.rank > 0:
        # The same command on every rank of a torchrun-style launch: rank 0 serves, the
        # others hold their shards and compute its steps until it stops.
        run_tensor_parallel_worker(config, rank)
        return
    check_bind(host, api_key, allow_unauthenticated)
    # A prompt longer than the model's context is refused by us with its lengths; transformers'
    # own warning about it would only add a line per hostile request to the log.
    logging.getLogger("transformers.tokenization_utils_base").setLevel(logging.ERROR)
    # Bound before the model loads: a port in use or a bad host fails at once, in one line.
    sock = listen_socket(host, port, inheritable=True)
    if batch is not None:
        from engine.server.batch_api import check_batch_database

        check_batch_database(batch)  # likewise a batch database that cannot be opened
    engine = AsyncEngine(config)
    info = engine.info
    name = served_model_name or config.model
    logger.info(
        "serving %s as %r on http://%s:%d: %d KV blocks x %d tokens (kv_cache_dtype %s); the "
        "largest request that fits has %d tokens",
        config.model,
        name,
        host,
        port,
        info.num_kv_blocks,
        info.block_size,
        info.kv_cache_dtype,
        info.max_request_tokens,
    )
    app = create_app(
        engine,
        name,
        api_key,
        max_waiting_requests,
        limits,
        cors=cors,
        tool_call_parser=tool_call_parser,
        pooling_type=pooling_type,
        trust_request_chat_template=trust_request_chat_template,
        batch=batch,
    )
    try:
        server_config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=grace_period + _FLUSH_S,
            http=JsonErrorsH11Protocol,
        )
        server = _Server(server_config, engine, grace_period)
        # A dead engine (a tensor-parallel worker exited) stops the server: a supervisor
        # restarts it, rather than a server answering 503 forever.
        engine.on_failure.append(lambda reason: setattr(server, "should_exit", True))
        server.run(sockets=[sock])
        if engine.failure is not None:
            raise EngineDiedError(f"the engine failed: {engine.failure}")
    finally:
        stopped = engine.shutdown(2.0 if engine.failure is not None else 10.0)
        sock.close()
        if engine.failure is not None and not stopped:
            # The engine thread waits in a collective with a rank that stopped answering, which
            # nothing interrupts before the collective's timeout (minutes): exit now, as vLLM
            # does when its engine dies. The requests in flight have had their errors.
            sys.stderr.write(f"error: the engine failed: {engine.failure}\n")
            sys.stderr.flush()
            logging.shutdown()
            os._exit(1)
        # The process ends next. Python puts its own handlers back to the default action while
        # it finalizes (torch's teardown takes a while), so a late second SIGTERM would still
        # kill it (exit 143); ignored signals stay ignored through that.
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
