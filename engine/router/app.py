"""The router's HTTP app: /health and /metrics are its own; every other path goes to a replica
(proxy.py), so each OpenAI route the replicas serve, and each they will serve later, works
through the router unchanged, and a replica's own errors (a 400 for bad JSON, a 404 for an
unknown model, a 401 for a wrong key) reach the caller as the replica wrote them.

Starlette rather than FastAPI: the router validates nothing (the replicas do), so it has no
request models and no /openapi.json of its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.router.metrics_merge import merge_expositions
from engine.router.policy import make_policy
from engine.router.proxy import Proxy
from engine.router.replica_set import ReplicaSet
from engine.router.router_config import RouterConfig
from engine.router.router_metrics import RouterMetrics
from engine.server.auth import APIKeyCheck
from engine.server.disconnect import ClientDisconnected, until_disconnected
from engine.server.limits import BodySizeLimit

_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


class _Collected:
    """Already-merged families as a collector, for generate_latest."""

    def __init__(self, families) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


def create_router_app(
    config: RouterConfig,
    api_key: str | None = None,
    background: Sequence[Callable[[ReplicaSet], Awaitable[None]]] = (),
) -> Starlette:
    """api_key: the router checks it too (on /v1/ and the tokenizer routes, as the server
    does) and forwards the caller's header, so replicas with the same key accept it.
    background: tasks to run beside the health checks while the app runs (the data-parallel
    supervisor), each given the replica set."""
    policy = make_policy(
        config.policy,
        **(
            {"min_match": config.min_prefix_match, "balance_abs": config.balance_abs}
            if config.policy == "prefix"
            else {}
        ),
    )
    replicas = ReplicaSet(config, policy)
    metrics = RouterMetrics(replicas)
    state: dict = {}

    @asynccontextmanager
    async def lifespan(_: Starlette):
        timeout = httpx.Timeout(
            connect=config.connect_timeout_s,
            read=config.read_timeout_s,
            write=config.read_timeout_s,
            pool=None,
        )
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            state["proxy"] = Proxy(config, replicas, metrics, client)
            state["client"] = client
            await replicas.check_all(client)  # in rotation from the first request
            tasks = [asyncio.create_task(replicas.run(client))]
            tasks += [asyncio.create_task(task(replicas)) for task in background]
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    async def health(_: Request) -> JSONResponse:
        healthy = replicas.healthy()
        body = {
            "status": "ok" if healthy else "no replica in rotation",
            "replicas": [
                {
                    "url": r.url,
                    "healthy": r.healthy,
                    "outstanding": r.outstanding,
                    "error": r.last_error or None,
                }
                for r in replicas.replicas
            ],
        }
        return JSONResponse(body, status_code=200 if healthy else 503)

    async def prometheus(_: Request) -> Response:
        client: httpx.AsyncClient = state["client"]

        async def scrape(url: str) -> str | None:
            try:
                r = await client.get(f"{url}/metrics", timeout=config.health_timeout_s)
            except httpx.HTTPError:
                return None
            return r.text if r.status_code == 200 else None

        texts = await asyncio.gather(*(scrape(r.url) for r in replicas.healthy()))
        merged = CollectorRegistry(auto_describe=False)
        merged.register(_Collected(merge_expositions([t for t in texts if t is not None])))
        payload = generate_latest(merged) + generate_latest(metrics.registry)
        return Response(payload, media_type=CONTENT_TYPE_LATEST)

    async def forward(request: Request) -> Response:
        body = await request.body()
        try:
            return await until_disconnected(request, state["proxy"].forward(request, body))
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it

    # Outermost first: the key is checked before a body is read, as the server does.
    middleware = [Middleware(BodySizeLimit, max_bytes=config.max_request_bytes)]
    if api_key:
        middleware.insert(0, Middleware(APIKeyCheck, api_key=api_key))
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/{path:path}", forward, methods=_METHODS),
    ]
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
    app.state.replicas = replicas  # for tests and the data-parallel supervisor
    return app
