"""The router in front of two real replicas (`nightshift serve`, a tiny model, loopback):

- affinity: on a digest-like trace (12 papers, each a summary then a review that share the
  system text and the paper, as digest/prompts.py orders them) prefix routing keeps each
  paper's two calls on one replica and the replicas' measured prefix-cache hit rate is far
  above round-robin's on the same kind of trace;
- the official `openai` client streams through the router, and the stream's text is the
  non-streaming text;
- a replica's own refusals (bad JSON, an unknown model) reach the caller unchanged;
- a replica killed with SIGKILL mid-run fails no request: those it held, and those sent before
  the router noticed, are answered by the other replica; /health and /metrics show it out of
  rotation; started again on its port, it returns by itself."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from engine.router.proxy import REPLICA_HEADER
from engine.router.router_config import RouterConfig
from tests.engine.router.replicas import MODEL, Replica, running_router, wait_for
from tests.engine.server.live_server import build_chat_model

PAPERS = 12
WORDS = "model data token layer attention training loss benchmark retrieval decoding".split()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    model_dir = build_chat_model(
        tmp_path_factory.mktemp("router") / "m", max_position_embeddings=1024
    )
    pair = [Replica(model_dir).start(), Replica(model_dir).start()]
    try:
        for r in pair:
            r.wait_healthy()
        yield pair
    finally:
        for r in pair:
            r.stop()


def _config(replicas, **options) -> RouterConfig:
    return RouterConfig(backends=[r.url for r in replicas], health_interval_s=0.2, **options)


# ----- a digest-like trace --------------------------------------------------------------------


def _paper(run: str, i: int) -> str:
    rng = random.Random(f"{run}-{i}")
    body = " ".join(rng.choice(WORDS) for _ in range(150))
    return f"Title: {run} paper {i}\nAuthors: A. Author\n\nAbstract:\n{body}"


def _messages(run: str, i: int, task: str) -> list[dict]:
    # The digest's order: shared system text, the paper, the task (digest/prompts.py). The
    # system text names the run, so no run hits the cache another run filled.
    system = f"[{run}] You are a careful reviewer writing a digest of new papers. " * 3
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"{_paper(run, i)}\n\nTask: {task}"},
    ]


SUMMARY = "summarize the paper above in 3 to 5 plain sentences."
REVIEW = "review the paper above; reply with one JSON object with strengths and weaknesses."


async def _run_trace(url: str, run: str, concurrency: int) -> dict[int, tuple[str, str]]:
    """Each paper's summary then review, `concurrency` papers at a time; returns paper ->
    (replica of the summary, replica of the review)."""
    slots = asyncio.Semaphore(concurrency)
    where: dict[int, tuple[str, str]] = {}

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def call(i: int, task: str) -> str:
            body = {"model": MODEL, "messages": _messages(run, i, task), "max_tokens": 2}
            r = await client.post("/v1/chat/completions", json={**body, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.headers[REPLICA_HEADER]

        async def paper(i: int) -> None:
            async with slots:
                where[i] = (await call(i, SUMMARY), await call(i, REVIEW))

        await asyncio.gather(*(paper(i) for i in range(PAPERS)))
    return where


def _prefix_counters(replicas) -> tuple[float, float]:
    hits = queries = 0.0
    for r in replicas:
        for family in text_string_to_metric_families(httpx.get(f"{r.url}/metrics").text):
            for s in family.samples:
                if s.name == "vllm:prefix_cache_hits_total":
                    hits += s.value
                elif s.name == "vllm:prefix_cache_queries_total":
                    queries += s.value
    return hits, queries


def _measure(replicas, policy: str, run: str, concurrency: int) -> tuple[float, int]:
    """(prefix-cache hit rate of the run, papers whose two calls met on one replica)."""
    hits0, queries0 = _prefix_counters(replicas)
    with running_router(_config(replicas, policy=policy)) as url:
        where = asyncio.run(_run_trace(url, run, concurrency))
    hits1, queries1 = _prefix_counters(replicas)
    together = sum(summary == review for summary, review in where.values())
    assert {url for pair in where.values() for url in pair} == {r.url for r in replicas}
    return (hits1 - hits0) / (queries1 - queries0), together


def test_prefix_routing_keeps_a_papers_calls_together_and_raises_the_hit_rate(replicas):
    rr_rate, rr_together = _measure(replicas, "round-robin", "rr", concurrency=1)
    prefix_rate, prefix_together = _measure(replicas, "prefix", "prefix", concurrency=1)
    busy_rate, busy_together = _measure(replicas, "prefix", "busy", concurrency=4)
    print(
        f"\nprefix-cache hit rate over {PAPERS} papers x (summary, review): "
        f"round-robin {rr_rate:.3f} ({rr_together}/{PAPERS} papers on one replica), "
        f"prefix {prefix_rate:.3f} ({prefix_together}/{PAPERS}), "
        f"prefix at 4 papers in flight {busy_rate:.3f} ({busy_together}/{PAPERS})"
    )
    # One at a time, round-robin alternates: every review lands where its summary did not.
    assert rr_together == 0
    assert prefix_together == PAPERS and busy_together == PAPERS
    # Each review finds its paper cached (about 3/4 of its prompt); round-robin's find only
    # the system text.
    assert prefix_rate > rr_rate + 0.2
    assert busy_rate > rr_rate + 0.2


# ----- the OpenAI client, errors ------------------------------------------------------------


def test_the_openai_client_streams_through_the_router(replicas):
    with running_router(_config(replicas)) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "Write a line about routers."}]
        common = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0}
        whole = client.chat.completions.create(**common).choices[0].message.content
        chunks = list(client.chat.completions.create(**common, stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert whole and streamed == whole
        text = client.completions.create(model=MODEL, prompt="Routers", max_tokens=8, temperature=0)
        parts = client.completions.create(
            model=MODEL, prompt="Routers", max_tokens=8, temperature=0, stream=True
        )
        assert "".join(p.choices[0].text for p in parts) == text.choices[0].text
        assert [m.id for m in client.models.list()] == [MODEL]


def test_a_replicas_refusals_pass_through_and_the_router_keeps_serving(replicas):
    with running_router(_config(replicas)) as url:
        bad = httpx.post(
            f"{url}/v1/chat/completions",
            content=b'{"model": "x", "messages": [',
            headers={"content-type": "application/json"},
        )
        assert bad.status_code == 400 and REPLICA_HEADER in bad.headers
        assert "not valid JSON" in bad.json()["error"]["message"]
        unknown = httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "hi"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"
        assert httpx.get(f"{url}/v1/nowhere").status_code == 404
        ok = httpx.post(
            f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
        )
        assert ok.status_code == 200
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ok" and all(r["healthy"] for r in health["replicas"])
        router_errors = _router_samples(url, "nightshift:router_errors_total")
        assert sum(router_errors.values()) == 0  # the replicas answered every one


# ----- a replica killed mid-run -------------------------------------------------------------


def _router_samples(url: str, name: str) -> dict[str, float]:
    """label values (replica, reason or code) -> value of one of the router's own series."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name == name:
                out[next(iter(s.labels.values()), "")] = s.value
    return out


