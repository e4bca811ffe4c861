"""vLLM's `priority` field over HTTP: with one running slot, a request with a lower priority
value that arrives later still starts (and so finishes) before a waiting higher one."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.engine.server.live_server import build_chat_model, live_server

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_chat_model(tmp_path_factory.mktemp("priority"))
    with live_server(model_dir, MODEL, max_model_len=128, max_num_seqs=1) as running:
        yield running


def test_lower_priority_value_runs_first(server):
    url, engine = server
    slow = lambda *_: time.sleep(0.01)  # noqa: E731 - steps slow enough to queue behind
    engine.step_observers.append(slow)
    finished: list[str] = []

    async def complete(http: httpx.AsyncClient, name: str, priority: int, tokens: int) -> None:
        body = {
            "prompt": "Once upon a time",
            "max_tokens": tokens,
            "ignore_eos": True,
            "temperature": 0,
            "priority": priority,
        }
        resp = await http.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        finished.append(name)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            first = asyncio.create_task(complete(http, "running", 0, 30))
            while engine.stats().num_running == 0:
                await asyncio.sleep(0.005)
            late = asyncio.create_task(complete(http, "waiting, priority 10", 10, 3))
            while engine.num_waiting < 1:
                await asyncio.sleep(0.005)
            urgent = asyncio.create_task(complete(http, "later, priority -10", -10, 3))
            await asyncio.gather(first, late, urgent)

    try:
        asyncio.run(run())
    finally:
        engine.step_observers.remove(slow)
    assert finished == ["running", "later, priority -10", "waiting, priority 10"]
