"""The replicas' expositions merged: counters and histograms summed, ratio gauges averaged, info
gauges kept once, start times left out; the result parses as Prometheus text again."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.router.metrics_merge import merge_expositions


def _exposition(hits: float, queries: float, usage: float, running: float) -> str:
    """A replica's /metrics as prometheus_client writes it (the server's own library)."""
    r = CollectorRegistry()
    labels = ["model_name", "engine"]
    Counter("vllm:prefix_cache_hits", "Hits.", labels, registry=r).labels("m", "0").inc(hits)
    Counter("vllm:prefix_cache_queries", "Queries.", labels, registry=r).labels("m", "0").inc(
        queries
    )
    Gauge("vllm:kv_cache_usage_perc", "KV usage.", labels, registry=r).labels("m", "0").set(usage)
    Gauge("vllm:num_requests_running", "Running.", labels, registry=r).labels("m", "0").set(running)
    Gauge("vllm:cache_config_info", "Cache.", [*labels, "block_size"], registry=r).labels(
        "m", "0", "16"
    ).set(1)
    latency = Histogram(
        "vllm:e2e_request_latency_seconds", "Latency.", labels, buckets=(1.0,), registry=r
    ).labels("m", "0")
    for seconds in (0.5, 0.5, 3.5):
        latency.observe(seconds)
    return generate_latest(r).decode()


class _Families:
    def __init__(self, families) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


def _values(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_merged_series():
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        _Families(merge_expositions([_exposition(10, 40, 0.2, 3), _exposition(30, 60, 0.6, 1)]))
    )
    values = _values(generate_latest(registry).decode())
    labels = frozenset({"engine": "0", "model_name": "m"}.items())
    assert values[("vllm:prefix_cache_hits_total", labels)] == 40
    assert values[("vllm:prefix_cache_queries_total", labels)] == 100
    assert values[("vllm:num_requests_running", labels)] == 4
    assert abs(values[("vllm:kv_cache_usage_perc", labels)] - 0.4) < 1e-9
    info = labels | {("block_size", "16")}
    assert values[("vllm:cache_config_info", info)] == 1
    bucket = labels | {("le", "+Inf")}
    assert values[("vllm:e2e_request_latency_seconds_bucket", bucket)] == 6
    assert values[("vllm:e2e_request_latency_seconds_sum", labels)] == 9
    assert not any(name.endswith("_created") for name, _ in values)


def test_nothing_to_merge_and_a_bad_scrape_left_out():
    assert merge_expositions([]) == []
    merged = merge_expositions(["<html>bad gateway</html>", _exposition(1, 2, 0.5, 1)])
    assert {m.name for m in merged} >= {"vllm:prefix_cache_hits", "vllm:kv_cache_usage_perc"}
