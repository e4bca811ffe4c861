"""The router's own metrics (`nightshift:router_*`, label `replica` = the backend URL): what it
sent where and why, what it retried, what it answered itself, and, computed at scrape time, which
replicas are in rotation and what each has in flight. /metrics shows them after the replicas'
merged series (metrics_merge.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from engine.router.replica_set import ReplicaSet


class _ReplicaState:
    """Scrape-time gauges read from the replica set."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    def collect(self):
        up = GaugeMetricFamily(
            "nightshift:router_replica_up",
            "1 while the replica is in rotation (its /health passes), else 0.",
            labels=["replica"],
        )
        outstanding = GaugeMetricFamily(
            "nightshift:router_outstanding_requests",
            "Requests the router has sent to the replica and not yet relayed to their end.",
            labels=["replica"],
        )
        for r in self.replicas.replicas:
            up.add_metric([r.url], 1.0 if r.healthy else 0.0)
            outstanding.add_metric([r.url], r.outstanding)
        yield up
        yield outstanding


class RouterMetrics:
    def __init__(self, replicas: ReplicaSet) -> None:
        self.registry = r = CollectorRegistry(auto_describe=False)
        r.register(_ReplicaState(replicas))
        self.requests = Counter(
            "nightshift:router_requests",
            "Requests a replica answered through the router (any status).",
            ["replica"],
            registry=r,
        )
        self.decisions = Counter(
            "nightshift:router_routing_decisions",
            "Routing decisions by reason: prefix (a replica held the prompt's prefix), load "
            "(the least busy replica), turn (round-robin).",
            ["reason"],
            registry=r,
        )
        self.retries = Counter(
            "nightshift:router_retries",
            "Attempts that failed on a replica before any byte of the answer (refused or broken "
            "connection, 429, 503) and were sent to another replica.",
            ["replica"],
            registry=r,
        )
        self.errors = Counter(
            "nightshift:router_errors",
            "Requests the router answered with an error itself: no_replica (none in rotation), "
            "replicas_failed (every one tried failed before answering), timeout, stream_broken "
            "(a replica failed mid-stream: the stream ends with an error event).",
            ["code"],
            registry=r,
        )
        for code in ("no_replica", "replicas_failed", "timeout", "stream_broken"):
            self.errors.labels(code)
        for reason in ("prefix", "load", "turn"):
            self.decisions.labels(reason)
