"""The router's promises against scripted replicas (fake_replica.py), each in well under a
second: a request that had not started is retried on another replica (a connection closed
before any answer, a 503, a 429 while another replica is free); one that had started is not,
and a stream broken mid-way ends in an error event and [DONE]; with no replica left the caller
gets a 503 in OpenAI's shape; a slow replica is a 504, not a retry; the caller leaving closes
the request upstream; the router's key, body limit and bad options."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import httpx
import pytest

from engine.router.proxy import REPLICA_HEADER, _RelayedStream, _StreamLease
from engine.router.replica import Replica
from engine.router.router_config import RouterConfig, RouterConfigError, normalize_backend
from engine.router.serve_router import RouterBindError, check_not_self
from engine.server.server_process import free_loopback_port
from tests.engine.router.fake_replica import FakeReplica
from tests.engine.router.replicas import running_router, wait_for

BODY = {"model": "m", "prompt": "x" * 300}


@pytest.fixture
def fakes(request):
    made: list[FakeReplica] = []

    def make(*modes: str) -> list[FakeReplica]:
        made.extend(FakeReplica(m) for m in modes)
        return made[-len(modes) :]

    yield make
    for f in made:
        f.close()


def _config(fakes, **options) -> RouterConfig:
    return RouterConfig(backends=[f.url for f in fakes], health_interval_s=0.1, **options)


def _events(r: httpx.Response) -> list[str]:
    return [ln.removeprefix("data: ") for ln in r.text.splitlines() if ln.startswith("data: ")]


@pytest.mark.parametrize("mode", ["close", "status503"])
def test_a_request_that_had_not_started_goes_to_another_replica(fakes, mode):
    bad, good = fakes(mode, "ok")
    # Round-robin from the bad one, so that every request meets it first.
    with running_router(_config([bad, good], policy="round-robin")) as url:
        for _ in range(4):
            r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=10)
            assert r.status_code == 200, r.text
            assert r.json()["replica"] == good.url == r.headers[REPLICA_HEADER]
        assert len(good.requests) == 4 and bad.requests
        retries = httpx.get(f"{url}/metrics").text
        assert f'nightshift:router_retries_total{{replica="{bad.url}"}}' in retries


def test_a_429_is_retried_while_another_replica_is_free_and_passed_on_when_none_is(fakes):
    full, good = fakes("status429", "ok")
    with running_router(_config([full, good], policy="round-robin")) as url:
        assert httpx.post(f"{url}/v1/completions", json=BODY).json()["replica"] == good.url
    with running_router(_config([full])) as url:
        r = httpx.post(f"{url}/v1/completions", json=BODY)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert r.headers["retry-after"] == "1"


def test_a_stream_broken_mid_way_ends_with_an_error_event_and_is_not_retried(fakes):
    broken, good = fakes("break", "ok")
    with running_router(_config([broken, good], policy="round-robin")) as url:
        answers = [
            httpx.post(f"{url}/v1/completions", json={**BODY, "stream": True}, timeout=10)
            for _ in "ab"
        ]
        r = next(r for r in answers if r.headers[REPLICA_HEADER] == broken.url)
        events = _events(r)
        assert events[0] == '{"n": 1}'  # the whole first event; the half second one dropped
        assert json.loads(events[1])["error"]["code"] == "stream_broken"
        assert events[2:] == ["[DONE]"]
        assert len(broken.requests) == 1 and len(good.requests) == 1  # never sent again
        assert (
            'nightshift:router_errors_total{code="stream_broken"} 1.0'
            in httpx.get(f"{url}/metrics").text
        )


def test_no_replica_in_rotation_is_a_503_in_openai_shape(fakes):
    (down,) = fakes("ok")
    down.healthy = False
    config = RouterConfig(backends=[down.url, "http://127.0.0.1:9"], health_interval_s=0.1)
    with running_router(config) as url:
        assert httpx.get(f"{url}/health").status_code == 503
        r = httpx.post(f"{url}/v1/completions", json=BODY)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["code"] == "no_replica" and error["type"] == "service_unavailable"
        assert "127.0.0.1:9" in error["message"]
        down.healthy = True  # it returns by itself
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, 5, "the replica back")
        assert httpx.post(f"{url}/v1/completions", json=BODY).status_code == 200


def test_every_replica_failing_before_answering_is_a_503(fakes):
    a, b = fakes("close", "close")
    with running_router(_config([a, b])) as url:
        r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "replicas_failed"
        assert len(a.requests) == 1 and len(b.requests) == 1  # each tried once


def test_a_slow_replica_is_a_504_not_a_retry(fakes):
    slow, good = fakes("slow", "ok")
    config = _config([slow, good], policy="round-robin", read_timeout_s=0.5)
    with running_router(config) as url:
        answers = [httpx.post(f"{url}/v1/completions", json=BODY, timeout=10) for _ in "ab"]
        assert sorted(r.status_code for r in answers) == [200, 504]
        late = next(r for r in answers if r.status_code == 504)
        assert late.json()["error"]["code"] == "timeout"
        assert len(good.requests) == 1 and len(slow.requests) == 1  # nothing ran twice


def test_the_caller_leaving_a_stream_closes_it_upstream(fakes):
    (endless,) = fakes("forever")
    with running_router(_config([endless])) as url:
        replica = url.app.state.replicas.replicas[0]
        with httpx.stream("POST", f"{url}/v1/completions", json=BODY, timeout=10) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and '"n": 5' in line:
                    break
        assert endless.disconnected.wait(5)
        wait_for(lambda: replica.outstanding == 0, 5, "the stream's slot freed")


def test_the_routers_key_and_body_limit(fakes):
    (ok,) = fakes("ok")
    with running_router(_config([ok], max_request_bytes=1000), api_key="sekrit") as url:
        assert httpx.post(f"{url}/v1/completions", json=BODY).status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200  # probes stay open
        auth = {"Authorization": "Bearer sekrit"}
        r = httpx.post(f"{url}/v1/completions", json=BODY, headers=auth)
        assert r.status_code == 200 and r.json()["authorization"] == "Bearer sekrit"
        big = httpx.post(f"{url}/v1/completions", json={"prompt": "x" * 2000}, headers=auth)
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "needs a backend"),
        ({"backends": ["localhost:8000"]}, "http"),
        ({"backends": ["http://h:0"]}, "port"),
        ({"backends": ["http://h:99999"]}, "port"),
        ({"backends": ["http://h:1", "http://h:1/v1"]}, "twice"),
        ({"backends": ["http://h:1"], "policy": "random"}, "--policy"),
        ({"backends": ["http://h:1"], "health_interval_s": 0}, "--health-interval"),
        ({"backends": ["http://h:1"], "prefix_block_chars": 0}, "--prefix-block-chars"),
        ({"backend_dns": ["no-port"]}, "--backend-dns"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(RouterConfigError, match=message):
        RouterConfig(**options)


def test_backend_urls_lose_a_trailing_v1():
    assert normalize_backend("http://10.0.0.1:8000/v1/") == "http://10.0.0.1:8000"
    assert normalize_backend("https://h/prefix/v1") == "https://h/prefix"


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--backend", "ftp://x"],
        ["--backend", "http://127.0.0.1:1", "--host", "0.0.0.0"],
        ["--backend", "http://localhost:18123/v1", "--port", "18123"],
    ],
)
def test_the_router_command_refuses_in_one_line(args):
    r = subprocess.run(
        [sys.executable, "-m", "nightshift.cli", "router", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize(
    ("backend", "host", "port", "is_self"),
    [
        ("http://127.0.0.1:8000", "127.0.0.1", 8000, True),
        ("http://localhost:8000", "127.0.0.1", 8000, True),
        ("http://127.0.0.1:8000", "0.0.0.0", 8000, True),
        ("http://10.0.0.5:8000", "10.0.0.5", 8000, True),
        ("http://127.0.0.1:8001", "127.0.0.1", 8000, False),
        ("http://10.0.0.6:8000", "10.0.0.5", 8000, False),
    ],
)
def test_the_routers_own_address_is_not_a_backend(backend, host, port, is_self):
    """It would send every request back to itself (a 503 after its health checks fail)."""
    if is_self:
        with pytest.raises(RouterBindError, match="is the router's own address"):
            check_not_self([normalize_backend(backend)], host, port)
    else:
        check_not_self([normalize_backend(backend)], host, port)


def test_backends_found_by_dns(fakes):
    (ok,) = fakes("ok")
    port = ok.url.rsplit(":", 1)[1]
    config = RouterConfig(backend_dns=[f"localhost:{port}"], health_interval_s=0.1)
    with running_router(config) as url:
        found = {r.url: r.healthy for r in url.app.state.replicas.replicas}
        assert found[ok.url] is True  # 127.0.0.1 (and ::1, where localhost has it, not listening)
        assert httpx.post(f"{url}/v1/completions", json=BODY).json()["replica"] == ok.url


def test_the_router_command_serves_and_stops_on_sigterm(fakes):
    (ok,) = fakes("ok")
    port = free_loopback_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "nightshift.cli", "router", "--backend", f"{ok.url}/v1"]
        + ["--port", str(port), "--health-interval", "0.2"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, 30, "the router up")
        assert httpx.post(f"{url}/v1/completions", json=BODY).json()["replica"] == ok.url
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_router_imports_no_torch():
    code = "import sys, engine.router.serve_router, engine.router.data_parallel; "
    code += "assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_stream_whose_caller_left_before_its_first_byte_gives_its_replica_back():
    """Starlette never starts the body of a response whose caller is already gone: the lease
    is given back by the response itself."""
    replica = Replica("http://r:1", healthy=True, outstanding=1)
    lease = _StreamLease(replica, httpx.Response(200, content=b""))

    async def body():
        yield b"never sent"

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await asyncio.sleep(1)  # the caller is gone; the disconnect wins

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "headers": []}
    asyncio.run(_RelayedStream(body(), 200, {}, lease)(scope, receive, send))
    assert lease.released and replica.outstanding == 0
