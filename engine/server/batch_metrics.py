"""Batch progress in /metrics: per running batch, its lines by state (a bounded label set: only
batches this process runs now), and lines finished since start by outcome."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.server.batch_runner import BatchRunner


class BatchMetrics:
    def __init__(self, runner: BatchRunner, registry: CollectorRegistry) -> None:
        self.runner = runner
        registry.register(self)

    def describe(self):
        return []  # collected at scrape time only; no fixed samples to check at registration

    def collect(self):
        requests = GaugeMetricFamily(
            "nightshift:batch_requests",
            "Lines of each batch being run, by state (total, completed, failed, running).",
            labels=["batch_id", "state"],
        )
        for batch in list(self.runner.active.values()):
            for state, value in (
                ("total", batch.total),
                ("completed", batch.completed),
                ("failed", batch.failed),
                ("running", len(batch.running)),
            ):
                requests.add_metric([batch.batch_id, state], value)
        yield requests
        yield GaugeMetricFamily(
            "nightshift:batches_running", "Batches this server runs now.", len(self.runner.active)
        )
        finished = CounterMetricFamily(
            "nightshift:batch_lines_finished",
            "Batch lines finished since start: completed (2xx), failed, expired (never ran).",
            labels=["outcome"],
        )
        for outcome, value in self.runner.lines_finished.items():
            finished.add_metric([outcome], value)
        yield finished
