"""`nightshift serve --data-parallel-size N`: N engine servers on this machine behind one router.

Engine i is `nightshift serve` with the same options, on 127.0.0.1:(port + 1 + i); the router
listens on --host:--port, the address clients already use. On a GPU machine each engine gets its
own devices (CUDA_VISIBLE_DEVICES: engine i the i-th group of --tensor-parallel-size GPUs), and
refuses to start when there are too few, rather than N engines fighting over one GPU's memory;
on CPU each gets an equal share of the physical cores available (engine/cpu_threads.py) as
OMP_NUM_THREADS, unless that is set already or the engines are given --threads.

The engines are the router's children: they die with it (even on `kill -9`, parent_death.py),
SIGTERM reaches them at once (they finish their requests in flight while the router relays the
answers), and one that exits after having served is started again (after 1, 2, 4 ... 60 s),
while the router routes around it. One that exits before its first healthy /health is a setup
mistake (a port in use, a model it cannot load): everything stops, naming it."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from engine.cpu_threads import detect_budget
from engine.router.replica_set import ReplicaSet
from engine.router.router_config import RouterConfig
from engine.router.serve_router import check_router_bind, router_server
from engine.server import parent_death
from engine.server.auth import API_KEY_ENV
from engine.server.listen_socket import listen_socket

log = logging.getLogger(__name__)

_POLL_S = 0.5
_MAX_BACKOFF_S = 60.0


class DataParallelError(RuntimeError):
    """An engine could not start, or the machine cannot hold N of them. exit_code: 2 for a
    setup mistake (too few GPUs, an engine refusing its options), else 1."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(slots=True)
class EngineChild:
    index: int
    port: int
    cmd: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    restart_at: float | None = None  # monotonic time of the next start, once it has exited

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(parent_death.command(os.getpid(), self.cmd), env=self.env)
        self.restart_at = None


@dataclass(slots=True)
class EngineFleet:
    children: list[EngineChild]
    grace_period: float
    stopping: bool = False
    failure: DataParallelError | None = None
    server: object | None = field(default=None, repr=False)  # the RouterServer, to stop it

    def start(self) -> None:
        for child in self.children:
            child.start()
        log.info(
            "started %d engines on 127.0.0.1 ports %s",
            len(self.children),
            ", ".join(str(c.port) for c in self.children),
        )

    def signal_all(self) -> None:
        """A stop signal reached the router: pass it on (a second one ends their requests)."""
        self.stopping = True
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        self.signal_all()
        deadline = time.monotonic() + self.grace_period + 15.0  # their grace, then their flush
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("engine %d did not stop; killing it", child.index)
                child.proc.kill()
                child.proc.wait()

    async def watch(self, replicas: ReplicaSet) -> None:
        """Runs in the router's event loop (the main thread: parent_death ties a child to the
        thread that started it) until the router stops."""
        by_url = {r.url: r for r in replicas.replicas}
        while not self.stopping:
            await asyncio.sleep(_POLL_S)
            for child in self.children:
                self._look_after(child, by_url[child.url].ever_healthy)

    def _look_after(self, child: EngineChild, served: bool) -> None:
        if self.stopping or child.proc is None:
            return
        code = child.proc.poll()
        if code is None:
            return
        if not served and child.restarts == 0:
            message = (
                f"engine {child.index} (127.0.0.1:{child.port}) exited with {code} before it "
                "became healthy; its own error is above"
            )
            self.failure = DataParallelError(message, 2 if code == 2 else 1)
            log.error("%s", message)
            self.stopping = True
            self.signal_all()
            if self.server is not None:
                self.server.should_exit = True  # type: ignore[attr-defined]
            return
        now = time.monotonic()
        if child.restart_at is None:
            delay = min(_MAX_BACKOFF_S, 2.0**child.restarts)
            child.restart_at = now + delay
            log.warning(
                "engine %d exited with %s; starting it again in %.0f s", child.index, code, delay
            )
        elif now >= child.restart_at:
            child.restarts += 1
            child.start()


