"""`nightshift serve --data-parallel-size 2`: two engines on the ports after --port, with the
serve options they were given, behind a router on --port; SIGTERM stops all three (exit 0); an
engine port in use is one line before anything starts. The supervisor on its own (engines that
exit at once): one that exits before serving stops the fleet with its exit code, one that exits
after serving is started again. And the plan's parts: GPUs per engine, CPU threads per engine,
the key kept out of argv."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from engine.router.data_parallel import (
    DataParallelError,
    EngineChild,
    EngineFleet,
    device_groups,
    engine_children,
)
from engine.router.proxy import REPLICA_HEADER
from engine.router.replica import Replica
from tests.engine.router.replicas import wait_for
from tests.engine.server.live_server import build_chat_model


def _free_run(length: int) -> int:
    """A port p with p .. p + length - 1 all free a moment ago."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + length > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + length):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no run of free ports")


def _serve(model_dir, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nightshift.cli", "serve", "--model", str(model_dir)]
    cmd += ["--served-model-name", "tiny-dp", "--max-model-len", "256", "--port", str(port)]
    cmd += ["--data-parallel-size", "2", "--no-enable-prefix-caching"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("dp") / "m", max_position_embeddings=256)


def test_two_engines_behind_the_router_and_a_clean_stop(model_dir):
    port = _free_run(3)
    proc = _serve(model_dir, port)
    try:

        def both_up() -> bool:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()
            except (httpx.TransportError, ValueError):
                return False
            return [r["healthy"] for r in health["replicas"]] == [True, True]

        wait_for(both_up, 150, "both engines in rotation")
        for engine_port in (port + 1, port + 2):  # each got the serve options it was given
            card = httpx.get(f"http://127.0.0.1:{engine_port}/v1/models").json()["data"][0]
            assert card["id"] == "tiny-dp" and card["max_model_len"] == 256
        body = {"model": "tiny-dp", "prompt": "Hello", "max_tokens": 3}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        assert r.headers[REPLICA_HEADER] in {f"http://127.0.0.1:{port + i}" for i in (1, 2)}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        for p in (port, port + 1, port + 2):  # nothing left listening
            with pytest.raises(httpx.TransportError):
                httpx.get(f"http://127.0.0.1:{p}/health", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_engine_port_in_use_is_one_line_before_anything_starts(model_dir):
    port = _free_run(3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 2))
        taken.listen()
        proc = _serve(model_dir, port)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port + 2}: Address already in use "
        "(the engines use the ports after --port)"
    ]


def _fleet(code: int, served: bool) -> tuple[EngineFleet, _Replicas]:
    """One engine that exits with `code` at once; `served`: it had been healthy."""
    child = EngineChild(0, 9001, [sys.executable, "-c", f"raise SystemExit({code})"], {})
    replicas = _Replicas([Replica(child.url, ever_healthy=served)])
    return EngineFleet([child], grace_period=1.0), replicas


class _Replicas:
    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas


def test_an_engine_that_exits_before_serving_stops_the_fleet():
    fleet, replicas = _fleet(2, served=False)
    fleet.start()
    asyncio.run(asyncio.wait_for(fleet.watch(replicas), 20))
    assert fleet.stopping and fleet.failure is not None and fleet.failure.exit_code == 2
    assert "engine 0 (127.0.0.1:9001) exited with 2 before it became healthy" in str(fleet.failure)


def test_an_engine_that_exits_after_serving_is_started_again():
    fleet, replicas = _fleet(1, served=True)
    fleet.start()
    first = fleet.children[0].proc

    async def until_restarted() -> None:
        watching = asyncio.ensure_future(fleet.watch(replicas))
        while fleet.children[0].restarts < 1:
            await asyncio.sleep(0.05)
        fleet.stopping = True
        await watching

    asyncio.run(asyncio.wait_for(until_restarted(), 20))
    assert fleet.failure is None and fleet.children[0].proc is not first
    fleet.stop()


def test_devices_per_engine(monkeypatch):
    assert device_groups("cpu", 3, 1) == [None, None, None]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert device_groups("auto", 2, 2) == ["0,1", "2,3"]
    assert device_groups("cuda", 4, 1) == ["0", "1", "2", "3"]
    with pytest.raises(DataParallelError, match="needs 6 GPUs; 4 visible"):
        device_groups("cuda", 3, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert device_groups("auto", 2, 1) == [None, None]  # no GPU: CPU engines
    with pytest.raises(DataParallelError, match="no GPU"):
        device_groups("cuda", 2, 1)


def test_engine_processes_get_ports_threads_and_the_key_by_environment(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    children = engine_children(2, 9000, ["--max-model-len", "256"], "k3y", [None, "1"])
    assert [c.port for c in children] == [9001, 9002]
    assert all("k3y" not in " ".join(c.cmd) for c in children)
    assert all(c.env["NIGHTSHIFT_API_KEY"] == "k3y" for c in children)
    assert children[0].cmd[-6:] == [
        "--max-model-len",
        "256",
        "--host",
        "127.0.0.1",
        "--port",
        "9001",
    ]
    assert "OMP_NUM_THREADS" in children[0].env and children[1].env["CUDA_VISIBLE_DEVICES"] == "1"
    with pytest.raises(DataParallelError, match="no room"):
        engine_children(2, 65534, [], None, [None, None])