async def _completions(url: str, prompts: list[str], max_tokens: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        body = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        return await asyncio.gather(
            *(client.post("/v1/completions", json={**body, "prompt": p}) for p in prompts)
        )


def test_a_killed_replica_fails_no_request_and_returns_when_restarted(replicas):
    a, b = replicas
    with running_router(_config(replicas)) as url:
        router_a = next(r for r in url.app.state.replicas.replicas if r.url == a.url)

        async def kill_mid_run() -> list[httpx.Response]:
            prompts = [f"Request {i}: tell a long story about routing." for i in range(12)]
            calls = asyncio.ensure_future(_completions(url, prompts, max_tokens=160))
            deadline = time.monotonic() + 30
            while router_a.outstanding < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert router_a.outstanding >= 2, "replica a never held requests"
            await asyncio.to_thread(a.kill)
            return await calls

        answers = asyncio.run(kill_mid_run())
        assert [r.status_code for r in answers] == [200] * 12, [r.text for r in answers]
        assert all(r.headers[REPLICA_HEADER] == b.url for r in answers if r.status_code == 200)
        assert _router_samples(url, "nightshift:router_retries_total").get(a.url, 0) >= 2

        # Out of rotation, and everything goes to b.
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ok"
        assert {r["url"]: r["healthy"] for r in health["replicas"]} == {a.url: False, b.url: True}
        assert _router_samples(url, "nightshift:router_replica_up") == {a.url: 0.0, b.url: 1.0}
        more = asyncio.run(_completions(url, [f"after {i}" for i in range(4)], max_tokens=4))
        assert {r.status_code for r in more} == {200}
        assert {r.headers[REPLICA_HEADER] for r in more} == {b.url}

        # Started again on its port, it returns by itself and takes requests again.
        a.start()
        a.wait_healthy()
        wait_for(lambda: router_a.healthy, 10, "replica a back in rotation")
        assert _router_samples(url, "nightshift:router_replica_up") == {a.url: 1.0, b.url: 1.0}
        back = asyncio.run(_completions(url, [f"back {i}" for i in range(4)], max_tokens=4))
        assert {r.status_code for r in back} == {200}
        assert a.url in {r.headers[REPLICA_HEADER] for r in back}
