"""Prometheus metrics (prefix `nightshift:`). Engine state (queues, KV usage, prefix-cache and
preemption counts) is read at scrape time; per-request histograms are observed as requests end."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.async_engine import AsyncEngine
from engine.errors import EngineShutdownError, RequestFailedError
from engine.outputs import RequestOutput
from engine.spec.stats import SpecDecodeStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class _EngineState:
    """The engine's counters at scrape time, from the snapshot it publishes after each step."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        yield GaugeMetricFamily(
            "nightshift:num_requests_running", "Requests being computed.", value=stats.num_running
        )
        yield GaugeMetricFamily(
            "nightshift:num_requests_waiting",
            "Requests waiting to start.",
            value=stats.num_waiting,
        )
        yield GaugeMetricFamily(
            "nightshift:kv_cache_usage_perc",
            "Fraction of KV blocks held by requests.",
            value=stats.kv_cache_usage,
        )
        yield CounterMetricFamily(
            "nightshift:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            value=stats.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            "nightshift:prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            value=stats.prefix_cache_hits,
        )
        yield CounterMetricFamily(
            "nightshift:num_preemptions", "Requests preempted.", value=stats.num_preemptions
        )
        if stats.spec_decode is not None:
            yield from _spec_decode_families(stats.spec_decode)


def _spec_decode_families(stats: SpecDecodeStats):
    """vLLM's spec-decode counters, plus the two ratios a dashboard wants without PromQL."""
    yield CounterMetricFamily(
        "nightshift:spec_decode_num_drafts",
        "Verifications of at least one proposed token.",
        value=stats.num_drafts,
    )
    yield CounterMetricFamily(
        "nightshift:spec_decode_num_draft_tokens",
        "Proposed tokens verified.",
        value=stats.num_draft_tokens,
    )
    yield CounterMetricFamily(
        "nightshift:spec_decode_num_accepted_tokens",
        "Proposed tokens accepted.",
        value=stats.num_accepted_tokens,
    )
    per_position = CounterMetricFamily(
        "nightshift:spec_decode_num_accepted_tokens_per_pos",
        "Accepted proposed tokens by position in the draft (0 is the first).",
        labels=["position"],
    )
    for position, count in enumerate(stats.accepted_per_position):
        per_position.add_metric([str(position)], count)
    yield per_position
    yield GaugeMetricFamily(
        "nightshift:spec_decode_acceptance_rate",
        "Accepted over proposed tokens, since start.",
        value=stats.acceptance_rate,
    )
    yield GaugeMetricFamily(
        "nightshift:spec_decode_mean_acceptance_length",
        "Tokens per verification (accepted + 1), since start.",
        value=stats.mean_acceptance_length,
    )


class ServerMetrics:
    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineState(engine))
        r = self.registry
        self.prompt_tokens = Counter("nightshift:prompt_tokens", "Prompt tokens.", registry=r)
        self.generation_tokens = Counter(
            "nightshift:generation_tokens", "Generated tokens.", registry=r
        )
        self.finished = Counter(
            "nightshift:request_success",
            "Finished requests by reason.",
            ["finished_reason"],
            registry=r,
        )
        self.aborted = Counter(
            "nightshift:request_aborted",
            "Requests ended before they finished: client_disconnect (the client left, streaming "
            "or not) or shutdown (the grace period after SIGTERM ran out).",
            ["reason"],
            registry=r,
        )
        self.failed = Counter(
            "nightshift:request_failed",
            "Accepted requests the engine failed (each alone; the others went on).",
            registry=r,
        )
        self.rejected = Counter(
            "nightshift:request_rejected",
            "Requests refused at admission, by code (queue_full: over --max-waiting-requests).",
            ["code"],
            registry=r,
        )
        self.ttft = Histogram(
            "nightshift:time_to_first_token_seconds",
            "Time to first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "nightshift:time_per_output_token_seconds",
            "Mean time per output token after the first.",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "nightshift:e2e_request_latency_seconds",
            "Arrival to finish.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.step = Histogram(
            "nightshift:step_seconds", "Engine step wall time.", buckets=_STEP_BUCKETS, registry=r
        )
        engine.step_observers.append(lambda elapsed, _outputs: self.step.observe(elapsed))

    def count_failure(self, e: BaseException) -> None:
        """A request that ended with an error after admission."""
        if isinstance(e, EngineShutdownError):
            self.aborted.labels("shutdown").inc()
        elif isinstance(e, RequestFailedError):
            self.failed.inc()

    def observe_finished(self, final: RequestOutput) -> None:
        m = final.metrics
        self.prompt_tokens.inc(len(final.prompt_token_ids))
        generated = sum(len(o.token_ids) for o in final.outputs)
        self.generation_tokens.inc(generated)
        for o in final.outputs:
            self.finished.labels(o.finish_reason or "abort").inc()
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            if m.finish_time is not None:
                self.e2e.observe(m.finish_time - m.arrival_time)
                if generated > len(final.outputs):
                    per_token = (m.finish_time - m.first_token_time) / (
                        generated / len(final.outputs) - 1
                    )
                    self.tpot.observe(per_token)
