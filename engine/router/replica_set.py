"""The router's replicas and who is in rotation. A replica enters rotation when its GET /health
answers 200, and leaves it after `health_failures` checks in a row fail, or at once when a
connection to it is refused (the proxy saw it: no need to wait for the next check). Checks run
every `health_interval_s` on every replica, in rotation or not, so one that comes back returns
by itself. Its cache is forgotten when it leaves: a replica that returns has usually restarted.

With --backend-dns the replicas are the addresses a name resolves to (a Kubernetes headless
Service), resolved again before every round of checks; a failed lookup keeps the last set."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence

import httpx

from engine.router.policy import Choice, RoutingPolicy
from engine.router.replica import Replica
from engine.router.router_config import RouterConfig, split_host_port

log = logging.getLogger(__name__)


class ReplicaSet:
    def __init__(self, config: RouterConfig, policy: RoutingPolicy) -> None:
        self.config, self.policy = config, policy
        self._replicas: dict[str, Replica] = {url: Replica(url) for url in config.backends}
        self._dns: dict[str, list[str]] = {}  # --backend-dns name -> the URLs it resolved to

    @property
    def replicas(self) -> list[Replica]:
        return list(self._replicas.values())

    def healthy(self) -> list[Replica]:
        return [r for r in self._replicas.values() if r.healthy]

    def choose(self, blocks: list[bytes], exclude: Sequence[Replica] = ()) -> Choice | None:
        """A replica in rotation, not among `exclude` (those this request already failed on)."""
        candidates = [r for r in self.healthy() if r not in exclude]
        return self.policy.choose(blocks, candidates) if candidates else None

    # ----- what the proxy saw --------------------------------------------------------------

    def connection_failed(self, replica: Replica, error: BaseException) -> None:
        """A request could not reach the replica. A refused or timed-out connect is conclusive;
        a connection that broke counts as one failed check."""
        reason = f"{type(error).__name__}: {error or 'no detail'}"
        if isinstance(error, httpx.ConnectError | httpx.ConnectTimeout):
            replica.failures = self.config.health_failures
        else:
            replica.failures += 1
        if replica.failures >= self.config.health_failures:
            self._take_out(replica, reason)

    # ----- health checks -------------------------------------------------------------------

    async def run(self, client: httpx.AsyncClient) -> None:
        """Checks every replica every health_interval_s, until cancelled."""
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.check_all(client)

    async def check_all(self, client: httpx.AsyncClient) -> None:
        await self._discover()
        await asyncio.gather(*(self._check(client, r) for r in self.replicas))

    async def _check(self, client: httpx.AsyncClient, replica: Replica) -> None:
        try:
            r = await client.get(f"{replica.url}/health", timeout=self.config.health_timeout_s)
            error = None if r.status_code == 200 else f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            error = f"/health: {type(e).__name__}: {e or 'no detail'}"
        if error is None:
            self._bring_in(replica)
            return
        replica.failures += 1
        if replica.failures >= self.config.health_failures:
            self._take_out(replica, error)
        else:
            replica.last_error = error

    def _bring_in(self, replica: Replica) -> None:
        replica.failures, replica.last_error = 0, ""
        if not replica.healthy:
            came_back = replica.ever_healthy
            replica.healthy = replica.ever_healthy = True
            log.info("replica %s %s", replica.url, "is back" if came_back else "is up")

    def _take_out(self, replica: Replica, reason: str) -> None:
        replica.last_error = reason
        if replica.healthy:
            replica.healthy = False
            self.policy.forget(replica.url)
            log.warning("replica %s out of rotation: %s", replica.url, reason)

    # ----- discovery -----------------------------------------------------------------------

    async def _discover(self) -> None:
        for name in self.config.backend_dns:
            host, port = split_host_port(name)
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, port, type=socket.SOCK_STREAM
                )
            except OSError as e:
                log.warning("--backend-dns %s: lookup failed (%s); keeping the last set", name, e)
                continue
            urls = sorted({_url(info[4][0], port) for info in infos})
            self._update_dns(name, urls)

    def _update_dns(self, name: str, urls: list[str]) -> None:
        old = set(self._dns.get(name, []))
        self._dns[name] = urls
        static = set(self.config.backends) | {u for n, us in self._dns.items() for u in us}
        for url in urls:
            if url not in self._replicas:
                log.info("--backend-dns %s: found replica %s", name, url)
                self._replicas[url] = Replica(url)
        for url in old - set(urls):
            if url not in static:
                log.info("--backend-dns %s: replica %s is gone", name, url)
                del self._replicas[url]
                self.policy.forget(url)


def _url(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"
