"""Several OpenAI-compatible endpoints used as one (`--endpoint URL1,URL2`): each call goes to the
endpoint that was sent the paper before, so that a paper's review finds its summary's prefix in
that server's cache, and otherwise to the least busy one. It is the router's own policy
(engine/router/policy.py), run in the digest's process, so that the digest needs no router in
front of its servers; a router URL (`nightshift router`, `serve --data-parallel-size`) works
as well, as one endpoint.

An endpoint whose call failed in a way a retry can fix (refused, reset, timed out, 429, 5xx) sits
out `cooldown_s`, so the chat client's retry goes to another one; when every endpoint sits out,
all are tried again (the client's backoff paces that)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from engine.router.policy import PrefixAffinityPolicy
from engine.router.prefix_key import block_hashes, routing_text
from engine.router.replica import Replica

COOLDOWN_S = 30.0


class EndpointPool:
    def __init__(self, base_urls: Sequence[str], cooldown_s: float = COOLDOWN_S) -> None:
        if not base_urls:
            raise ValueError("an endpoint pool needs an endpoint")
        self.endpoints = [Replica(url, healthy=True) for url in base_urls]
        self.cooldown_s = cooldown_s
        # Half the digest's default concurrency: beyond that a paper's endpoint gives way.
        self.policy = PrefixAffinityPolicy(balance_abs=2)
        self._out_until: dict[str, float] = {}

    def acquire(self, messages: list[dict]) -> Replica:
        """The endpoint for one attempt of a call; release() it when the attempt ends."""
        now = time.monotonic()
        for e in self.endpoints:
            e.healthy = now >= self._out_until.get(e.url, 0.0)
        candidates = [e for e in self.endpoints if e.healthy] or self.endpoints
        blocks = block_hashes(routing_text({"messages": messages}))
        endpoint = self.policy.choose(blocks, candidates).replica
        endpoint.outstanding += 1
        return endpoint

    def release(self, endpoint: Replica) -> None:
        endpoint.outstanding -= 1

    def failed(self, endpoint: Replica, reason: str) -> None:
        """An attempt failed in a way another endpoint may not: this one sits out a while."""
        endpoint.last_error = reason
        self._out_until[endpoint.url] = time.monotonic() + self.cooldown_s