def device_groups(device: str, size: int, tensor_parallel_size: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each engine; None for CPU engines."""
    if device == "cpu":
        return [None] * size
    visible = _visible_gpus()
    if not visible:
        if device == "auto":
            return [None] * size
        raise DataParallelError(f"--device {device}, but no GPU is visible")
    need = size * tensor_parallel_size
    if len(visible) < need:
        raise DataParallelError(
            f"--data-parallel-size {size} x --tensor-parallel-size {tensor_parallel_size} needs "
            f"{need} GPUs; {len(visible)} visible ({','.join(visible)})"
        )
    tp = tensor_parallel_size
    return [",".join(visible[i * tp : (i + 1) * tp]) for i in range(size)]


def _visible_gpus() -> list[str]:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def engine_children(
    size: int,
    port: int,
    engine_args: list[str],
    api_key: str | None,
    devices: list[str | None],
) -> list[EngineChild]:
    if port + size > 65535:
        raise DataParallelError(
            f"--port {port} leaves no room for {size} engines on the ports after it"
        )
    # The physical cores this process may use (affinity, cgroup quota), shared out; an engine
    # given --threads (in engine_args) takes that instead.
    threads = max(1, detect_budget().threads // size)
    children = []
    for i in range(size):
        env = dict(os.environ)
        if api_key:
            env[API_KEY_ENV] = api_key  # not argv, which `ps` shows
        if devices[i] is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices[i]  # type: ignore[assignment]
        else:
            env.setdefault("OMP_NUM_THREADS", str(threads))
        engine_port = port + 1 + i
        cmd = [sys.executable, "-m", "nightshift.cli", "serve", *engine_args]
        cmd += ["--host", "127.0.0.1", "--port", str(engine_port)]
        children.append(EngineChild(i, engine_port, cmd, env))
    return children


def check_port_free(port: int) -> None:
    """An engine port in use fails here, in one line, not after the engines' model loads (an
    engine checks again itself, which also covers a port taken in between)."""
    try:
        listen_socket("127.0.0.1", port).close()
    except OSError as e:
        raise DataParallelError(f"{e} (the engines use the ports after --port)") from None


def serve_data_parallel(
    size: int,
    host: str,
    port: int,
    engine_args: list[str],
    *,
    api_key: str | None,
    allow_unauthenticated: bool,
    grace_period: float,
    device: str = "auto",
    tensor_parallel_size: int = 1,
    router_options: dict | None = None,
) -> None:
    """Runs until SIGTERM/SIGINT. engine_args: `nightshift serve` options for every engine
    (no --host, --port, --data-parallel-size, nor the API key, which goes by environment).
    router_options: RouterConfig fields other than the backends (the policy, ...)."""
    if "WORLD_SIZE" in os.environ:
        raise DataParallelError(
            f"--data-parallel-size starts its {size} engines on this machine itself, but "
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set (a torchrun-style launch): every "
            "engine would take the same ranks. Unset MASTER_ADDR, MASTER_PORT, RANK and "
            "WORLD_SIZE, or launch each replica's ranks yourself and put `nightshift router` "
            "in front of them"
        )
    check_router_bind(host, api_key, allow_unauthenticated)
    sock = listen_socket(host, port)  # first: a port in use fails before any engine starts
    try:
        devices = device_groups(device, size, tensor_parallel_size)
        children = engine_children(size, port, engine_args, api_key, devices)
        for child in children:
            check_port_free(child.port)
        # Checked often: a local engine's /health costs nothing, and one that died is noticed
        # (and its requests sent elsewhere) within a second.
        options = {"health_interval_s": 1.0, **(router_options or {})}
        config = RouterConfig(backends=[c.url for c in children], **options)
        fleet = EngineFleet(children, grace_period)
        server = router_server(config, api_key, grace_period, fleet.signal_all, (fleet.watch,))
        fleet.server = server
        fleet.start()
        log.info("router on http://%s:%d in front of %d engines", host, port, size)
        try:
            server.run(sockets=[sock])
        finally:
            fleet.stop()
    finally:
        sock.close()
    if fleet.failure:
        raise fleet.failure
